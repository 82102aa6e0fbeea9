"""Register the macattn plugins with TensorRT's Python plugin API (``tensorrt.plugin``).

Targets TensorRT 10.8+ (``tensorrt.plugin`` with ``register`` / ``impl`` / ``aot_impl``;
read from the 11.4 bindings' sources). TensorRT cannot be installed in this workplace, so
this module is the thin, import-guarded skin over plain functions tested here:
the ``plugin.py`` of each op folder (shape/dtype inference; AOT images for the MAC ops).

Usage on a machine with TensorRT::

    from macattn.plugins.tensorrt_plugins import register_all
    register_all()          # then parse *.trt.onnx (op_type match/attend, namespace mac)

``impl`` runs the ops through torch (the Triton JIT kernels) on TensorRT's stream;
``aot_impl`` hands TensorRT the one-pass kernel images (``AotImage``), so an engine built
with ``--aot`` plugins needs no Python at run time.
"""
from __future__ import annotations

from .aot import AotImage

__all__ = ["require_tensorrt", "register_all", "image_to_tensorrt"]

_REGISTERED = False


def require_tensorrt():
    """``(tensorrt, tensorrt.plugin)``; ``ImportError`` naming the package when absent."""
    try:
        import tensorrt
        import tensorrt.plugin as trtp
    except ImportError as exc:
        raise ImportError(
            "the TensorRT plugins need the `tensorrt` package (>= 10.8, with tensorrt.plugin) and an "
            f"sm_90 GPU; it is not installed here ({exc}). Everything beneath the plugins runs without it: "
            "see docs/tensorrt.md") from exc
    return tensorrt, trtp


def _dtype_maps(trt):
    import torch

    pairs = [(trt.float32, torch.float32), (trt.float16, torch.float16), (trt.bfloat16, torch.bfloat16),
             (trt.int64, torch.int64), (trt.int32, torch.int32)]

    def to_torch(dt):
        for a, b in pairs:
            if dt == a:
                return b
        raise TypeError(f"TensorRT dtype {dt} is not supported by the macattn plugins")

    def to_trt(dt):
        for a, b in pairs:
            if dt == b:
                return a
        raise TypeError(f"torch dtype {dt} has no TensorRT counterpart here")

    return to_torch, to_trt


def image_to_tensorrt(trtp, image: AotImage):
    """``(kernel_name, ptx, KernelLaunchParams, SymIntExprs)`` as an ``aot_impl`` returns them."""
    launch = trtp.KernelLaunchParams()
    launch.grid_x, launch.grid_y, launch.grid_z = image.grid
    launch.block_x, launch.block_y, launch.block_z = image.block
    launch.shared_mem = image.shared_mem
    extra = trtp.SymIntExprs(len(image.extra_args))
    for i, e in enumerate(image.extra_args):
        extra[i] = trtp.SymInt32(e)
    return image.kernel_name, image.ptx, launch, extra


def register_all() -> tuple[str, ...]:
    """Register ``mac::match``, ``mac::attend``, ``mac::route_fused``, ``mac::retrieval_completion`` and
    ``mac::completion_cache`` once; returns their plugin ids."""
    global _REGISTERED
    trt, trtp = require_tensorrt()
    from .mac_attend import plugin as attend_plugin
    from .mac_match import plugin as match_plugin
    from .retrieval_completion import plugin as completion_plugin
    from .route_fused import plugin as route_plugin

    if not _REGISTERED:
        to_torch, to_trt = _dtype_maps(trt)
        match_plugin.register_tensorrt(trtp, to_torch, to_trt)
        attend_plugin.register_tensorrt(trtp, to_torch, to_trt)
        route_plugin.register_tensorrt(trtp, to_torch, to_trt)
        completion_plugin.register_tensorrt(trtp, to_torch, to_trt)
        _REGISTERED = True
    return (match_plugin.PLUGIN_ID, attend_plugin.PLUGIN_ID, route_plugin.PLUGIN_ID, completion_plugin.STEP_ID,
            completion_plugin.CACHE_ID)
