"""TensorRT plugin ``mac::match`` (version "1"): shape/dtype inference, AOT image, registration.

The ONNX node ``macattn::MacMatch`` (``docs/graph.md``) becomes this plugin in
``*.trt.onnx``: same inputs in the same order, attributes ``band`` (int) and ``tau`` (float).
Inference and the AOT image are plain functions over *dims* (``int`` or TensorRT's
``ShapeExpr``) and torch dtypes, tested without TensorRT; ``register_tensorrt`` is the thin
skin that hands them to ``tensorrt.plugin`` (needs ``tensorrt>=10.9``: ``trt_compat.MIN_PYTHON_PLUGINS``).

No ``from __future__ import annotations`` here: ``tensorrt.plugin`` reads the registered
functions' annotations as classes.
"""
import numbers
from typing import Any, Sequence, Tuple

import torch

from macattn.core.threshold import match_threshold

from ..aot import (FLOATS, AotImage, KernelSpec, check_dims_fit, check_dtypes, check_input_ranks, check_int_attrs,
                   compile_image, pow2_head_dim, static_dim, triton_ptr_type)
from ..trt_compat import python_id

__all__ = ["PLUGIN_ID", "INPUTS", "OUTPUTS", "match_output_specs", "match_kernel_spec", "match_aot_image", "register_tensorrt"]

PLUGIN_ID = python_id("match")
INPUTS = ("q_pre", "qring", "ring_lse", "ring_pos", "slots", "positions")
OUTPUTS = ("match_pos", "dist")
_RANKS = (3, 4, 3, 2, 1, 1)
_DTYPES = {"q_pre": FLOATS, "qring": FLOATS, "ring_lse": (torch.float32,),
           **dict.fromkeys(("ring_pos", "slots", "positions"), (torch.int64,))}


def _check_attrs(band: int, tau: float) -> None:
    check_int_attrs(band=band)
    if not (isinstance(tau, numbers.Real) and 0.0 <= float(tau) < 1.0):
        raise ValueError(f"tau must be a float in [0, 1), got {tau!r}")


def match_output_specs(shapes: Sequence[Sequence[Any]], dtypes: Sequence[torch.dtype], *, band: int,
                       tau: float) -> list[tuple[tuple[Any, ...], torch.dtype]]:
    """Output ``(shape, dtype)`` of ``mac::match`` from its six inputs' shapes and dtypes.

    ``[(B, Hq) int64 match_pos, (B, Hq) float32 dist]``. Raises ``ValueError``/``TypeError``
    naming the input on a rank, dim or dtype that does not fit ``docs/graph.md``.
    """
    _check_attrs(band, tau)
    check_input_ranks("mac::match", INPUTS, _RANKS, shapes, dtypes)
    q_pre, qring, ring_lse, ring_pos, slots, positions = shapes
    B, Hq, d = q_pre
    S, K = qring[0], qring[2]
    check_dims_fit((("qring", qring, (S, Hq, K, d)), ("ring_lse", ring_lse, (S, Hq, K)), ("ring_pos", ring_pos, (S, K)),
                    ("slots", slots, (B,)), ("positions", positions, (B,))), " (q_pre [B, Hq, d], qring [S, Hq, K, d])")
    check_dtypes(INPUTS, dtypes, _DTYPES)
    return [((B, Hq), torch.int64), ((B, Hq), torch.float32)]


def match_kernel_spec(shapes: Sequence[Sequence[Any]], dtypes: Sequence[torch.dtype], *, band: int,
                      tau: float) -> KernelSpec:
    """The ``mac::match`` kernel (``match_onepass.mac_match_onepass``) specialised for these inputs.

    Grid ``(B, Hq, 1)``, one scalar argument ``B``. ``Hq``, ``K``, ``d`` must be static.
    """
    from .match_onepass import mac_match_onepass

    match_output_specs(shapes, dtypes, band=band, tau=tau)
    B = shapes[0][0]
    Hq = static_dim(shapes[0][1], "Hq (q_pre dim 1)")
    d = pow2_head_dim(shapes[0][2], "d (q_pre dim 2)")
    K = static_dim(shapes[1][2], "K (qring dim 2)")
    thr = match_threshold(d, float(torch.tensor(tau, dtype=torch.float32)))
    signature = {"q_pre_ptr": triton_ptr_type(dtypes[0], "q_pre"), "qring_ptr": triton_ptr_type(dtypes[1], "qring"),
                 "ring_lse_ptr": "*fp32", "ring_pos_ptr": "*i64", "slots_ptr": "*i64", "positions_ptr": "*i64",
                 "B": "i32", "match_pos_ptr": "*i64", "dist_ptr": "*fp32"}
    block_k = min(64, 1 << max(0, (K - 1).bit_length()))
    constexprs = {"HQ": Hq, "K": K, "D": d, "BAND": band, "THR": thr, "BLOCK_K": block_k}
    return KernelSpec(kernel=mac_match_onepass, signature=tuple(signature.items()),
                      constexprs=tuple(constexprs.items()), grid=(B, Hq, 1), extra_args=(B,), num_warps=4)


def match_aot_image(shapes: Sequence[Sequence[Any]], dtypes: Sequence[torch.dtype], *, band: int, tau: float,
                    arch: int = 90) -> AotImage:
    """The compiled ``mac::match`` image that ``aot_impl`` hands TensorRT."""
    return compile_image(match_kernel_spec(shapes, dtypes, band=band, tau=tau), arch)


def register_tensorrt(binding) -> None:
    """Register ``mac::match`` with ``tensorrt.plugin`` through ``binding``
    (``tensorrt_plugins.PluginBinding``): descriptor, JIT impl (``MacMatchLauncher`` writing TensorRT's
    outputs), AOT impl."""
    from .match_op import MacMatchLauncher

    trtp = binding.trtp
    TensorDesc, Tensor = trtp.TensorDesc, trtp.Tensor
    launch = MacMatchLauncher()

    @binding.register(PLUGIN_ID)
    def _match_desc(q_pre: TensorDesc, qring: TensorDesc, ring_lse: TensorDesc, ring_pos: TensorDesc,
                    slots: TensorDesc, positions: TensorDesc, band: int, tau: float) -> Tuple[TensorDesc, TensorDesc]:
        return binding.output_descs((q_pre, qring, ring_lse, ring_pos, slots, positions), match_output_specs,
                                    band=band, tau=tau)

    @trtp.impl(PLUGIN_ID)
    def _match_impl(q_pre: Tensor, qring: Tensor, ring_lse: Tensor, ring_pos: Tensor, slots: Tensor,
                    positions: Tensor, band: int, tau: float, outputs: Tuple[Tensor], stream: int) -> None:
        binding.launch(stream, launch, (q_pre, qring, ring_lse, ring_pos, slots, positions), (band, tau), outputs)

    @trtp.aot_impl(PLUGIN_ID)
    def _match_aot(q_pre: TensorDesc, qring: TensorDesc, ring_lse: TensorDesc, ring_pos: TensorDesc,
                   slots: TensorDesc, positions: TensorDesc, band: int, tau: float, outputs: Tuple[TensorDesc],
                   tactic: int) -> binding.aot_result:
        return binding.aot((q_pre, qring, ring_lse, ring_pos, slots, positions), match_aot_image, band=band, tau=tau)
