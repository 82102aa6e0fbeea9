"""Retrieval-completion (SPEC §3) as two ``torch.library`` ops.

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

from macattn.methods.completion.reference import build_completion_cache_batched, retrieval_completion_step
from macattn.plugins import HAVE_TRITON
from macattn.plugins.retrieval_completion.checks import (REFERENCE_FLOATS, check_completion_cache_inputs,
                                                        check_retrieval_completion_inputs, resolve_scale)

__all__ = ["retrieval_completion", "completion_cache", "register_cuda_kernels"]


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


def register_cuda_kernels() -> tuple[str, ...]:
    """Register the Triton launchers as the CUDA kernels of ``completion_cache`` / ``retrieval_completion``
    (idempotent; through ``macattn.methods.kernels.register_kernels``). Returns the op names; ``()``
    without triton."""
    if not HAVE_TRITON:
        return ()
    from macattn.methods.kernels import register_cuda_launchers
    from macattn.plugins.retrieval_completion.op import completion_cache_triton, retrieval_completion_triton

    return register_cuda_launchers({"macattn::completion_cache": lambda: completion_cache_triton,
                                    "macattn::retrieval_completion": lambda: retrieval_completion_triton})
