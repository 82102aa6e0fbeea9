"""CUDA implementations of ``macattn::completion_cache`` and ``macattn::retrieval_completion``
(registered by ``macattn.methods.completion.ops.register_cuda_kernels``; the JIT impls of the
``mac::retrieval_completion`` / ``mac::completion_cache`` plugins); contract in ``checks.py``.

A decode step is four launches and no host sync (CUDA-graph capturable): ``_mid_logits``,
``torch.topk`` over them (``k = min(top_k, T)``, one row per query head), ``_decode_partial``
(split-K over anchors + retrieved tokens, one program per query head) and ``decode_merge``: the tail
``decode_retrieved_triton``, which the offloaded decode shares over its hot-page cache. The page variant
(``page_retrieval_completion_triton``) selects pages with ``macattn.plugins.page_select`` (two launches)
and ends in ``decode_pages_triton``: ``decode_partial_pages`` (one program per KV head's query group over
its pages) and the same merge.
Values of ``seq_lens`` / ``n_prefill`` are not range-checked here (that would sync).
"""
from __future__ import annotations

import torch
import triton

from ..triton_util import interpreting, num_sms
from ..aot import destination
from macattn.core.validation import check_int

from ..page_select.op import select_pages
from .checks import check_completion_cache_inputs, check_retrieval_completion_inputs, resolve_scale
from .kernel import _completion_cache, decode_merge, _decode_partial, decode_partial_pages, _mid_logits

__all__ = ["completion_cache_triton", "retrieval_completion_triton", "mid_topk_triton", "page_retrieval_completion_triton",
           "decode_retrieved_triton", "decode_pages_triton", "select_mid_pages", "page_positions"]

_alloc = torch.empty   # the tests swap in a NaN-filling allocator to check every output element is written

# launch parameters of ``_decode_partial`` (benchmarks/bench_completion_decode.py --sweep times alternatives):
# each program gathers BLOCK_K rows per iteration; splits per (request, query head) are chosen so the
# grid covers about WAVES x the SMs, with at least MIN_ITEMS items per split
DECODE_LAUNCH = dict(BLOCK_K=32, num_warps=8, WAVES=2, MIN_ITEMS=128)
# ``decode_partial_pages`` (one program per KV head's query group): BLOCK_K rows per ``tl.dot``; its merge
# loads MERGE_UNROLL splits' subtraction partials at a time with MERGE_WARPS warps. Chosen by
# ``bench_offload.py --sweep`` on an H100 (1 x 128K, 2 %: 42 us; 64 x 4 warps with one split at a time: 104)
PAGES_LAUNCH = dict(BLOCK_K=64, num_warps=8, WAVES=2, MIN_ITEMS=128, MERGE_UNROLL=4, MERGE_WARPS=8)


def num_splits(rows: int, items: int, device, launch: dict | None = None) -> int:
    """Splits per row for ``rows`` programs (``B·Hq`` query heads, or ``B·Hkv`` groups) of about ``items``
    anchors + retrieved tokens each; ``launch`` default ``DECODE_LAUNCH`` (read at the call)."""
    launch = DECODE_LAUNCH if launch is None else launch
    want = -(-launch["WAVES"] * num_sms(device) // max(rows, 1))
    return max(1, min(want, items // launch["MIN_ITEMS"], 64))


def _ieee_dot(q: torch.Tensor) -> bool:
    """Whether the kernels' ``tl.dot`` runs in fp32 IEEE: fp32 inputs, or Triton's interpreter (no bf16 dot)."""
    return q.dtype == torch.float32 or interpreting()


def _split_partials(B: int, Hq: int, sub_heads: int, n_split: int, d: int, F: int, dev) -> tuple:
    """Scratch of a split-K tail: ``(pm, pl [B, Hq, S], pacc [B, Hq, S, d], psb [B, sub_heads, S, F],
    psa [B, sub_heads, S, F, d])`` fp32; the subtraction partials per query head or per KV head
    (``sub_heads``), written only for rows that use the completion (the merge reads them only there)."""
    f32 = dict(dtype=torch.float32, device=dev)
    return (_alloc(B, Hq, n_split, **f32), _alloc(B, Hq, n_split, **f32), _alloc(B, Hq, n_split, d, **f32),
            _alloc(B, sub_heads, n_split, F, **f32), _alloc(B, sub_heads, n_split, F, d, **f32))


def _merge(out, n_prefill, lpq, comp_A, comp_b, comp_shift, partials, Hq: int, Hkv: int, d: int, F: int,
           n_sink: int, n_tail: int, top_k: int, page_size: int, n_split: int, **launch) -> torch.Tensor:
    """``decode_merge`` over ``partials`` (``_split_partials``) into ``out``; ``launch``: ``SUB_KV``,
    ``UNROLL``, ``num_warps`` where they differ from its defaults."""
    decode_merge[(out.shape[0], Hq)](n_prefill, lpq, comp_A, comp_b, comp_shift, *partials, out, Hq, Hkv, d, F,
                                      int(n_sink), int(n_tail), int(top_k), n_split, GROUP=Hq // Hkv,
                                      PAGE=int(page_size), D_P=_pow2(d), F_P=_pow2(F), S_P=_pow2(n_split, 2),
                                      **{"num_warps": 4, **launch})
    return out


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
        G_P=_pow2(group), D_P=_pow2(d), BLOCK_T=block_t, IEEE=_ieee_dot(q), num_warps=4)
    return torch.topk(logits, kk, dim=-1, sorted=False).indices


def retrieval_completion_triton(q, k_cache, v_cache, seq_lens, n_prefill, log_phi_q, log_phi_k, comp_A, comp_b,
                                comp_shift, n_sink: int, n_tail: int, top_k: int, scale: float, *,
                                out: torch.Tensor | None = None):
    """Same contract as ``macattn.methods.completion.ops.retrieval_completion``: ``out [B, Hq, d]`` in q's dtype.
    ``out``: optional contiguous destination (TensorRT's output buffer), returned."""
    check_retrieval_completion_inputs(q, k_cache, v_cache, seq_lens, n_prefill, log_phi_q, log_phi_k, comp_A,
                                      comp_b, comp_shift, n_sink, n_tail, top_k, scale)
    scale = resolve_scale(scale, q.shape[2])
    out = destination(out, "out", tuple(q.shape), q.dtype, q.device, _alloc)
    if q.shape[0] == 0:
        return out
    k, v = _same_strides(k_cache, v_cache)
    idx = mid_topk_triton(q.contiguous(), k, n_prefill.contiguous(), n_sink, n_tail, top_k, scale)
    return decode_retrieved_triton(q, k, v, seq_lens, n_prefill, log_phi_q, comp_A, comp_b, comp_shift, idx,
                                   retrieved=(k, v, log_phi_k), n_sink=n_sink, n_tail=n_tail, top_k=top_k,
                                   scale=scale, out=out)


def select_mid_pages(q, page_lo, page_hi, n_prefill, n_sink: int, n_tail: int, page_size: int, budget: int, *,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """The best ``budget`` mid pages per KV head (``macattn.plugins.page_select``'s kernels over the pages
    overlapping the mid): ``q [B, Hq, d]``, ``page_lo / page_hi [B, Hkv, P, d]`` fp32 bounds of absolute
    pages, ``n_prefill [B]`` -> ``[B, Hkv, budget]`` int64 absolute page indices, ascending, ``-1`` past
    the selectable pages. No host sync."""
    check_int("page_size", page_size, 1)
    p0 = n_sink // page_size
    B, Hkv, P = page_lo.shape[0], page_lo.shape[1], page_lo.shape[2]
    pages = out if out is not None else torch.empty(B, Hkv, budget, dtype=torch.int64, device=q.device)
    if p0 >= P:
        return pages.fill_(-1)
    # the mid's page count and the absolute indices in the kernels (page_select's _row_pages): no extra launches
    return select_pages(q, page_lo[:, :, p0:], page_hi[:, :, p0:], n_prefill, budget, out=pages,
                        mid=(n_sink, n_tail, page_size, p0))


def page_positions(pages: torch.Tensor, page_size: int) -> torch.Tensor:
    """Token positions ``[..., n·page_size]`` int64 of ``pages [..., n]`` (``-1`` for a ``-1`` page)."""
    off = torch.arange(page_size, device=pages.device, dtype=torch.int64)
    pos = pages[..., None] * page_size + off
    return torch.where(pages[..., None] >= 0, pos, -1).flatten(-2)


def page_retrieval_completion_triton(q, k_cache, v_cache, seq_lens, n_prefill, log_phi_q, log_phi_k, comp_A, comp_b,
                                     comp_shift, page_lo, page_hi, n_sink: int, n_tail: int, page_size: int,
                                     budget_pages: int, scale: float, *, out: torch.Tensor | None = None):
    """Retrieval-completion with the page selector instead of the exhaustive one (the GPU-resident op of the
    offloaded setting): ``select_mid_pages`` (Quest bounds ``page_lo / page_hi [B, Hkv, P, d]`` fp32,
    ``budget_pages`` per KV head) -> every token of the selected pages (no token refinement) -> the shared
    split-K exact attention + completion (``decode_retrieved_triton``). Other inputs as
    ``retrieval_completion_triton``; reference ``macattn.methods.completion.reference.page_retrieval_completion_step``.
    ``out [B, Hq, d]`` in q's dtype. No host sync (CUDA-graph capturable)."""
    check_retrieval_completion_inputs(q, k_cache, v_cache, seq_lens, n_prefill, log_phi_q, log_phi_k, comp_A,
                                      comp_b, comp_shift, n_sink, n_tail, budget_pages, scale)
    B, Hkv, d = q.shape[0], k_cache.shape[1], q.shape[2]
    if page_lo.dim() != 4 or page_lo.shape[:2] != (B, Hkv) or page_lo.shape[3] != d or page_hi.shape != page_lo.shape:
        raise ValueError(f"page_lo / page_hi must be [B={B}, Hkv={Hkv}, P, d={d}] (same shape), got "
                         f"{tuple(page_lo.shape)} and {tuple(page_hi.shape)}")
    scale = resolve_scale(scale, d)
    out = destination(out, "out", tuple(q.shape), q.dtype, q.device, _alloc)
    if B == 0:
        return out
    k, v = _same_strides(k_cache, v_cache)
    # no more pages than a row can select (a larger budget only adds padding for the tail to skip)
    budget_pages = min(budget_pages, max(0, page_lo.shape[2] - n_sink // page_size))
    pages = select_mid_pages(q.contiguous(), page_lo, page_hi, n_prefill, n_sink, n_tail, page_size, budget_pages)
    return decode_pages_triton(q, k, v, seq_lens, n_prefill, log_phi_q, log_phi_k, comp_A, comp_b, comp_shift, pages,
                               n_sink=n_sink, n_tail=n_tail, page_size=page_size, scale=scale, out=out)


def decode_pages_triton(q, k, v, seq_lens, n_prefill, log_phi_q, log_phi_k, comp_A, comp_b, comp_shift,
                        pages, *, n_sink: int, n_tail: int, page_size: int, scale: float,
                        out: torch.Tensor) -> torch.Tensor:
    """The GPU-resident page step's tail (``decode_partial_pages`` + ``decode_merge``): exact attention over
    the anchors and every token of ``pages [B, Hkv, NP]`` (int64 absolute page indices, ``-1`` padding;
    tokens outside the row's mid skipped), the completion of the rest, one normalisation. ``k / v
    [B, Hkv, T, d]`` one dtype and strides, ``log_phi_k [B, Hkv, T, F]`` fp32; the others as
    ``decode_retrieved_triton``; reference ``decode_retrieved_step`` over ``page_positions(pages)``."""
    B, Hq, d = q.shape
    Hkv = k.shape[1]
    F = log_phi_q.shape[2]
    group = Hq // Hkv
    dev = q.device
    lpk = _unit_last_stride(log_phi_k)
    q, lpq, comp_A, comp_b, comp_shift = (t.contiguous() for t in (q, log_phi_q, comp_A, comp_b, comp_shift))
    seq_lens, n_prefill, pages = seq_lens.contiguous(), n_prefill.contiguous(), pages.contiguous()
    NP = pages.shape[2]
    n_split = num_splits(B * Hkv, NP * page_size + n_sink + n_tail, dev, PAGES_LAUNCH)
    parts = _split_partials(B, Hq, Hkv, n_split, d, F, dev)           # subtraction partials per KV head
    decode_partial_pages[(B, Hkv, n_split)](
        q, k, v, seq_lens, n_prefill, lpk, comp_shift, pages, *parts, *k.stride()[:3],
        *lpk.stride()[:3], *pages.stride()[:2], Hq, Hkv, d, F, NP, int(n_sink), int(n_tail), scale, GROUP=group,
        G_P=_pow2(group), PAGE=int(page_size), PRECISION="ieee" if _ieee_dot(q) else "tf32", D_P=_pow2(d),
        F_P=_pow2(F), BLOCK_K=PAGES_LAUNCH["BLOCK_K"], num_warps=PAGES_LAUNCH["num_warps"])
    return _merge(out, n_prefill, lpq, comp_A, comp_b, comp_shift, parts, Hq, Hkv, d, F, n_sink, n_tail, NP,
                  page_size, n_split, SUB_KV=True, UNROLL=PAGES_LAUNCH["MERGE_UNROLL"],
                  num_warps=PAGES_LAUNCH["MERGE_WARPS"])


def _same_strides(k_cache, v_cache):
    k = _unit_last_stride(k_cache)
    v = _unit_last_stride(v_cache)
    if v.stride() != k.stride():
        k, v = k.contiguous(), v.contiguous()
    return k, v


def decode_retrieved_triton(q, k, v, seq_lens, n_prefill, log_phi_q, comp_A, comp_b, comp_shift, idx, *,
                            retrieved, n_sink: int, n_tail: int, top_k: int, scale: float, page_size: int = 0,
                            rows: torch.Tensor | None = None, anchors_compact: bool = False,
                            out: torch.Tensor) -> torch.Tensor:
    """The tail every selector shares: split-K exact attention over the anchors and the retrieved tokens,
    the clamped subtraction of the retrieved tokens from the completion cache and one normalisation
    (``_decode_partial`` + ``decode_merge``). Shapes (``B`` rows, ``Hq`` / ``Hkv`` heads, ``d``, ``F``):

    * ``q [B, Hq, d]``; ``k / v [B, Hkv, T, d]`` the anchors: at their positions (``T`` >= every row's
      ``seq_lens``) or, with ``anchors_compact``, in item order (sinks ``[0, s0)`` then ``[m1, L)`` at rows
      ``s0 ..``; ``T >= s0 + L - m1``);
    * ``idx [B, Hq or Hkv, K]`` int64 retrieved positions per query head (Top-k) or per KV head (pages);
      positions outside the row's mid are skipped (padding);
    * ``retrieved = (kr, vr, log_phi_k)``: ``[B, Hkv, R, d]`` x2 (kr, vr: one dtype and strides) and
      ``[B, Hkv, R, F]`` fp32, read at the retrieved positions, or at ``rows`` (same shape as ``idx``,
      int64) when given (the offloaded decode's hot-page cache);
    * ``top_k``: tokens per query head (``page_size = 0``) or pages per KV head (``page_size`` tokens);
      decides whether the completion term applies (``_use_completion``);
    * ``log_phi_q [B, Hq, F]``, ``comp_A [B, Hkv, F, d]``, ``comp_b / comp_shift [B, Hkv, F]`` fp32;
      ``out [B, Hq, d]`` (written and returned)."""
    B, Hq, d = q.shape
    Hkv = k.shape[1]
    F = log_phi_q.shape[2]
    group = Hq // Hkv
    dev = q.device
    kr, vr, lpk = retrieved
    kr, vr = _same_strides(kr, vr)
    lpk = _unit_last_stride(lpk)
    if idx.dim() != 3 or idx.shape[0] != B or idx.shape[1] not in (Hq, Hkv):
        raise ValueError(f"idx must be [B={B}, Hq={Hq} or Hkv={Hkv}, K], got {tuple(idx.shape)}")
    idx = idx.contiguous()
    if rows is not None and rows.shape != idx.shape:
        raise ValueError(f"rows must have idx's shape {tuple(idx.shape)}, got {tuple(rows.shape)}")
    rows = idx if rows is None else rows.contiguous()
    q, lpq, comp_A, comp_b, comp_shift = (t.contiguous() for t in (q, log_phi_q, comp_A, comp_b, comp_shift))
    seq_lens, n_prefill = seq_lens.contiguous(), n_prefill.contiguous()
    K = idx.shape[2]
    idx_group = group if idx.shape[1] == Hkv else 1
    n_split = num_splits(B * Hq, K + n_sink + n_tail, dev)
    parts = _split_partials(B, Hq, Hq, n_split, d, F, dev)            # subtraction partials per query head
    launch = {name: val for name, val in DECODE_LAUNCH.items() if name in ("BLOCK_K", "num_warps")}
    _decode_partial[(B, Hq, n_split)](q, k, v, seq_lens, n_prefill, kr, vr, lpk, comp_shift, idx, rows, *parts,
                                      *k.stride()[:3], *kr.stride()[:3], *lpk.stride()[:3],
                                      *idx.stride()[:2], Hq, Hkv, d, F, K, int(n_sink), int(n_tail), int(top_k), scale,
                                      GROUP=group, IDX_GROUP=idx_group, PAGE=int(page_size),
                                      RET_ROWS=rows is not idx, ANCHOR_COMPACT=bool(anchors_compact), D_P=_pow2(d),
                                      F_P=_pow2(F), **launch)
    return _merge(out, n_prefill, lpq, comp_A, comp_b, comp_shift, parts, Hq, Hkv, d, F, n_sink, n_tail, top_k,
                  page_size, n_split)
