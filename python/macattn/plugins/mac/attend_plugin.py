"""TensorRT plugin ``mac::attend`` (version "1"): shape/dtype inference, AOT image, registration.

The ONNX node ``macattn::MacAttend`` (``docs/graph.md``) becomes this plugin in
``*.trt.onnx``: eleven inputs, attributes ``band`` (int) and ``scale`` (float), five
outputs of which the last four alias the ring inputs (``TensorDesc.aliased()``: TensorRT
binds one buffer to each pair, so the op appends in place as the torch op does).
Inference and the AOT image are plain functions over dims (``int`` or TensorRT's
``ShapeExpr``) and torch dtypes, tested without TensorRT.

No ``from __future__ import annotations`` here: ``tensorrt.plugin`` reads the registered
functions' annotations as classes.
"""
import math
import numbers
from typing import Any, NamedTuple, Optional, Sequence, Tuple

import torch

from ..aot import (FLOATS, AotImage, KernelSpec, check_dims_fit, check_dtypes, check_input_ranks, check_int_attrs,
                   compile_image, pow2_head_dim, static_dim, triton_ptr_type)
from ..trt_compat import python_id

__all__ = ["PLUGIN_ID", "INPUTS", "OUTPUTS", "OutputSpec", "attend_output_specs", "attend_kernel_spec", "attend_aot_image",
           "register_tensorrt"]

PLUGIN_ID = python_id("attend")
INPUTS = ("q", "q_pre", "k", "v", "positions", "match_pos", "slots", "qring", "oring", "ring_lse", "ring_pos")
OUTPUTS = ("out", "qring_out", "oring_out", "ring_lse_out", "ring_pos_out")
_RANKS = (3, 3, 4, 4, 1, 2, 1, 4, 4, 3, 2)
_DTYPES = {**dict.fromkeys(("q", "q_pre", "k", "v", "qring"), FLOATS),
           **dict.fromkeys(("positions", "match_pos", "slots", "ring_pos"), (torch.int64,)),
           "oring": (torch.float32,), "ring_lse": (torch.float32,)}


class OutputSpec(NamedTuple):
    shape: Tuple[Any, ...]
    dtype: torch.dtype
    alias_of: Optional[int]      # index into INPUTS of the input this output shares its buffer with


def _check_attrs(band: int, scale: float) -> None:
    check_int_attrs(band=band)
    if not (isinstance(scale, numbers.Real) and math.isfinite(scale) and scale > 0.0):
        raise ValueError(f"scale must be a finite float > 0, got {scale!r}")


def attend_output_specs(shapes: Sequence[Sequence[Any]], dtypes: Sequence[torch.dtype], *, band: int,
                        scale: float) -> list[OutputSpec]:
    """Outputs of ``mac::attend``: ``out [B, Hq, d]`` in q's dtype, then the four rings,
    each aliasing its input. Raises ``ValueError``/``TypeError`` naming the input that does
    not fit ``docs/graph.md``."""
    _check_attrs(band, scale)
    check_input_ranks("mac::attend", INPUTS, _RANKS, shapes, dtypes)
    q, q_pre, k, v, positions, match_pos, slots, qring, oring, ring_lse, ring_pos = shapes
    B, Hq, d = q
    Hkv, T = k[1], k[2]
    S, K = qring[0], qring[2]
    check_dims_fit((("q_pre", q_pre, (B, Hq, d)), ("k", k, (B, Hkv, T, d)), ("v", v, (B, Hkv, T, d)),
                    ("positions", positions, (B,)), ("match_pos", match_pos, (B, Hq)), ("slots", slots, (B,)),
                    ("qring", qring, (S, Hq, K, d)), ("oring", oring, (S, Hq, K, d)),
                    ("ring_lse", ring_lse, (S, Hq, K)), ("ring_pos", ring_pos, (S, K))),
                   " (q [B, Hq, d], k [B, Hkv, T, d], qring [S, Hq, K, d])")
    try:
        hq, hkv = static_dim(Hq, "Hq"), static_dim(Hkv, "Hkv")
    except ValueError:
        hq = hkv = None
    if hq is not None and (hkv < 1 or hq % hkv):
        raise ValueError(f"query heads Hq={hq} must be a multiple of KV heads Hkv={hkv}")
    check_dtypes(INPUTS, dtypes, _DTYPES)
    if not (dtypes[0] == dtypes[2] == dtypes[3]):
        raise TypeError(f"q, k and v must share a dtype, got {dtypes[0]}, {dtypes[2]}, {dtypes[3]}")
    out = [OutputSpec((B, Hq, d), dtypes[0], None)]
    for name in ("qring", "oring", "ring_lse", "ring_pos"):
        i = INPUTS.index(name)
        out.append(OutputSpec(tuple(shapes[i]), dtypes[i], i))
    return out


def attend_kernel_spec(shapes: Sequence[Sequence[Any]], dtypes: Sequence[torch.dtype], *, band: int,
                       scale: float) -> KernelSpec:
    """The ``mac::attend`` kernel (``attend_onepass.mac_attend_onepass``) specialised for these inputs.

    Grid ``(B, Hkv, 1)``, scalar arguments ``(B, T)``. ``Hq``, ``Hkv``, ``K``, ``d`` static.
    """
    from ..triton_util import interpreting
    from .attend_onepass import mac_attend_onepass

    attend_output_specs(shapes, dtypes, band=band, scale=scale)
    B, T = shapes[0][0], shapes[2][2]
    Hq = static_dim(shapes[0][1], "Hq (q dim 1)")
    d = pow2_head_dim(shapes[0][2], "d (q dim 2)")
    Hkv = static_dim(shapes[2][1], "Hkv (k dim 1)")
    K = static_dim(shapes[7][2], "K (qring dim 2)")
    hpg = Hq // Hkv
    ptr = [triton_ptr_type(dt, name) for name, dt in zip(INPUTS, dtypes)]
    names = [f"{n}_ptr" for n in INPUTS]
    signature = dict(zip(names, ptr))
    signature.update({"B": "i32", "T": "i32", "out_ptr": ptr[0], "qring_out_ptr": ptr[7], "oring_out_ptr": ptr[8],
                      "ring_lse_out_ptr": ptr[9], "ring_pos_out_ptr": ptr[10]})
    scale32 = float(torch.tensor(scale, dtype=torch.float32))
    constexprs = {"HQ": Hq, "HKV": Hkv, "K": K, "D": d, "BAND": band, "SCALE_LOG2": scale32 * math.log2(math.e),
                  "BLOCK_N": 64 if d <= 128 else 32, "HPG_M": max(16, 1 << max(0, (hpg - 1).bit_length())),
                  # the interpreter mis-computes bf16 tl.dot (see triton_util.interpreting); compiled: native
                  "DOT_F32": interpreting()}
    return KernelSpec(kernel=mac_attend_onepass, signature=tuple(signature.items()),
                      constexprs=tuple(constexprs.items()), grid=(B, Hkv, 1), extra_args=(B, T), num_warps=4)


def attend_aot_image(shapes: Sequence[Sequence[Any]], dtypes: Sequence[torch.dtype], *, band: int, scale: float,
                     arch: int = 90) -> AotImage:
    """The compiled ``mac::attend`` image that ``aot_impl`` hands TensorRT."""
    return compile_image(attend_kernel_spec(shapes, dtypes, band=band, scale=scale), arch)


def register_tensorrt(binding) -> None:
    """Register ``mac::attend`` with ``tensorrt.plugin`` through ``binding``
    (``tensorrt_plugins.PluginBinding``): descriptor (the rings aliased), JIT impl (``MacAttendLauncher``
    writing TensorRT's ``out`` and the aliased rings in place), AOT impl."""
    from .attend_op import MacAttendLauncher

    trtp = binding.trtp
    TensorDesc, Tensor = trtp.TensorDesc, trtp.Tensor
    launch = MacAttendLauncher()

    @binding.register(PLUGIN_ID)
    def _attend_desc(q: TensorDesc, q_pre: TensorDesc, k: TensorDesc, v: TensorDesc, positions: TensorDesc,
                     match_pos: TensorDesc, slots: TensorDesc, qring: TensorDesc, oring: TensorDesc,
                     ring_lse: TensorDesc, ring_pos: TensorDesc, band: int, scale: float
                     ) -> Tuple[TensorDesc, TensorDesc, TensorDesc, TensorDesc, TensorDesc]:
        return binding.output_descs((q, q_pre, k, v, positions, match_pos, slots, qring, oring, ring_lse, ring_pos),
                                    attend_output_specs, band=band, scale=scale)

    @trtp.impl(PLUGIN_ID)
    def _attend_impl(q: Tensor, q_pre: Tensor, k: Tensor, v: Tensor, positions: Tensor, match_pos: Tensor,
                     slots: Tensor, qring: Tensor, oring: Tensor, ring_lse: Tensor, ring_pos: Tensor, band: int,
                     scale: float, outputs: Tuple[Tensor], stream: int) -> None:
        binding.launch(stream, launch, (q, q_pre, k, v, positions, match_pos, slots, qring, oring, ring_lse, ring_pos),
                       (band, scale), outputs[:1])

    @trtp.aot_impl(PLUGIN_ID)
    def _attend_aot(q: TensorDesc, q_pre: TensorDesc, k: TensorDesc, v: TensorDesc, positions: TensorDesc,
                    match_pos: TensorDesc, slots: TensorDesc, qring: TensorDesc, oring: TensorDesc,
                    ring_lse: TensorDesc, ring_pos: TensorDesc, band: int, scale: float,
                    outputs: Tuple[TensorDesc], tactic: int) -> binding.aot_result:
        return binding.aot((q, q_pre, k, v, positions, match_pos, slots, qring, oring, ring_lse, ring_pos),
                           attend_aot_image, band=band, scale=scale)
