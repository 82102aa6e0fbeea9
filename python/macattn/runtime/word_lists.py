"""TensorRT-LLM's stop / bad word lists and the host-side checks of ``ModelRunner.generate``.

A word is a list of token ids. TensorRT-LLM passes a request's words in one of two layouts:

* the offsets layout ``[2, N]`` int32 (the Python session's ``stop_words_list`` / ``bad_words_list`` are
  ``[batch, 2, N]``, Triton's ``STOP_WORDS_IDS`` / ``BAD_WORDS_IDS`` ``[2, N]``): row 0 the words' token ids back
  to back, row 1 each word's end offset, ``-1`` padded (``tensorrt_llm.runtime.to_word_list_format``);
* nested lists ``[batch][word][token]`` (``ModelRunnerCpp``, ``tensorrt_llm.runtime.decode_words_list``).

Semantics (TensorRT-LLM's): a stop word ends a request once its tokens (prompt and output together) end with
it, the word kept in the output; a bad word is never completed: a single-token one is never generated, a longer
one's last token is banned at a step where the tokens so far end with the rest of it.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

import numpy as np
import torch

from macattn.runtime.sampling import MAX_LOGIT_BIAS, SamplingConfig

__all__ = ["parse_word_list", "words_per_request", "ends_with_word", "banned_next", "with_bans"]


def parse_word_list(arr, name: str) -> list[list[int]]:
    """The words of one ``[2, N]`` (or ``[1, 2, N]``) offsets-layout word list."""
    arr = arr.detach().cpu().numpy() if isinstance(arr, torch.Tensor) else np.asarray(arr)
    if arr.ndim == 3 and arr.shape[0] == 1:
        arr = arr[0]
    if arr.ndim != 2 or arr.shape[0] != 2:
        raise ValueError(f"{name} must be a [2, N] word list (ids, end offsets), got shape {list(arr.shape)}")
    ids, ends = arr[0].tolist(), [int(e) for e in arr[1].tolist() if e >= 0]
    if ends != sorted(ends) or (ends and ends[-1] > len(ids)):
        raise ValueError(f"{name}: end offsets must increase and stay within the {len(ids)} ids, got {ends}")
    words, start = [], 0
    for e in ends:
        if e > start:
            words.append([int(t) for t in ids[start:e]])
        start = e
    return words


def words_per_request(value, batch: int, name: str, vocab_size: int) -> list[list[list[int]]]:
    """Each of ``batch`` requests' words from ``value``: None (no words); a ``[batch, 2, N]`` integer tensor or
    array in the offsets layout (``[2, N]``: the same words for every request); or nested lists
    ``[batch][word][token]``. Token ids are checked against ``vocab_size``; errors name ``name[i]``."""
    if value is None:
        return [[] for _ in range(batch)]
    if isinstance(value, (torch.Tensor, np.ndarray)):
        integer = (not (value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool)
                   if isinstance(value, torch.Tensor) else np.issubdtype(value.dtype, np.integer))
        if not integer:
            raise TypeError(f"{name} must be an integer tensor (int32) in TensorRT-LLM's [batch, 2, N] layout, "
                            f"got dtype {value.dtype}")
        if value.ndim == 2:
            per = [parse_word_list(value, name)] * batch
        elif value.ndim == 3 and value.shape[0] == batch:
            per = [parse_word_list(value[i], f"{name}[{i}]") for i in range(batch)]
        else:
            raise ValueError(f"{name} must have shape [batch={batch}, 2, N] (TensorRT-LLM's word-list layout), "
                             f"got {list(value.shape)}")
    elif isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        if len(value) != batch:
            raise ValueError(f"{name} must hold one list of words per request ({batch}), got {len(value)}")
        per = []
        for i, words in enumerate(value):
            if words is None:
                per.append([])
                continue
            if not isinstance(words, Sequence) or isinstance(words, (str, bytes)) or any(
                    not isinstance(w, Sequence) or isinstance(w, (str, bytes)) for w in words):
                raise TypeError(f"{name}[{i}] must be a list of words, each a list of token ids, got {words!r}")
            flat = [t for w in words for t in w]
            if any(isinstance(t, bool) or not isinstance(t, (int, np.integer)) for t in flat):
                raise TypeError(f"{name}[{i}]: token ids must be ints, got {words!r}")
            per.append([[int(t) for t in w] for w in words if len(w)])
    else:
        raise TypeError(f"{name} must be a [batch, 2, N] int32 tensor or a list of word lists per request, "
                        f"got {type(value).__name__}")
    for i, words in enumerate(per):
        bad = sorted({t for w in words for t in w if not 0 <= t < vocab_size})
        if bad:
            raise ValueError(f"{name}[{i}]: token ids must lie in [0, {vocab_size - 1}], got {bad}")
    return per


def ends_with_word(tokens: list[int], words: list[list[int]]) -> bool:
    """Whether ``tokens`` end with one of ``words``."""
    return any(len(tokens) >= len(w) and tokens[len(tokens) - len(w):] == w for w in words)


def banned_next(tokens: list[int], words: list[list[int]]) -> set[int]:
    """The tokens that would complete one of the bad ``words`` if generated after ``tokens``: every
    single-token word, and the last token of each longer word whose other tokens end ``tokens``."""
    return {w[-1] for w in words if len(w) == 1 or ends_with_word(tokens, [w[:-1]])}


def with_bans(params: SamplingConfig, banned: Iterable[int]) -> SamplingConfig:
    """``params`` with the ``banned`` token ids at logit bias ``-inf`` (never sampled; any bias given for them
    is replaced). ``SamplingConfig`` validates ``logit_bias`` to the OpenAI range [-100, 100], so the bans are set
    after it: the sampler's bias table takes ``-inf`` (its ``min_tokens`` bans are ``-inf`` too)."""
    banned = set(banned)
    if not banned:
        return params
    merged = {**dict(params.logit_bias), **{t: float("-inf") for t in banned}}
    if len(merged) > MAX_LOGIT_BIAS:
        raise ValueError(f"{len(merged)} tokens banned or biased at once; the sampler's bias table holds "
                         f"{MAX_LOGIT_BIAS}")
    out = dataclasses.replace(params)
    object.__setattr__(out, "logit_bias", tuple(sorted(merged.items())))
    return out
