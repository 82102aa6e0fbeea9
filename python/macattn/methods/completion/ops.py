"""Retrieval-completion (docs/spec.md §3) as two ``torch.library`` ops.

* ``macattn::completion_cache(log_phi_k, v_cache, n_prefill, n_sink, n_tail) -> (comp_A, comp_b,
  comp_shift)``: the stable completion cache of every row's mid region, built once at prefill.
* ``macattn::retrieval_completion(q, k_cache, v_cache, seq_lens, n_prefill, log_phi_q, log_phi_k,
  comp_A, comp_b, comp_shift, n_sink, n_tail, top_k, scale) -> out``: one decode step (exhaustive
  Top-k per query head, exact attention over sink + tail + retrieved + generated, clamped
  subtraction of the retrieved tokens from the cache, one log-domain normalisation).

Shapes and semantics are those of ``macattn.methods.completion.reference.build_completion_cache_batched`` and
``macattn.methods.completion.reference.retrieval_completion_step`` (the fp64 references, which are the
implementation on every device without a faster one); ``register_cuda_kernels`` registers
the Triton kernels for CUDA. ``scale <= 0`` means ``1/sqrt(d)``. The checks here look at shapes,
dtypes and attributes only, never at tensor values (no host sync: the CUDA path stays
CUDA-graph capturable); the CPU reference additionally range-checks ``seq_lens`` / ``n_prefill``
and also takes float64 activations (the kernels and the graph nodes take fp32/fp16/bf16).
"""
from __future__ import annotations

import torch

from macattn.core.validation import check_int
from macattn.methods.completion.reference import (build_completion_cache_batched, page_retrieval_completion_step,
                                                  retrieval_completion_step, select_mid_pages_reference)
from macattn.plugins import HAVE_TRITON
from macattn.plugins.cuda_kernels import register_cuda_launchers
from macattn.plugins.retrieval_completion.checks import (REFERENCE_FLOATS, check_completion_cache_inputs,
                                                        check_retrieval_completion_inputs, resolve_scale)

__all__ = ["retrieval_completion", "page_retrieval_completion", "completion_cache", "register_cuda_kernels"]


@torch.library.custom_op("macattn::completion_cache", mutates_args=())
def completion_cache(log_phi_k: torch.Tensor, v_cache: torch.Tensor, n_prefill: torch.Tensor, n_sink: int,
                     n_tail: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 ``(comp_A [B, Hkv, F, d], comp_b [B, Hkv, F], comp_shift [B, Hkv, F])`` of the mid
    region ``[min(n_sink, N), max(min(n_sink, N), N - n_tail))`` of each row (``N = n_prefill[b]``).

    log_phi_k ``[B, Hkv, T, F]`` fp32, v_cache ``[B, Hkv, T, d]`` (fp32/fp16/bf16), n_prefill
    ``[B]`` int (``<= T``). Rows with an empty mid get zeros.
    """
    check_completion_cache_inputs(log_phi_k, v_cache, n_prefill, n_sink, n_tail, REFERENCE_FLOATS)
    T = v_cache.shape[2]
    if n_prefill.numel() and not bool(((n_prefill >= 0) & (n_prefill <= T)).all()):
        raise ValueError(f"n_prefill must be in [0, T={T}], got {n_prefill.tolist()}")
    return build_completion_cache_batched(log_phi_k, v_cache, n_prefill, n_sink=n_sink, n_tail=n_tail)


@completion_cache.register_fake
def _(log_phi_k, v_cache, n_prefill, n_sink, n_tail):
    B, H, _, F = log_phi_k.shape
    d = v_cache.shape[3]
    f32 = dict(dtype=torch.float32)
    return v_cache.new_empty((B, H, F, d), **f32), v_cache.new_empty((B, H, F), **f32), \
        v_cache.new_empty((B, H, F), **f32)


@torch.library.custom_op("macattn::retrieval_completion", mutates_args=())
def retrieval_completion(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_lens: torch.Tensor,
                         n_prefill: torch.Tensor, log_phi_q: torch.Tensor, log_phi_k: torch.Tensor,
                         comp_A: torch.Tensor, comp_b: torch.Tensor, comp_shift: torch.Tensor, n_sink: int,
                         n_tail: int, top_k: int, scale: float) -> torch.Tensor:
    """``out [B, Hq, d]`` in q's dtype; inputs as ``macattn.methods.completion.reference.retrieval_completion_step``
    (q post-RoPE ``[B, Hq, d]``, caches ``[B, Hkv, T, d]``, ``seq_lens`` / ``n_prefill`` ``[B]`` int,
    ``log_phi_q [B, Hq, F]``, ``log_phi_k [B, Hkv, T, F]``, cache ``[B, Hkv, F, d]`` / ``[B, Hkv, F]``
    x2, all fp32)."""
    check_retrieval_completion_inputs(q, k_cache, v_cache, seq_lens, n_prefill, log_phi_q, log_phi_k, comp_A, comp_b,
                                      comp_shift, n_sink, n_tail, top_k, scale, REFERENCE_FLOATS)
    return retrieval_completion_step(q, k_cache, v_cache, seq_lens, n_prefill, log_phi_q, log_phi_k, comp_A, comp_b,
                                     comp_shift, n_sink=n_sink, n_tail=n_tail, top_k=top_k,
                                     scale=resolve_scale(scale, q.shape[2]))


@retrieval_completion.register_fake
def _(q, k_cache, v_cache, seq_lens, n_prefill, log_phi_q, log_phi_k, comp_A, comp_b, comp_shift, n_sink, n_tail,
      top_k, scale):
    return torch.empty_like(q)


@torch.library.custom_op("macattn::page_retrieval_completion", mutates_args=())
def page_retrieval_completion(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_lens: torch.Tensor,
                              n_prefill: torch.Tensor, log_phi_q: torch.Tensor, log_phi_k: torch.Tensor,
                              comp_A: torch.Tensor, comp_b: torch.Tensor, comp_shift: torch.Tensor,
                              page_lo: torch.Tensor, page_hi: torch.Tensor, n_sink: int, n_tail: int, page_size: int,
                              budget_pages: int, scale: float) -> torch.Tensor:
    """``retrieval_completion`` with the page selector: ``budget_pages`` pages of ``page_size`` tokens per KV
    head chosen by their Quest bounds ``page_lo / page_hi [B, Hkv, P, d]`` (fp32, absolute pages of the
    cache's keys) among the pages overlapping the mid, every mid token of a chosen page retrieved.
    Reference: ``select_mid_pages_reference`` + ``page_retrieval_completion_step``; CUDA:
    ``macattn.plugins.retrieval_completion.op.page_retrieval_completion_triton``."""
    check_retrieval_completion_inputs(q, k_cache, v_cache, seq_lens, n_prefill, log_phi_q, log_phi_k, comp_A, comp_b,
                                      comp_shift, n_sink, n_tail, budget_pages, scale, REFERENCE_FLOATS)
    check_int("page_size", page_size, 1)
    B, Hkv, d = q.shape[0], k_cache.shape[1], q.shape[2]
    if page_lo.dim() != 4 or page_lo.shape[:2] != (B, Hkv) or page_lo.shape[3] != d or page_hi.shape != page_lo.shape:
        raise ValueError(f"page_lo / page_hi must be [B={B}, Hkv={Hkv}, P, d={d}] (same shape), got "
                         f"{tuple(page_lo.shape)} and {tuple(page_hi.shape)}")
    pages = select_mid_pages_reference(q, page_lo, page_hi, n_prefill, n_sink=n_sink, n_tail=n_tail,
                                       page_size=page_size, budget=budget_pages)
    return page_retrieval_completion_step(q, k_cache, v_cache, seq_lens, n_prefill, log_phi_q, log_phi_k, comp_A,
                                          comp_b, comp_shift, n_sink=n_sink, n_tail=n_tail, page_size=page_size,
                                          budget_pages=budget_pages, scale=resolve_scale(scale, d), pages=pages)


@page_retrieval_completion.register_fake
def _(q, k_cache, v_cache, seq_lens, n_prefill, log_phi_q, log_phi_k, comp_A, comp_b, comp_shift, page_lo, page_hi,
      n_sink, n_tail, page_size, budget_pages, scale):
    return torch.empty_like(q)


def register_cuda_kernels() -> tuple[str, ...]:
    """Register the Triton launchers as the CUDA kernels of ``completion_cache`` / ``retrieval_completion``
    (idempotent; through ``macattn.methods.kernels.register_kernels``). Returns the op names; ``()``
    without triton."""
    if not HAVE_TRITON:
        return ()
    from macattn.plugins.retrieval_completion.op import (completion_cache_triton, page_retrieval_completion_triton,
                                                        retrieval_completion_triton)

    return register_cuda_launchers({"macattn::completion_cache": lambda: completion_cache_triton,
                                    "macattn::retrieval_completion": lambda: retrieval_completion_triton,
                                    "macattn::page_retrieval_completion": lambda: page_retrieval_completion_triton})
