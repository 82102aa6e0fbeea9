"""Automatic prefix caching (vLLM v1's, over the paged pool): what identifies a cached KV block.

A full block of a prompt is identified by a hash chain: block ``i``'s key is
``blake2b(key of block i - 1 || its block_size token ids)``, the chain starting from the engine's salt
(``cache_salt``: everything besides the tokens that changes the K/V a prefill writes — model, dtype, block
size, method and its config). Two prompts share block ``i``'s key exactly when they share their first
``(i + 1) * block_size`` tokens (up to a 128-bit collision). ``BlockManager`` maps keys to blocks, counts
holders and keeps cached blocks no request holds reusable until an allocation needs them (LRU).

``PrefixCacheStats`` counts the lookups in tokens, with vLLM's meaning: ``queries`` the prompt tokens of
the requests looked up, ``hits`` those served from cached blocks.
"""
from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass

__all__ = ["cache_salt", "block_hashes", "PrefixCacheStats"]

_DIGEST = 16          # bytes of a block key (blake2b-128)


def cache_salt(*parts: object) -> bytes:
    """The root of every hash chain of one engine: a digest of ``repr(parts)`` (the settings that change
    the K/V of a token prefix)."""
    return hashlib.blake2b(repr(parts).encode(), digest_size=_DIGEST).digest()


def block_hashes(tokens: list[int], block_size: int, salt: bytes) -> tuple[bytes, ...]:
    """The keys of the full blocks of ``tokens`` (``len(tokens) // block_size`` of them), 16 bytes each:
    key ``i`` covers ``tokens[: (i + 1) * block_size]`` (module doc). One hash per block, no per-token work."""
    data = array("q", tokens).tobytes()
    step = block_size * array("q").itemsize
    out, parent = [], salt
    for i in range(len(tokens) // block_size):
        parent = hashlib.blake2b(parent + data[i * step:(i + 1) * step], digest_size=_DIGEST).digest()
        out.append(parent)
    return tuple(out)


@dataclass
class PrefixCacheStats:
    """Counters since the engine started (vLLM's ``prefix_cache_queries`` / ``prefix_cache_hits``, in tokens):
    ``queries``: prompt tokens of the requests admitted with a lookup; ``hits``: those served from cached
    blocks (not prefilled)."""

    queries: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        """``hits / queries`` (0.0 before any query)."""
        return self.hits / self.queries if self.queries else 0.0
