"""TensorRT plugins ``mac::retrieval_completion`` and ``mac::completion_cache`` (version "1"):
shape/dtype inference and guarded registration.

The ONNX nodes ``macattn::RetrievalCompletion`` / ``macattn::CompletionCache``
(``builder/onnx_ops_completion.py``) become these plugins with the same inputs in the same
order and the same attributes (``n_sink``, ``n_tail``, ``top_k`` int; ``scale`` float, ``<= 0``
for ``1/sqrt(d)``). Inference is a plain function over dims (``int`` or TensorRT's
``ShapeExpr``) and torch dtypes, tested without TensorRT; ``register_tensorrt`` hands it to
``tensorrt.plugin`` with JIT impls that run the ops' Triton launchers on TensorRT's stream, into
TensorRT's output buffers.
No AOT image yet: ``torch.topk`` sits between the two kernels of a decode step.

No ``from __future__ import annotations`` here: ``tensorrt.plugin`` reads the registered
functions' annotations as classes.
"""
import numbers
from typing import Any, Sequence, Tuple

import torch

from ..aot import FLOATS, check_dims_fit, check_dtypes, check_input_ranks, check_int_attrs
from ..trt_compat import python_id

__all__ = ["STEP_ID", "CACHE_ID", "STEP_INPUTS", "CACHE_INPUTS", "CACHE_OUTPUTS", "retrieval_completion_output_specs",
           "completion_cache_output_specs", "register_tensorrt"]

STEP_ID = python_id("retrieval_completion")
CACHE_ID = python_id("completion_cache")
STEP_INPUTS = ("q", "k_cache", "v_cache", "seq_lens", "n_prefill", "log_phi_q", "log_phi_k", "comp_A", "comp_b",
               "comp_shift")
CACHE_INPUTS = ("log_phi_k", "v_cache", "n_prefill")
CACHE_OUTPUTS = ("comp_A", "comp_b", "comp_shift")
_INTS = (torch.int32, torch.int64)


def _check(op: str, names, shapes, dtypes, ranks, fits, allowed) -> None:
    check_input_ranks(op, names, ranks, shapes, dtypes)
    check_dims_fit(fits)
    check_dtypes(names, dtypes, allowed)


def retrieval_completion_output_specs(shapes: Sequence[Sequence[Any]], dtypes: Sequence[torch.dtype], *,
                                      n_sink: int, n_tail: int, top_k: int, scale: float) -> list:
    """``[((B, Hq, d), q.dtype)]`` from the 10 inputs' shapes and dtypes; ``ValueError``/``TypeError``
    naming the input that does not fit (``Hq % Hkv`` is checked when both are known)."""
    check_int_attrs(n_sink=n_sink, n_tail=n_tail, top_k=top_k)
    if not isinstance(scale, numbers.Real):
        raise ValueError(f"scale must be a float, got {scale!r}")
    if len(shapes) != len(STEP_INPUTS):
        raise ValueError(f"{STEP_ID} takes {len(STEP_INPUTS)} inputs {STEP_INPUTS}, got {len(shapes)}")
    if len(shapes[0]) != 3 or len(shapes[1]) != 4 or len(shapes[5]) != 3:
        raise ValueError("q must be [B, Hq, d], k_cache [B, Hkv, T, d], log_phi_q [B, Hq, F]")
    B, Hq, d = shapes[0]
    Hkv, T = shapes[1][1], shapes[1][2]
    F = shapes[5][2]
    if isinstance(Hq, int) and isinstance(Hkv, int) and (Hkv < 1 or Hq % Hkv):
        raise ValueError(f"Hq={Hq} must be a positive multiple of Hkv={Hkv}")
    wants = (("k_cache", shapes[1], (B, Hkv, T, d)), ("v_cache", shapes[2], (B, Hkv, T, d)),
             ("seq_lens", shapes[3], (B,)), ("n_prefill", shapes[4], (B,)), ("log_phi_q", shapes[5], (B, Hq, F)),
             ("log_phi_k", shapes[6], (B, Hkv, T, F)), ("comp_A", shapes[7], (B, Hkv, F, d)),
             ("comp_b", shapes[8], (B, Hkv, F)), ("comp_shift", shapes[9], (B, Hkv, F)))
    rules = {n: (torch.float32,) for n in STEP_INPUTS}
    rules.update(q=FLOATS, k_cache=FLOATS, v_cache=FLOATS, seq_lens=_INTS, n_prefill=_INTS)
    _check(STEP_ID, STEP_INPUTS, shapes, dtypes, (3, 4, 4, 1, 1, 3, 4, 4, 3, 3), wants, rules)
    if dtypes[1] != dtypes[2]:
        raise TypeError(f"k_cache and v_cache must have one dtype, got {dtypes[1]} and {dtypes[2]}")
    return [((B, Hq, d), dtypes[0])]


def completion_cache_output_specs(shapes: Sequence[Sequence[Any]], dtypes: Sequence[torch.dtype], *,
                                  n_sink: int, n_tail: int) -> list:
    """``[((B, Hkv, F, d), fp32), ((B, Hkv, F), fp32) x 2]`` from the 3 inputs' shapes and dtypes."""
    check_int_attrs(n_sink=n_sink, n_tail=n_tail)
    if len(shapes) != len(CACHE_INPUTS) or len(shapes[0]) != 4 or len(shapes[1]) != 4:
        raise ValueError(f"{CACHE_ID} takes {CACHE_INPUTS}: log_phi_k [B, Hkv, T, F], v_cache [B, Hkv, T, d], "
                         f"n_prefill [B]")
    B, H, T, F = shapes[0]
    d = shapes[1][3]
    _check(CACHE_ID, CACHE_INPUTS, shapes, dtypes, (4, 4, 1),
           (("v_cache", shapes[1], (B, H, T, d)), ("n_prefill", shapes[2], (B,))),
           {"log_phi_k": (torch.float32,), "v_cache": FLOATS, "n_prefill": _INTS})
    return [((B, H, F, d), torch.float32), ((B, H, F), torch.float32), ((B, H, F), torch.float32)]


def register_tensorrt(binding) -> None:
    """Register both plugins with ``tensorrt.plugin`` through ``binding`` (``tensorrt_plugins.PluginBinding``):
    descriptors and JIT impls (the Triton launchers writing TensorRT's outputs)."""
    from .op import completion_cache_triton, retrieval_completion_triton

    trtp = binding.trtp
    TensorDesc, Tensor = trtp.TensorDesc, trtp.Tensor

    @binding.register(STEP_ID)
    def _step_desc(q: TensorDesc, k_cache: TensorDesc, v_cache: TensorDesc, seq_lens: TensorDesc,
                   n_prefill: TensorDesc, log_phi_q: TensorDesc, log_phi_k: TensorDesc, comp_A: TensorDesc,
                   comp_b: TensorDesc, comp_shift: TensorDesc, n_sink: int, n_tail: int, top_k: int,
                   scale: float) -> TensorDesc:
        (out,) = binding.output_descs((q, k_cache, v_cache, seq_lens, n_prefill, log_phi_q, log_phi_k, comp_A, comp_b,
                                       comp_shift), retrieval_completion_output_specs, n_sink=n_sink, n_tail=n_tail,
                                      top_k=top_k, scale=scale)
        return out

    @trtp.impl(STEP_ID)
    def _step_impl(q: Tensor, k_cache: Tensor, v_cache: Tensor, seq_lens: Tensor, n_prefill: Tensor,
                   log_phi_q: Tensor, log_phi_k: Tensor, comp_A: Tensor, comp_b: Tensor, comp_shift: Tensor,
                   n_sink: int, n_tail: int, top_k: int, scale: float, outputs: Tuple[Tensor], stream: int) -> None:
        binding.launch(stream, retrieval_completion_triton, (q, k_cache, v_cache, seq_lens, n_prefill, log_phi_q,
                                                             log_phi_k, comp_A, comp_b, comp_shift),
                       (n_sink, n_tail, top_k, scale), outputs)

    @binding.register(CACHE_ID)
    def _cache_desc(log_phi_k: TensorDesc, v_cache: TensorDesc, n_prefill: TensorDesc, n_sink: int,
                    n_tail: int) -> Tuple[TensorDesc, TensorDesc, TensorDesc]:
        return binding.output_descs((log_phi_k, v_cache, n_prefill), completion_cache_output_specs, n_sink=n_sink,
                                    n_tail=n_tail)

    @trtp.impl(CACHE_ID)
    def _cache_impl(log_phi_k: Tensor, v_cache: Tensor, n_prefill: Tensor, n_sink: int, n_tail: int,
                    outputs: Tuple[Tensor], stream: int) -> None:
        binding.launch(stream, completion_cache_triton, (log_phi_k, v_cache, n_prefill), (n_sink, n_tail), outputs)
