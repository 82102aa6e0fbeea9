"""TensorRT plugins ``mac::retrieval_completion`` and ``mac::completion_cache`` (version "1"):
shape/dtype inference and guarded registration.

The ONNX nodes ``macattn::RetrievalCompletion`` / ``macattn::CompletionCache``
(``builder/onnx_ops_completion.py``) become these plugins with the same inputs in the same
order and the same attributes (``n_sink``, ``n_tail``, ``top_k`` int; ``scale`` float, ``<= 0``
for ``1/sqrt(d)``). Inference is a plain function over dims (``int`` or TensorRT's
``ShapeExpr``) and torch dtypes, tested without TensorRT; ``register_tensorrt`` hands it to
``tensorrt.plugin`` with a JIT impl that runs the torch ops (the Triton kernels) on the stream.
No AOT image yet: ``torch.topk`` sits between the two kernels of a decode step.

No ``from __future__ import annotations`` here: ``tensorrt.plugin`` reads the registered
functions' annotations as classes.
"""
import numbers
from typing import Any, Sequence, Tuple

import torch

from ..aot import check_input_ranks, same_dim

__all__ = ["STEP_ID", "CACHE_ID", "STEP_INPUTS", "CACHE_INPUTS", "CACHE_OUTPUTS", "retrieval_completion_output_specs",
           "completion_cache_output_specs", "register_tensorrt"]

STEP_ID = "mac::retrieval_completion"
CACHE_ID = "mac::completion_cache"
STEP_INPUTS = ("q", "k_cache", "v_cache", "seq_lens", "n_prefill", "log_phi_q", "log_phi_k", "comp_A", "comp_b",
               "comp_shift")
CACHE_INPUTS = ("log_phi_k", "v_cache", "n_prefill")
CACHE_OUTPUTS = ("comp_A", "comp_b", "comp_shift")
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_INTS = (torch.int32, torch.int64)


def _check_attrs(**ints) -> None:
    for name, val in ints.items():
        if isinstance(val, bool) or not isinstance(val, numbers.Integral) or val < 0:
            raise ValueError(f"{name} must be an int >= 0, got {val!r}")


def _check(names, shapes, dtypes, ranks, wants, dtype_rules, op: str) -> None:
    check_input_ranks(op, names, ranks, shapes, dtypes)
    for name, got, want in wants:
        if not all(same_dim(a, b) for a, b in zip(got, want)):
            raise ValueError(f"{name} shape {tuple(got)} does not fit {tuple(want)}")
    for name, dt in zip(names, dtypes):
        allowed = dtype_rules[name]
        if dt not in allowed:
            raise TypeError(f"{name} must be one of {allowed}, got {dt}")


def retrieval_completion_output_specs(shapes: Sequence[Sequence[Any]], dtypes: Sequence[torch.dtype], *,
                                      n_sink: int, n_tail: int, top_k: int, scale: float) -> list:
    """``[((B, Hq, d), q.dtype)]`` from the 10 inputs' shapes and dtypes; ``ValueError``/``TypeError``
    naming the input that does not fit (``Hq % Hkv`` is checked when both are known)."""
    _check_attrs(n_sink=n_sink, n_tail=n_tail, top_k=top_k)
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
    rules.update(q=_FLOATS, k_cache=_FLOATS, v_cache=_FLOATS, seq_lens=_INTS, n_prefill=_INTS)
    _check(STEP_INPUTS, shapes, dtypes, (3, 4, 4, 1, 1, 3, 4, 4, 3, 3), wants, rules, STEP_ID)
    if dtypes[1] != dtypes[2]:
        raise TypeError(f"k_cache and v_cache must have one dtype, got {dtypes[1]} and {dtypes[2]}")
    return [((B, Hq, d), dtypes[0])]


def completion_cache_output_specs(shapes: Sequence[Sequence[Any]], dtypes: Sequence[torch.dtype], *,
                                  n_sink: int, n_tail: int) -> list:
    """``[((B, Hkv, F, d), fp32), ((B, Hkv, F), fp32) x 2]`` from the 3 inputs' shapes and dtypes."""
    _check_attrs(n_sink=n_sink, n_tail=n_tail)
    if len(shapes) != len(CACHE_INPUTS) or len(shapes[0]) != 4 or len(shapes[1]) != 4:
        raise ValueError(f"{CACHE_ID} takes {CACHE_INPUTS}: log_phi_k [B, Hkv, T, F], v_cache [B, Hkv, T, d], "
                         f"n_prefill [B]")
    B, H, T, F = shapes[0]
    d = shapes[1][3]
    _check(CACHE_INPUTS, shapes, dtypes, (4, 4, 1), (("v_cache", shapes[1], (B, H, T, d)),
                                                     ("n_prefill", shapes[2], (B,))),
           {"log_phi_k": (torch.float32,), "v_cache": _FLOATS, "n_prefill": _INTS}, CACHE_ID)
    return [((B, H, F, d), torch.float32), ((B, H, F), torch.float32), ((B, H, F), torch.float32)]


def register_tensorrt(trtp, to_torch_dtype, to_trt_dtype) -> None:
    """Register both plugins with ``tensorrt.plugin`` (``trtp``): descriptors and JIT impls."""
    from .op import completion_cache_triton, retrieval_completion_triton

    TensorDesc = trtp.TensorDesc

    def _on_stream(stream, fn, outputs):
        with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
            results = fn()
            for dst, r in zip(outputs, results):
                torch.as_tensor(dst, device="cuda").copy_(r)

    @trtp.register(STEP_ID)
    def _step_desc(q: TensorDesc, k_cache: TensorDesc, v_cache: TensorDesc, seq_lens: TensorDesc,
                   n_prefill: TensorDesc, log_phi_q: TensorDesc, log_phi_k: TensorDesc, comp_A: TensorDesc,
                   comp_b: TensorDesc, comp_shift: TensorDesc, n_sink: int, n_tail: int, top_k: int,
                   scale: float) -> TensorDesc:
        ins = (q, k_cache, v_cache, seq_lens, n_prefill, log_phi_q, log_phi_k, comp_A, comp_b, comp_shift)
        (shape, dt), = retrieval_completion_output_specs([t.shape_expr for t in ins],
                                                         [to_torch_dtype(t.dtype) for t in ins], n_sink=n_sink,
                                                         n_tail=n_tail, top_k=top_k, scale=scale)
        return trtp.from_shape_expr(tuple(shape), dtype=to_trt_dtype(dt))

    @trtp.impl(STEP_ID)
    def _step_impl(q: trtp.Tensor, k_cache: trtp.Tensor, v_cache: trtp.Tensor, seq_lens: trtp.Tensor,
                   n_prefill: trtp.Tensor, log_phi_q: trtp.Tensor, log_phi_k: trtp.Tensor, comp_A: trtp.Tensor,
                   comp_b: trtp.Tensor, comp_shift: trtp.Tensor, n_sink: int, n_tail: int, top_k: int, scale: float,
                   outputs: Tuple[trtp.Tensor], stream: int) -> None:
        t = [torch.as_tensor(a, device="cuda") for a in (q, k_cache, v_cache, seq_lens, n_prefill, log_phi_q,
                                                         log_phi_k, comp_A, comp_b, comp_shift)]
        _on_stream(stream, lambda: (retrieval_completion_triton(*t, n_sink, n_tail, top_k, scale),), outputs)

    @trtp.register(CACHE_ID)
    def _cache_desc(log_phi_k: TensorDesc, v_cache: TensorDesc, n_prefill: TensorDesc, n_sink: int,
                    n_tail: int) -> Tuple[TensorDesc, TensorDesc, TensorDesc]:
        ins = (log_phi_k, v_cache, n_prefill)
        specs = completion_cache_output_specs([t.shape_expr for t in ins], [to_torch_dtype(t.dtype) for t in ins],
                                              n_sink=n_sink, n_tail=n_tail)
        return tuple(trtp.from_shape_expr(tuple(shape), dtype=to_trt_dtype(dt)) for shape, dt in specs)

    @trtp.impl(CACHE_ID)
    def _cache_impl(log_phi_k: trtp.Tensor, v_cache: trtp.Tensor, n_prefill: trtp.Tensor, n_sink: int, n_tail: int,
                    outputs: Tuple[trtp.Tensor], stream: int) -> None:
        t = [torch.as_tensor(a, device="cuda") for a in (log_phi_k, v_cache, n_prefill)]
        _on_stream(stream, lambda: completion_cache_triton(*t, n_sink, n_tail), outputs)
