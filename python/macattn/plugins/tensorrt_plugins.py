"""Register the macattn plugins with TensorRT's Python plugin API (``tensorrt.plugin``).

Needs TensorRT >= 10.9 (``aot_impl``, ``KernelLaunchParams`` and ``QuickPluginCreationRequest`` first ship
in 10.9; ``require_tensorrt`` checks it). TensorRT cannot be installed in this workplace, so this module is
the thin, import-guarded skin over plain functions tested here: the ``plugin.py`` of each op folder
(shape/dtype inference; AOT images for the MAC ops). The tests run these definitions through upstream's
``tensorrt.plugin`` package (from the ``tensorrt-cu12-bindings`` wheel) over a recorder of TensorRT's
compiled core: that proves upstream's plugin-layer Python accepts them, not that a TensorRT build ran.

The plugins register in namespace ``trt_compat.PYTHON_NAMESPACE`` (``mac_py``), apart from the native
library ``libmacattn_trt.so`` (``mac``), so both can be loaded into one process.

Usage on a machine with TensorRT::

    from macattn.plugins.tensorrt_plugins import register_all
    register_all()          # then parse a *.trt.onnx written with backend="python"

``impl`` runs the op's Triton launcher (the one registered as the torch op's CUDA kernel) on TensorRT's
stream, writing TensorRT's output buffers; ``aot_impl`` hands TensorRT the one-pass kernel images
(``AotImage``), so an engine built with AOT plugins needs no Python at run time. ``match`` / ``attend``
define both; TensorRT then needs a choice: the ``aot`` attribute that ``to_tensorrt_onnx`` writes on
their ONNX nodes, or the network flag ``PREFER_AOT_PYTHON_PLUGINS`` / ``PREFER_JIT_PYTHON_PLUGINS``.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence, Tuple, Union

from .aot import AotImage
from .trt_compat import MIN_PYTHON_PLUGINS, require_version, split_id

__all__ = ["require_tensorrt", "register_all", "image_to_tensorrt", "PluginBinding"]

_REGISTERED = False


def require_tensorrt():
    """``(tensorrt, tensorrt.plugin)``; ``ImportError`` naming the package when absent,
    ``trt_compat.TensorRTVersionError`` (an ``ImportError``) when older than 10.9."""
    try:
        import tensorrt
    except ImportError as exc:
        raise ImportError(
            "the TensorRT plugins need the `tensorrt` package (>= 10.9, with tensorrt.plugin) and an "
            f"sm_90 GPU; it is not installed here ({exc}). Everything beneath the plugins runs without it: "
            "see docs/tensorrt.md") from exc
    require_version("tensorrt", getattr(tensorrt, "__version__", "0"), MIN_PYTHON_PLUGINS,
                    "the macattn Python plugins (tensorrt.plugin aot_impl / KernelLaunchParams)")
    import tensorrt.plugin as trtp

    return tensorrt, trtp


def image_to_tensorrt(trtp, image: AotImage):
    """``(kernel_name, ptx, KernelLaunchParams, SymIntExprs)`` as an ``aot_impl`` returns them.

    ``grid_x`` is the batch ``B`` (a dim expression), which is 0 on a TensorRT-LLM step without generation tokens:
    the launch uses ``B + (B == 0)`` programs (never an empty grid, which CUDA refuses) and the kernels return at
    once for a program ``>= B``."""
    launch = trtp.KernelLaunchParams()
    grid_x = image.grid[0]
    launch.grid_x, launch.grid_y, launch.grid_z = grid_x + (grid_x == 0), image.grid[1], image.grid[2]
    launch.block_x, launch.block_y, launch.block_z = image.block
    launch.shared_mem = image.shared_mem
    extra = trtp.SymIntExprs(len(image.extra_args))
    for i, e in enumerate(image.extra_args):
        extra[i] = trtp.SymInt32(e)
    return image.kernel_name, image.ptx, launch, extra


class PluginBinding:
    """The bodies every plugin definition hands ``tensorrt.plugin``, in one place.

    ``tensorrt.plugin`` reads the registered functions' parameter names and annotations, so each
    ``plugin.py`` writes out its signatures; the bodies are one call each:

    * descriptor: ``output_descs(inputs, output_specs, **attrs)``;
    * JIT impl: ``launch(stream, launcher, inputs, attrs, outputs)``;
    * AOT impl: ``aot(inputs, aot_image, **attrs)`` (return annotation: ``aot_result``).
    """

    def __init__(self, trt, trtp) -> None:
        import torch

        self.trtp = trtp
        self._dtypes = ((trt.float32, torch.float32), (trt.float16, torch.float16), (trt.bfloat16, torch.bfloat16),
                        (trt.int64, torch.int64), (trt.int32, torch.int32))
        # the return annotation tensorrt.plugin requires of an aot_impl
        self.aot_result = Tuple[Union[str, bytes], Union[str, bytes], trtp.KernelLaunchParams, trtp.SymExprs]

    def register(self, plugin_id: str) -> Callable[[Callable], Callable]:
        """``trtp.register(plugin_id)``, or, when ``tensorrt.plugin`` already holds a definition of
        ``plugin_id`` (an earlier ``register_all`` that failed part way, or a second call), a decorator that
        keeps that definition: upstream refuses a second one ("already has a definition"). The descriptor is
        a pure function of the same inputs, so the kept one is equivalent."""
        namespace, name = split_id(plugin_id)
        op = getattr(self.trtp, "op", None)
        if op is not None and hasattr(op, namespace) and hasattr(getattr(op, namespace), name):
            return lambda fn: fn
        return self.trtp.register(plugin_id)

    def to_torch_dtype(self, dtype) -> Any:
        """The torch dtype of a TensorRT ``DataType``; ``TypeError`` for one the plugins do not take."""
        return self._convert(dtype, 0, "TensorRT dtype {} is not supported by the macattn plugins")

    def to_trt_dtype(self, dtype) -> Any:
        """The TensorRT ``DataType`` of a torch dtype."""
        return self._convert(dtype, 1, "torch dtype {} has no TensorRT counterpart here")

    def _convert(self, dtype, side: int, error: str):
        for pair in self._dtypes:
            if dtype == pair[side]:
                return pair[1 - side]
        raise TypeError(error.format(dtype))

    def apply(self, fn: Callable[..., Any], inputs: Sequence[Any], **attrs) -> Any:
        """``fn(shapes, dtypes, **attrs)`` (a plain function of ``plugin.py``: inference, AOT image) over the
        input descriptors' shape expressions and torch dtypes."""
        return fn([t.shape_expr for t in inputs], [self.to_torch_dtype(t.dtype) for t in inputs], **attrs)

    def output_descs(self, inputs: Sequence[Any], output_specs: Callable[..., list], *,
                     aliases: Mapping[int, int] | None = None, **attrs) -> tuple:
        """TensorRT descriptors of the outputs ``output_specs`` infers: ``(shape, dtype)`` or ``(shape,
        dtype, alias_of)`` per output. Output ``i`` aliasing input ``j`` (``alias_of``, or ``aliases[i]``)
        is ``inputs[j].aliased()``: TensorRT binds one buffer to both, the launcher writes it in place."""
        descs = []
        for i, spec in enumerate(self.apply(output_specs, inputs, **attrs)):
            alias = aliases.get(i) if aliases is not None else (spec[2] if len(spec) > 2 else None)
            descs.append(inputs[alias].aliased() if alias is not None
                         else self.trtp.from_shape_expr(tuple(spec[0]), dtype=self.to_trt_dtype(spec[1])))
        return tuple(descs)

    def as_torch(self, t) -> Any:
        """A torch view (no copy) of a ``tensorrt.plugin.Tensor`` on the GPU.

        Built from its ``data_ptr`` / ``shape`` / ``strides`` (elements) / ``dtype``: TensorRT refuses
        ``__cuda_array_interface__`` for BF16 and FP8, so the memory is presented to torch as an
        integer array of the same element width and viewed as the tensor's dtype."""
        import torch

        dtype = self.to_torch_dtype(t.dtype)
        raw = _CudaMemory(int(t.data_ptr), tuple(int(n) for n in t.shape), tuple(int(s) for s in t.strides),
                          dtype.itemsize)
        return torch.as_tensor(raw, device="cuda").view(dtype)

    def launch(self, stream: int, launcher: Callable[..., Any], inputs: Sequence[Any], attrs: Sequence[Any],
               outputs: Sequence[Any]) -> None:
        """``launcher(*inputs, *attrs, out=...)`` on TensorRT's ``stream``; every tensor a torch view of
        TensorRT's buffer (``as_torch``). ``outputs``: the buffers the launcher writes (aliased outputs are
        written through their inputs), passed as ``out`` like the op returns them: one tensor, or a tuple."""
        import torch

        ins = [self.as_torch(t) for t in inputs]
        outs = tuple(self.as_torch(t) for t in outputs)
        with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
            launcher(*ins, *attrs, out=outs[0] if len(outs) == 1 else outs)

    def aot(self, inputs: Sequence[Any], aot_image: Callable[..., AotImage], **attrs):
        """What an ``aot_impl`` returns for ``aot_image(shapes, dtypes, **attrs)`` over the input descriptors."""
        return image_to_tensorrt(self.trtp, self.apply(aot_image, inputs, **attrs))


class _CudaMemory:
    """GPU memory as torch reads it (``__cuda_array_interface__`` v3): ``shape``, ``strides`` in elements of
    ``itemsize`` bytes, typed as the signed integer of that width (the caller views it as the real dtype)."""

    def __init__(self, ptr: int, shape: tuple, strides: tuple, itemsize: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": shape, "typestr": f"<i{itemsize}" if itemsize > 1 else "|i1", "data": (ptr, False),
            "strides": tuple(s * itemsize for s in strides), "stream": None, "version": 3}


def register_all() -> tuple[str, ...]:
    """Register ``mac_py::match``, ``mac_py::attend``, ``mac_py::route_fused``, ``mac_py::retrieval_completion``
    and ``mac_py::completion_cache``; returns their plugin ids. Safe to call again, also after a call that failed
    part way (definitions already in ``tensorrt.plugin`` are kept, the implementations re-attached)."""
    global _REGISTERED
    trt, trtp = require_tensorrt()
    from .mac import attend_plugin
    from .mac import match_plugin
    from .retrieval_completion import plugin as completion_plugin
    from .route_fused import plugin as route_plugin

    if not _REGISTERED:
        binding = PluginBinding(trt, trtp)
        for plugin in (match_plugin, attend_plugin, route_plugin, completion_plugin):
            plugin.register_tensorrt(binding)
        _REGISTERED = True
    return (match_plugin.PLUGIN_ID, attend_plugin.PLUGIN_ID, route_plugin.PLUGIN_ID, completion_plugin.STEP_ID,
            completion_plugin.CACHE_ID)
