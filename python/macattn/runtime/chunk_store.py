"""A3 chunk KV store: each document chunk's pre-RoPE keys and values, every layer, on disk.

One safetensors file per chunk, ``<key>.safetensors``, where ``key`` is the sha256 over
``model_id``, ``tokenizer_id``, the KV dtype, the layout tag and the chunk's int64 token ids.
Tensors: ``k``, ``v`` ``[num_layers, T, Hkv, d]`` (keys *before* RoPE, computed at positions
``0 .. T-1``) and ``token_ids`` int64 ``[T]``. The safetensors header metadata holds
``model_id``, ``tokenizer_id``, ``key``, ``payload_sha256`` (sha256 over the bytes of
``token_ids``, ``k``, ``v``), ``k_shape``, ``v_shape``, ``dtype``, ``num_layers``,
``num_tokens``, ``layout`` and ``created`` (unix time).

Integrity on load, through one open file (one version of the entry whatever writers do): it must be a
regular file no larger than the store's bound; its header is read and checked before the payload — metadata key / model id / tokenizer id / dtype /
shapes / token ids must match the request, then the payload hash must match the bytes. An entry that
fails any check is moved to ``.quarantine/`` beside the entries (``quarantined`` counts them, a warning
names it) and the lookup is a miss: the caller recomputes it (A3 recomputes the chunk, the completion
method prefills the prompt) — a bad entry never fails a request twice, nor any request at all.
Writers save to a unique temporary file in the same directory and ``os.replace`` it into place, so
readers (threads or processes) see either no file or a whole one; a write that fails (a full disk, a
read-only directory) is dropped with a warning (``write_failures``). The store is bounded by
``max_bytes``: after each write, least recently used entries (file mtime, refreshed on every hit) are
deleted until the total fits.

The same store keeps prompt prefixes for the offloaded completion method (``prefix_store``): keys
*after* RoPE, as the KV cache holds them, under their own layout tag (``PREFIX_LAYOUT``), so a prefix
entry and an A3 chunk of the same tokens never mix.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
import time
import uuid
import warnings
from pathlib import Path

import torch
from safetensors.torch import load, save_file

from macattn.models.attention import capture_pre_rope_kv, plain_attention

__all__ = ["LAYOUT", "PREFIX_LAYOUT", "ChunkStoreIntegrityError", "ChunkKVStore", "precompute_chunk_kv",
           "prefix_store", "model_fingerprint"]

LAYOUT = "macattn-a3-v1:k_pre_rope,v:[layers,tokens,kv_heads,head_dim]"
PREFIX_LAYOUT = "macattn-prefix-v1:k_post_rope,v:[layers,tokens,kv_heads,head_dim]"
_SUFFIX = ".safetensors"
_QUARANTINE = ".quarantine"
_log = logging.getLogger(__name__)


class ChunkStoreIntegrityError(ValueError):
    """A stored chunk entry is tampered with, truncated or belongs to another model / chunk (``inode``: the
    file that was read, when known)."""

    inode: int | None = None


def _ids_tensor(token_ids) -> torch.Tensor:
    ids = torch.as_tensor(token_ids)
    if ids.dim() != 1 or ids.numel() == 0 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise ValueError(f"token_ids must be a non-empty 1-D integer sequence, got shape {tuple(ids.shape)} "
                         f"dtype {ids.dtype}")
    return ids.to(torch.int64).contiguous()


def _payload_hash(ids: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str:
    h = hashlib.sha256()
    for t in (ids, k, v):
        h.update(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


@torch.inference_mode()
def precompute_chunk_kv(model, token_ids) -> tuple[torch.Tensor, torch.Tensor]:
    """Run ``token_ids`` alone (positions ``0 .. T-1``) through ``model`` (a LLaMA / Qwen2 /
    Mistral ``*ForCausalLM``, patched or not) and return its pre-RoPE keys and values,
    ``[num_layers, T, Hkv, d]`` each, in the model dtype on the model's device."""
    ids = _ids_tensor(token_ids)
    hf = model.config
    d = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    device = next(model.parameters()).device
    with plain_attention(model), capture_pre_rope_kv(model) as kv:
        model.model(input_ids=ids.view(1, -1).to(device), use_cache=False)
    T = ids.numel()
    k = torch.stack([kv[i][0][0].view(T, -1, d) for i in range(len(kv))])
    v = torch.stack([kv[i][1][0].view(T, -1, d) for i in range(len(kv))])
    return k, v


class ChunkKVStore:
    """directory: created if missing. model_id / tokenizer_id: strings naming the weights and
    tokenizer (part of every key). max_bytes: LRU bound (None = unbounded). layout: the tag naming
    what ``k`` / ``v`` hold (part of every key and checked on load; default A3's pre-RoPE chunks)."""

    def __init__(self, directory, *, model_id: str, tokenizer_id: str = "", max_bytes: int | None = None,
                 layout: str = LAYOUT) -> None:
        if not isinstance(model_id, str) or not model_id:
            raise ValueError(f"model_id must be a non-empty str, got {model_id!r}")
        if not isinstance(tokenizer_id, str):
            raise TypeError(f"tokenizer_id must be a str, got {type(tokenizer_id).__name__}")
        if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0):
            raise ValueError(f"max_bytes must be a positive int or None, got {max_bytes!r}")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.model_id, self.tokenizer_id, self.max_bytes, self.layout = model_id, tokenizer_id, max_bytes, layout
        self.hits = self.misses = self.quarantined = self.write_failures = 0

    def key(self, token_ids, dtype: torch.dtype) -> str:
        ids = _ids_tensor(token_ids)
        h = hashlib.sha256(json.dumps([self.model_id, self.tokenizer_id, str(dtype), self.layout]).encode())
        h.update(ids.numpy().tobytes())
        return h.hexdigest()

    def path(self, key: str) -> Path:
        return self.directory / f"{key}{_SUFFIX}"

    def entries(self) -> list[Path]:
        return sorted(self.directory.glob(f"*{_SUFFIX}"))

    @property
    def total_bytes(self) -> int:
        total = 0
        for p in self.entries():
            try:
                total += p.stat().st_size
            except FileNotFoundError:
                pass
        return total

    # --- write ----------------------------------------------------------------------------
    def put(self, token_ids, k: torch.Tensor, v: torch.Tensor) -> str:
        """Store ``k``, ``v`` ``[num_layers, T, Hkv, d]`` (same dtype) of chunk ``token_ids [T]``;
        returns the key. Atomic: a concurrent reader sees the old state or the whole entry."""
        ids = _ids_tensor(token_ids)
        if k.dim() != 4 or k.shape[1] != ids.numel():
            raise ValueError(f"k must be [num_layers, T={ids.numel()}, Hkv, d], got {tuple(k.shape)}")
        if v.shape[:2] != k.shape[:2] or v.dtype != k.dtype:
            raise ValueError(f"v must match k's layers/tokens and dtype: k {tuple(k.shape)} {k.dtype}, "
                             f"v {tuple(v.shape)} {v.dtype}")
        k, v = k.detach().contiguous().cpu(), v.detach().contiguous().cpu()
        key = self.key(ids, k.dtype)
        meta = {"model_id": self.model_id, "tokenizer_id": self.tokenizer_id, "key": key, "layout": self.layout,
                "payload_sha256": _payload_hash(ids, k, v), "k_shape": json.dumps(list(k.shape)),
                "v_shape": json.dumps(list(v.shape)), "dtype": str(k.dtype), "num_layers": str(k.shape[0]),
                "num_tokens": str(ids.numel()), "created": repr(time.time())}
        tmp = self.directory / f".{key}.{os.getpid()}.{uuid.uuid4().hex}.tmp"
        try:
            save_file({"token_ids": ids, "k": k, "v": v}, str(tmp), metadata=meta)
            os.replace(tmp, self.path(key))
        except OSError as exc:          # a full disk or a read-only store: the entry is dropped, the request runs on
            self.write_failures += 1
            warnings.warn(f"chunk store {self.directory}: entry {key[:16]} not written ({exc}); dropped",
                          RuntimeWarning, stacklevel=2)
            return key
        finally:
            tmp.unlink(missing_ok=True)
        self._evict(keep=self.path(key))
        return key

    def _evict(self, keep: Path) -> None:
        if self.max_bytes is None:
            return
        stats = []
        for p in self.entries():
            try:
                st = p.stat()
            except FileNotFoundError:
                continue
            stats.append((st.st_mtime_ns, st.st_size, p))
        total = sum(s for _, s, _ in stats)
        for _, size, p in sorted(stats):
            if total <= self.max_bytes:
                break
            if p == keep:
                continue
            p.unlink(missing_ok=True)
            total -= size

    # --- read -----------------------------------------------------------------------------
    def get(self, token_ids, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The verified ``(k, v)`` of chunk ``token_ids`` in ``dtype``, or None when absent — or when the entry
        fails a check, which quarantines it (module doc)."""
        ids = _ids_tensor(token_ids)
        key = self.key(ids, dtype)
        path = self.path(key)
        inode = None
        try:
            tensors, inode = self._read(path, key, ids, dtype)
        except FileNotFoundError:
            self.misses += 1
            return None
        except ChunkStoreIntegrityError as exc:
            self._quarantine(path, exc, exc.inode)
            self.misses += 1
            return None
        try:
            os.utime(path)   # LRU access time
        except FileNotFoundError:
            pass
        self.hits += 1
        return tensors["k"], tensors["v"]

    def _read(self, path: Path, key: str, ids: torch.Tensor, dtype: torch.dtype) -> tuple[dict, int]:
        """The entry's tensors and inode, through one open file (one version of it, whatever writers do): a
        regular file within the store's bound, its header checked before the payload is read, then the payload
        hash. Raises ``FileNotFoundError`` or ``ChunkStoreIntegrityError``."""
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))   # a FIFO must not block the open
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())

            def bad(what: str) -> ChunkStoreIntegrityError:
                err = ChunkStoreIntegrityError(f"chunk store entry {path.name} {what}")
                err.inode = st.st_ino
                return err

            if not stat.S_ISREG(st.st_mode):
                raise bad("is not a regular file")
            if self.max_bytes is not None and st.st_size > self.max_bytes:
                raise bad(f"has {st.st_size} bytes, over the store's max_bytes={self.max_bytes}")
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if not 0 < n <= min(st.st_size - 8, 1 << 24):
                raise bad("is unreadable: no safetensors header")
            try:
                header = json.loads(f.read(n))
                meta = header.get("__metadata__") or {}
            except ValueError as exc:
                raise bad(f"is unreadable: {exc}") from None
            try:
                self._verify_meta(path, key, dtype, meta)
                for name in ("k", "v"):        # shapes from the header, before the payload is read
                    shape = (header.get(name) or {}).get("shape")
                    if json.dumps(shape) != meta.get(f"{name}_shape") or len(shape) != 4 or shape[1] != ids.numel():
                        raise ChunkStoreIntegrityError(f"chunk store entry {path.name} rejected: {name} header "
                                                       f"shape {shape} does not fit {ids.numel()} tokens")
            except ChunkStoreIntegrityError as exc:
                exc.inode = st.st_ino
                raise
            f.seek(0)
            raw = f.read()
        try:
            tensors = load(raw)
        except Exception as exc:   # truncated / not a safetensors file
            raise bad(f"is unreadable: {exc}") from None
        try:
            if set(tensors) != {"token_ids", "k", "v"}:
                raise ChunkStoreIntegrityError(f"chunk store entry {path.name} rejected: tensors are "
                                               f"{sorted(tensors)}, expected ['k', 'token_ids', 'v']")
            self._verify(path, key, ids, dtype, meta, tensors)
        except ChunkStoreIntegrityError as exc:
            exc.inode = st.st_ino
            raise
        return tensors, st.st_ino

    def _quarantine(self, path: Path, exc: Exception, inode: int | None) -> None:
        """Move a bad entry out of the way (``.quarantine/``; deleted when it cannot be moved) — only the file
        that was read: a writer may have replaced it with a whole entry since."""
        self.quarantined += 1
        try:
            if inode is None or os.lstat(path).st_ino == inode:
                qdir = self.directory / _QUARANTINE
                qdir.mkdir(exist_ok=True)
                os.replace(path, qdir / f"{path.name}.{uuid.uuid4().hex[:8]}")
        except FileNotFoundError:
            pass
        except OSError:
            path.unlink(missing_ok=True)
        warnings.warn(f"{exc}; quarantined, the entry is recomputed", RuntimeWarning, stacklevel=3)
        _log.warning("%s; quarantined", exc)

    def _verify_meta(self, path, key, dtype, meta) -> None:
        for name, want in (("key", key), ("model_id", self.model_id), ("tokenizer_id", self.tokenizer_id),
                           ("layout", self.layout), ("dtype", str(dtype))):
            if meta.get(name) != want:
                raise ChunkStoreIntegrityError(f"chunk store entry {path.name} rejected: {name} is "
                                               f"{meta.get(name)!r}, expected {want!r}")

    def _verify(self, path, key, ids, dtype, meta, tensors) -> None:
        def fail(what):
            raise ChunkStoreIntegrityError(f"chunk store entry {path.name} rejected: {what}")

        k, v, stored_ids = tensors["k"], tensors["v"], tensors["token_ids"]
        for name, t in (("k", k), ("v", v)):
            if json.dumps(list(t.shape)) != meta.get(f"{name}_shape") or str(t.dtype) != str(dtype):
                fail(f"{name} is {tuple(t.shape)} {t.dtype}, metadata says {meta.get(f'{name}_shape')} {meta.get('dtype')}")
            if t.dim() != 4 or t.shape[1] != ids.numel() or str(t.shape[0]) != meta.get("num_layers"):
                fail(f"{name} shape {tuple(t.shape)} does not fit {ids.numel()} tokens / "
                     f"{meta.get('num_layers')} layers")
        if stored_ids.dtype != torch.int64 or not torch.equal(stored_ids, ids):
            fail("token ids differ from the requested chunk")
        if _payload_hash(stored_ids, k, v) != meta.get("payload_sha256"):
            fail("payload sha256 mismatch (tensor bytes were modified)")

    def get_or_compute(self, model, token_ids) -> tuple[torch.Tensor, torch.Tensor]:
        """Stored ``(k, v)`` of the chunk, computing (``precompute_chunk_kv``) and storing it on a miss."""
        dtype = next(model.parameters()).dtype
        hit = self.get(token_ids, dtype)
        if hit is not None:
            return hit
        k, v = precompute_chunk_kv(model, token_ids)
        self.put(token_ids, k, v)
        return k, v


def prefix_store(directory, *, model_id: str, tokenizer_id: str = "", max_bytes: int | None = None) -> ChunkKVStore:
    """The completion method's on-disk tier: a ``ChunkKVStore`` of prompt prefixes' ``k, v [L, T, Hkv, d]``
    (keys after RoPE, as the KV cache holds them) under ``PREFIX_LAYOUT``, so its entries never mix with
    A3's pre-RoPE chunks; every load checks model identity, token ids, dtype, shapes and the payload sha256."""
    return ChunkKVStore(directory, model_id=model_id, tokenizer_id=tokenizer_id, max_bytes=max_bytes,
                        layout=PREFIX_LAYOUT)


def model_fingerprint(model) -> str:
    """A model id for store keys: the config's ``_name_or_path`` (or class name) plus a sha256 of
    the config and of up to 4096 leading elements of the first and last parameters, so two
    differently initialised / trained models of one name never share entries."""
    cfg = {k: v for k, v in model.config.to_dict().items() if not k.startswith("_") and k != "attn_implementation"}
    h = hashlib.sha256(json.dumps(cfg, sort_keys=True, default=str).encode())
    params = list(model.parameters())
    for p in (params[0], params[-1]):
        h.update(p.detach().reshape(-1)[:4096].float().cpu().numpy().tobytes())
    name = getattr(model.config, "_name_or_path", "") or type(model).__name__
    return f"{name}@{h.hexdigest()[:16]}"
