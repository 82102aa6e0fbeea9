"""Bottom-right causal flash attention of a short query block over a long key sequence, split over the keys.

A continued prefill chunk, or MAC's ring seeding, is ``n`` queries over ``K >> n`` keys. Flash attention gives
one program to each 128 query rows of each head, so ``n = 1,028`` queries of 32 heads make 288 programs: on an
H100's 132 SMs about one wave and a straggling remainder. Measured on the H100: the far part of a later multi-turn
32K turn ran at 226 TFLOP/s, 2.35 ms per layer, and 12.8 ms less over 32 layers once split
(``benchmarks/notes/serving.md``).
``flash_lower_right`` splits the keys that every query sees into ``s`` equal parts run as one batched flash call
(``s`` times the programs), runs the rest bottom-right causal, and merges the parts by their log-sum-exps:
FlashDecoding's split-KV, for a block of queries. ``kv_splits`` picks ``s``.

``flash_varlen`` is the same flash forward over several sequences packed back to back (FlashAttention's
``cu_seqlens`` layout): one launch for a packed prefill's fresh segments instead of one per segment, which at
1K-token segments is host- and launch-bound (``benchmarks/notes/serving.md``, sixth pass).
``flash_varlen_reference`` is its plain-torch definition.
"""
from __future__ import annotations

import functools

import torch

__all__ = ["flash_forward", "flash_lower_right", "flash_lower_right_reference", "flash_varlen", "flash_varlen_reference",
           "kv_splits", "BLOCK_M",
           "MIN_SPLIT_KEYS", "PROGRAMS_PER_SM"]

BLOCK_M = 128
"""Query rows per flash program (torch's flash-attention forward at head dim <= 256)."""
MIN_SPLIT_KEYS = 2048
"""Fewest keys per split: shorter splits cost more in launch and merge than they give back."""
PROGRAMS_PER_SM = 8
"""Programs per SM a split call aims at (about four waves of two resident programs), so the last wave's
remainder is a small share of the call."""


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def kv_splits(n: int, num_heads: int, num_keys: int, device: torch.device) -> int:
    """How many key splits ``flash_lower_right`` uses for ``n`` queries of ``num_heads`` heads over ``num_keys``
    keys: 1 where the queries alone already give ``PROGRAMS_PER_SM`` programs per SM, else enough splits to
    reach that, each of at least ``MIN_SPLIT_KEYS`` of the keys every query sees."""
    programs = num_heads * -(-n // BLOCK_M)
    want = PROGRAMS_PER_SM * _sm_count(device)
    if programs >= want:
        return 1
    return max(1, min(-(-want // programs), (num_keys - n + 1) // MIN_SPLIT_KEYS))


def flash_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                  window_left: int | None = None):
    """torch's flash forward on ``[B, S, H, d]`` operands (``Hq`` a multiple of ``Hkv``; causal is bottom-right):
    ``(out [B, n, Hq, d] in q's dtype, lse [B, Hq, n] fp32)``. ``window_left``: each query also sees at most that
    many keys before its own (a torch without windows raises ``TypeError`` / ``RuntimeError``)."""
    window = {} if window_left is None else dict(window_size_left=window_left, window_size_right=0)
    out, lse = torch.ops.aten._flash_attention_forward(q, k, v, None, None, q.shape[1], k.shape[1], 0.0, causal,
                                                       False, scale=scale, **window)[:2]
    return out, lse


def flash_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                 max_q: int, max_k: int, *, scale: float, seqused_k: torch.Tensor | None = None,
                 lse: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Bottom-right causal flash attention of ``B`` packed sequences: ``q [Nq, Hq, d]``, ``k / v [Nk, Hkv, d]``
    (CUDA, fp16 / bf16, ``Hq`` a multiple of ``Hkv``, contiguous last dimension), ``cu_q / cu_k [B + 1]`` int32 on
    their device. Sequence ``b``'s queries are rows ``cu_q[b] .. cu_q[b + 1] - 1``, its keys the first
    ``seqused_k[b]`` (default: all ``cu_k[b + 1] - cu_k[b]``) rows from ``cu_k[b]``; query ``i`` of ``n`` over
    ``m`` keys sees keys ``0 .. m - n + i``. ``max_q / max_k``: the longest query / key count (host ints).
    Returns ``(out [Nq, Hq, d] in q's dtype, lse [Hq, Nq] fp32)``; a query that sees no key gets ``out = 0``,
    ``lse = -inf`` (the kernel's ``+inf`` for an empty row, replaced). ``lse=False``: ``(out, None)``, and no
    launch spent on the log-sum-exp."""
    Nq, Hq = q.shape[0], q.shape[1]
    if max_k <= 0:
        return (q.new_zeros(q.shape[0], Hq, v.shape[-1]),
                q.new_full((Hq, Nq), float("-inf"), dtype=torch.float32) if lse else None)
    out, got = torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, True, False,
                                                       scale=scale, seqused_k=seqused_k)[:2]
    if not lse:
        return out, None
    if got.shape != (Hq, Nq):       # older flash builds pad it per sequence, [B, Hq, max_q]: not this layout
        raise RuntimeError(f"flash varlen returned a log-sum-exp of shape {tuple(got.shape)}, expected "
                           f"[Hq={Hq}, Nq={Nq}] (torch {torch.__version__})")
    return out, got.float().nan_to_num_(posinf=float("-inf"))      # one launch: empty rows' +inf -> -inf


def flash_varlen_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor,
                           cu_k: torch.Tensor, max_q: int, max_k: int, *, scale: float,
                           seqused_k: torch.Tensor | None = None, lse: bool = True
                           ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The definition of ``flash_varlen`` in plain torch, same arguments: each sequence's queries that see a key
    (its last ``min(n, m)``) through ``flash_lower_right_reference`` (fp64), the rest empty. Returns
    ``(out [Nq, Hq, d] in q's dtype, lse [Hq, Nq] fp32 or None)``; ``max_q / max_k`` are not needed here."""
    Nq, Hq = q.shape[:2]
    out = torch.zeros(Nq, Hq, v.shape[-1], dtype=torch.float64, device=q.device)
    sums = torch.full((Hq, Nq), float("-inf"), dtype=torch.float64, device=q.device)
    cq, ck = cu_q.tolist(), cu_k.tolist()
    used = None if seqused_k is None else seqused_k.tolist()
    for b in range(len(cq) - 1):
        n, m = cq[b + 1] - cq[b], (ck[b + 1] - ck[b]) if used is None else used[b]
        if n == 0 or m <= 0:
            continue
        rows = slice(cq[b + 1] - min(n, m), cq[b + 1])         # query i sees keys 0 .. m - n + i: i >= n - m
        o, l = flash_lower_right_reference(q[rows].transpose(0, 1).unsqueeze(0),
                                           k[ck[b]: ck[b] + m].transpose(0, 1).unsqueeze(0),
                                           v[ck[b]: ck[b] + m].transpose(0, 1).unsqueeze(0), scale)
        out[rows], sums[:, rows] = o[0].transpose(0, 1), l[0]
    return out.to(q.dtype), sums.float() if lse else None


def _acc(x: torch.Tensor) -> torch.Tensor:
    """``x`` in fp32, or fp64 where it is fp64 (the CPU checks run the split logic in fp64)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def flash_lower_right(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
                      splits: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``query [1, Hq, n, d]`` (CUDA, fp16 / bf16) over ``key / value [1, Hkv, K, d]`` (``K >= n``, ``Hq`` a
    multiple of ``Hkv``, any strides with a contiguous last dimension), bottom-right causal: query ``i`` sees keys
    ``0 .. K - n + i``. Returns ``(out [1, Hq, n, d] fp32, lse [1, Hq, n] fp32)``; ``out`` carries the kernel's
    fp16 / bf16 rounding of each part (fp64 operands, which only the CPU checks' stand-in kernel takes, stay fp64).

    ``splits`` (default ``kv_splits``): the ``K - n + 1`` keys every query sees, less a remainder of 1 .. s keys,
    run as ``s`` equal parts in one batched call (the query block repeated per part); the remainder and the
    causal triangle as one bottom-right-causal call; the parts merged in fp32 by their log-sum-exps."""
    n, K = query.shape[2], key.shape[2]
    s = kv_splits(n, query.shape[1], K, query.device) if splits is None else splits
    q = query[0].transpose(0, 1)                                  # [n, Hq, d]
    k, v = key[0].transpose(0, 1), value[0].transpose(0, 1)       # [K, Hkv, d]
    split = ((K - n) // s) * s if s > 1 else 0                   # keys of the split parts; the rest >= 1 per query
    if split < s:
        out, lse = flash_forward(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), True, scale)
        return _acc(out).transpose(1, 2), _acc(lse)
    o_s, l_s = flash_forward(q.unsqueeze(0).expand(s, *q.shape).contiguous(),
                             k[:split].unflatten(0, (s, split // s)), v[:split].unflatten(0, (s, split // s)),
                             False, scale)
    o_t, l_t = flash_forward(q.unsqueeze(0), k[split:].unsqueeze(0), v[split:].unsqueeze(0), True, scale)
    l_s, l_t = _acc(l_s), _acc(l_t)
    lse = torch.logaddexp(torch.logsumexp(l_s, 0, keepdim=True), l_t)            # [1, Hq, n]
    w_s = torch.exp(l_s - lse).transpose(1, 2).unsqueeze(-1)                      # [s, n, Hq, 1]
    w_t = torch.exp(l_t - lse).transpose(1, 2).unsqueeze(-1)
    out = (o_s * w_s).sum(0, keepdim=True) + o_t * w_t                             # [1, n, Hq, d] fp32
    return out.transpose(1, 2), lse


def flash_lower_right_reference(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The definition of ``flash_lower_right`` in plain torch, in fp64: ``(out [1, Hq, n, d], lse [1, Hq, n])``."""
    n, K, Hq = query.shape[2], key.shape[2], query.shape[1]
    g = Hq // key.shape[1]
    q = query.double()
    k, v = key.double().repeat_interleave(g, 1), value.double().repeat_interleave(g, 1)
    logits = (q @ k.transpose(-1, -2)) * scale                                   # [1, Hq, n, K]
    seen = torch.arange(K, device=q.device).view(1, K) <= (K - n + torch.arange(n, device=q.device)).view(n, 1)
    logits = logits.masked_fill(~seen, float("-inf"))
    lse = torch.logsumexp(logits, -1)
    return torch.softmax(logits, -1) @ v, lse
