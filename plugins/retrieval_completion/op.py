"""CUDA implementations of ``macattn::completion_cache`` and ``macattn::retrieval_completion``
(registered by ``macattn.methods.completion.ops.register_cuda_kernels``; the JIT impls of the
``mac::retrieval_completion`` / ``mac::completion_cache`` plugins); contract in ``checks.py``.

A decode step is four launches and no host sync (CUDA-graph capturable): ``_mid_logits``,
``torch.topk`` over them (``k = min(top_k, T)``, one row per query head), ``_decode_partial``
(split-K over anchors + retrieved tokens) and ``_decode_merge``.
Values of ``seq_lens`` / ``n_prefill`` are not range-checked here (that would sync).
"""
from __future__ import annotations

import torch
import triton

from .._triton_util import interpreting, num_sms
from ..aot import destination
from .checks import check_completion_cache_inputs, check_retrieval_completion_inputs, resolve_scale
from .kernel import _completion_cache, _decode_merge, _decode_partial, _mid_logits

__all__ = ["completion_cache_triton", "retrieval_completion_triton", "mid_topk_triton"]

_alloc = torch.empty   # the tests swap in a NaN-filling allocator to check every output element is written

# launch parameters of ``_decode_partial`` (benchmarks/bench_completion_decode.py --sweep times alternatives):
# each program gathers BLOCK_K rows per iteration; splits per (request, query head) are chosen so the
# grid covers about WAVES x the SMs, with at least MIN_ITEMS items per split
DECODE_LAUNCH = dict(BLOCK_K=32, num_warps=8, WAVES=2, MIN_ITEMS=128)


def num_splits(rows: int, items: int, device) -> int:
    """Splits per query head for ``rows = B·Hq`` heads of about ``items`` anchors + retrieved tokens."""
    want = -(-DECODE_LAUNCH["WAVES"] * num_sms(device) // max(rows, 1))
    return max(1, min(want, items // DECODE_LAUNCH["MIN_ITEMS"], 64))


def _pow2(n: int, lo: int = 16) -> int:
    return max(lo, triton.next_power_of_2(n))


def _unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def completion_cache_triton(log_phi_k, v_cache, n_prefill, n_sink: int, n_tail: int, *,
                            out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None):
    """Same contract as ``macattn.methods.completion.ops.completion_cache``: fp32 ``(comp_A [B, Hkv, F, d],
    comp_b [B, Hkv, F], comp_shift [B, Hkv, F])``; one launch, grid ``(B, Hkv)``. ``out``: optional
    contiguous destinations for the three (TensorRT's output buffers), returned."""
    check_completion_cache_inputs(log_phi_k, v_cache, n_prefill, n_sink, n_tail)
    B, H, T, F = log_phi_k.shape
    d = v_cache.shape[3]
    dev = v_cache.device
    a_out, b_out, shift_out = (None, None, None) if out is None else out
    a = destination(a_out, "out[0] (comp_A)", (B, H, F, d), torch.float32, dev, _alloc)
    b = destination(b_out, "out[1] (comp_b)", (B, H, F), torch.float32, dev, _alloc)
    shift = destination(shift_out, "out[2] (comp_shift)", (B, H, F), torch.float32, dev, _alloc)
    if B * H == 0:
        return a, b, shift
    lpk = _unit_last_stride(log_phi_k)
    v = _unit_last_stride(v_cache)
    _completion_cache[(B, H)](lpk, v, n_prefill.contiguous(), a, b, shift, *lpk.stride()[:3], *v.stride()[:3],
                              H, F, d, int(n_sink), int(n_tail), F_P=_pow2(F), D_P=_pow2(d), BLOCK_T=32,
                              num_warps=4)
    return a, b, shift


def mid_topk_triton(q, k_cache, n_prefill, n_sink: int, n_tail: int, top_k: int, scale: float) -> torch.Tensor:
    """Positions ``[B, Hq, min(top_k, T)]`` int64 of each query head's Top-k mid keys by ``scale·q·k``
    (q ``[B, Hq, d]``, k_cache ``[B, Hkv, T, d]`` with unit last stride, scale resolved). Rows whose mid
    is shorter than ``top_k`` are padded with positions outside their mid; order is unspecified."""
    B, Hq, d = q.shape
    Hkv, T = k_cache.shape[1], k_cache.shape[2]
    group = Hq // Hkv
    kk = min(top_k, T)
    if kk == 0:
        return torch.empty(B, Hq, 0, dtype=torch.int64, device=q.device)
    logits = _alloc(B, Hq, T, dtype=torch.float32, device=q.device)
    block_t = 64
    _mid_logits[(B * Hkv, triton.cdiv(T, block_t))](
        q, k_cache, n_prefill, logits, *k_cache.stride()[:3], Hkv, T, d, int(n_sink), int(n_tail), scale, GROUP=group,
        G_P=_pow2(group), D_P=_pow2(d), BLOCK_T=block_t, IEEE=q.dtype == torch.float32 or interpreting(), num_warps=4)
    return torch.topk(logits, kk, dim=-1, sorted=False).indices


def retrieval_completion_triton(q, k_cache, v_cache, seq_lens, n_prefill, log_phi_q, log_phi_k, comp_A, comp_b,
                                comp_shift, n_sink: int, n_tail: int, top_k: int, scale: float, *,
                                out: torch.Tensor | None = None):
    """Same contract as ``macattn.methods.completion.ops.retrieval_completion``: ``out [B, Hq, d]`` in q's dtype.
    ``out``: optional contiguous destination (TensorRT's output buffer), returned."""
    check_retrieval_completion_inputs(q, k_cache, v_cache, seq_lens, n_prefill, log_phi_q, log_phi_k, comp_A,
                                      comp_b, comp_shift, n_sink, n_tail, top_k, scale)
    B, Hq, d = q.shape
    Hkv = k_cache.shape[1]
    F = log_phi_q.shape[2]
    group = Hq // Hkv
    scale = resolve_scale(scale, d)
    dev = q.device
    out = destination(out, "out", (B, Hq, d), q.dtype, dev, _alloc)
    if B == 0:
        return out
    k = _unit_last_stride(k_cache)
    v = _unit_last_stride(v_cache)
    if v.stride() != k.stride():
        k, v = k.contiguous(), v.contiguous()
    lpk = _unit_last_stride(log_phi_k)
    q, lpq, comp_A, comp_b, comp_shift = (t.contiguous() for t in (q, log_phi_q, comp_A, comp_b, comp_shift))
    seq_lens, n_prefill = seq_lens.contiguous(), n_prefill.contiguous()
    idx = mid_topk_triton(q, k, n_prefill, n_sink, n_tail, top_k, scale)
    K = idx.shape[2]
    n_split = num_splits(B * Hq, K + n_sink + n_tail, dev)
    f32 = dict(dtype=torch.float32, device=dev)
    pm, pl = _alloc(B, Hq, n_split, **f32), _alloc(B, Hq, n_split, **f32)
    pacc = _alloc(B, Hq, n_split, d, **f32)
    # written only for rows that use the completion (the merge reads them only there)
    psb, psa = _alloc(B, Hq, n_split, F, **f32), _alloc(B, Hq, n_split, F, d, **f32)
    launch = {name: val for name, val in DECODE_LAUNCH.items() if name in ("BLOCK_K", "num_warps")}
    _decode_partial[(B, Hq, n_split)](q, k, v, seq_lens, n_prefill, lpk, comp_shift, idx, pm, pl, pacc, psb, psa,
                                      *k.stride()[:3], *lpk.stride()[:3], Hq, Hkv, d, F, K, int(n_sink),
                                      int(n_tail), int(top_k), scale, GROUP=group, D_P=_pow2(d), F_P=_pow2(F),
                                      **launch)
    _decode_merge[(B, Hq)](n_prefill, lpq, comp_A, comp_b, comp_shift, pm, pl, pacc, psb, psa, out, Hq, Hkv, d, F,
                           int(n_sink), int(n_tail), int(top_k), n_split, GROUP=group, D_P=_pow2(d), F_P=_pow2(F),
                           S_P=_pow2(n_split, 2), num_warps=4)
    return out
