"""Ahead-of-time kernel images of the TensorRT plugins, built without TensorRT.

``AotImage`` is exactly what a ``tensorrt.plugin.aot_impl`` hands TensorRT: the kernel
name, its image (PTX; the cubin rides along for the CUDA-driver test and the C library),
the launch parameters (grid, block, shared memory) and the int32 scalar arguments that sit
between the tensor inputs and the tensor outputs. Grid entries and scalar arguments are
*dims*: plain ``int`` here and in the tests, TensorRT's ``ShapeExpr`` inside ``aot_impl``
(both support what the specs use: identity). Everything static (heads, window, head dim,
band, threshold, scale) is baked into the kernel as a constexpr, since TensorRT does not
serialize attributes of an AOT plugin.

Triton 3.6 appends two hidden pointer parameters to every kernel (global and profile
scratch). Our kernels need neither (both sizes are checked to be 0), so a launcher may pass
null for them, as Triton's own AOT C launcher does; ``AotImage.num_params`` counts them.
"""
from __future__ import annotations

import functools
import inspect
import numbers
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch

__all__ = ["KernelSpec", "AotImage", "compile_image", "constant_dim", "static_dim", "same_dim", "triton_ptr_type", "SM90", "HIDDEN_PARAMS",
           "FLOATS", "AOT_TRITON_VERSIONS", "AOT_PTX_VERSION", "AOT_PTX_ISA", "check_int_attrs", "check_input_ranks", "check_dims_fit", "check_dtypes", "pow2_head_dim", "destination"]

SM90 = 90
HIDDEN_PARAMS = 2
# The images are made only with the Tritons they were verified with (3.9.0 here and in CI, 3.6.0 on the
# device machine, where the images are launched against the reference): their kernels end in HIDDEN_PARAMS
# scratch pointers. Their PTX is pinned to ISA AOT_PTX_VERSION (Triton's ``ptx_version`` option; left to itself
# Triton writes the newest ISA its ptxas knows: 9.4 for 3.9.0, which only a CUDA 13.4 driver JIT-compiles):
# 8.0 is sm_90a's minimum and what CUDA 12.0+ drivers load, so cu12 TensorRT deployments can run the PTX that
# TensorRT's AOT path receives. The cubin needs an sm_90 GPU (H100 / H200).
AOT_TRITON_VERSIONS = ("3.6.0", "3.9.0")
AOT_PTX_VERSION = 80
AOT_PTX_ISA = f"{AOT_PTX_VERSION // 10}.{AOT_PTX_VERSION % 10}"
FLOATS = (torch.float32, torch.float16, torch.bfloat16)   # the activations' dtypes the plugins take

_PTR = {torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.int64: "*i64",
        torch.int32: "*i32"}


def triton_ptr_type(dtype: torch.dtype, what: str) -> str:
    """Triton signature string of a pointer to ``dtype`` (``*bf16`` ...)."""
    try:
        return _PTR[dtype]
    except KeyError:
        raise TypeError(f"{what}: dtype {dtype} is not one of {sorted(str(d) for d in _PTR)}") from None


def constant_dim(x: Any) -> int | None:
    """The value of a dim known at build time, else None.

    ``x``: an ``int``, or a ``tensorrt.plugin.ShapeExpr``. TensorRT first queries output dtypes with
    *placeholder* (fake) shape expressions, whose ``is_constant`` raises ``RuntimeError``; those, and
    expressions that are not constants, are unknown here (None)."""
    if isinstance(x, numbers.Integral) and not isinstance(x, bool):
        return int(x)
    if getattr(x, "is_fake", False):
        return None
    try:
        const = x.is_constant
        const = const() if callable(const) else const
        return int(x.constant_value()) if const else None
    except (RuntimeError, AttributeError):
        return None


def static_dim(x: Any, what: str) -> int:
    """``x`` as an int: an int, or a TensorRT dim expression that is a build-time constant
    (``ValueError`` naming ``what`` otherwise, placeholder expressions included)."""
    val = constant_dim(x)
    if val is None:
        raise ValueError(f"{what} must be a build-time constant (static in the ONNX graph), got a dynamic dim")
    return val


def same_dim(a: Any, b: Any) -> bool:
    """False only when both are known and differ (dynamic dims are checked by TensorRT at run time)."""
    va, vb = constant_dim(a), constant_dim(b)
    return va is None or vb is None or va == vb


def check_int_attrs(**attrs: Any) -> None:
    """Each integer attribute must be an int >= 0 (``ValueError`` naming the first that is not)."""
    for name, val in attrs.items():
        if isinstance(val, bool) or not isinstance(val, numbers.Integral) or val < 0:
            raise ValueError(f"{name} must be an int >= 0, got {val!r}")


def check_input_ranks(op: str, names: Sequence[str], ranks: Sequence[int], shapes: Sequence[Sequence[Any]],
                      dtypes: Sequence[torch.dtype]) -> None:
    """``op`` takes ``len(names)`` inputs of ranks ``ranks``: ``ValueError`` naming the first that does not."""
    if len(shapes) != len(names) or len(dtypes) != len(names):
        raise ValueError(f"{op} takes {len(names)} inputs {tuple(names)}, got {len(shapes)}")
    for name, shape, rank in zip(names, shapes, ranks):
        if len(shape) != rank:
            raise ValueError(f"{name} must have rank {rank}, got {len(shape)}")


def check_dims_fit(fits: Iterable[tuple[str, Sequence[Any], Sequence[Any]]], layout: str = "") -> None:
    """Each ``(name, shape, want)``: ``ValueError`` naming the first input whose known dims differ from
    ``want`` (``layout``: the inputs' layout, appended to the message)."""
    for name, got, want in fits:
        if not all(same_dim(a, b) for a, b in zip(got, want)):
            raise ValueError(f"{name} shape {tuple(got)} does not fit {tuple(want)}{layout}")


def check_dtypes(names: Sequence[str], dtypes: Sequence[torch.dtype],
                 allowed: Mapping[str, Sequence[torch.dtype]]) -> None:
    """``TypeError`` naming the first input ``names[i]`` whose dtype is not in ``allowed[names[i]]``
    (inputs not in ``allowed``: any dtype)."""
    for name, dt in zip(names, dtypes):
        if name in allowed and dt not in allowed[name]:
            raise TypeError(f"{name} must be one of {tuple(allowed[name])}, got {dt}")


def pow2_head_dim(x: Any, what: str) -> int:
    """The static head dim of an AOT kernel: a power of two >= 16."""
    d = static_dim(x, what)
    if d < 16 or d & (d - 1):
        raise ValueError(f"head dim d must be a power of two >= 16, got {d}")
    return d


def destination(out: torch.Tensor | None, name: str, shape: Sequence[int], dtype: torch.dtype,
                device: torch.device, alloc: Callable[..., torch.Tensor] = torch.empty) -> torch.Tensor:
    """Where a launcher writes one output: a new ``alloc(*shape, dtype=, device=)`` when ``out`` is None,
    else ``out`` (a plugin's JIT impl passes TensorRT's output buffer), which must be a contiguous
    ``shape`` tensor of ``dtype`` on ``device`` (``ValueError`` naming it otherwise)."""
    if out is None:
        return alloc(*shape, dtype=dtype, device=device)
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype or out.device != device or not out.is_contiguous():
        raise ValueError(f"{name} must be a contiguous {dtype} tensor of shape {list(shape)} on {device}, got "
                         f"{'a contiguous' if out.is_contiguous() else 'a strided'} {out.dtype} tensor of shape "
                         f"{list(out.shape)} on {out.device}")
    return out


@dataclass(frozen=True)
class KernelSpec:
    """One kernel specialised for a plugin's inputs: what to compile and how to launch it.

    ``signature``: runtime parameters in order (name, Triton type): the plugin's inputs,
    int32 scalars, outputs. ``grid`` / ``extra_args``: dims (see module doc).
    """

    kernel: Any = field(compare=False, repr=False)      # the @triton.jit function
    signature: tuple[tuple[str, str], ...]
    constexprs: tuple[tuple[str, Any], ...]
    grid: tuple[Any, Any, Any]
    extra_args: tuple[Any, ...]
    num_warps: int
    num_stages: int = 2

    @property
    def source(self) -> tuple[str, str]:
        """(path of the self-contained kernel file, kernel function name)."""
        fn = self.kernel.fn
        return inspect.getsourcefile(fn), fn.__name__

    def launch_jit(self, *args: Any) -> None:
        """Launch through Triton's JIT (or its interpreter under ``TRITON_INTERPRET=1``) with
        these constexprs; ``args`` in ``signature`` order, ``grid`` concrete ints. The
        reference launcher of what the compiled image computes."""
        if len(args) != len(self.signature):
            raise ValueError(f"{self.source[1]} takes {len(self.signature)} runtime arguments, got {len(args)}")
        grid = tuple(int(g) for g in self.grid)
        self.kernel[grid](*args, **dict(self.constexprs), num_warps=self.num_warps, num_stages=self.num_stages)


@dataclass(frozen=True)
class AotImage:
    """A compiled ``KernelSpec``: what ``aot_impl`` returns to TensorRT, plus the cubin."""

    spec: KernelSpec
    kernel_name: str
    ptx: str
    cubin: bytes
    block: tuple[int, int, int]
    shared_mem: int
    num_params: int          # kernel parameters incl. the hidden scratch pointers
    arch: int

    @property
    def grid(self) -> tuple[Any, Any, Any]:
        return self.spec.grid

    @property
    def extra_args(self) -> tuple[Any, ...]:
        return self.spec.extra_args


@functools.lru_cache(maxsize=64)
def _compile_cached(kernel: Any, signature: tuple, constexprs: tuple, num_warps: int, num_stages: int, arch: int):
    """Keyed on what the compiled code depends on only: the grid and scalar arguments are dims that may be
    TensorRT ``ShapeExpr``s, which define ``__eq__`` without ``__hash__`` (unhashable)."""
    import triton
    from triton.backends.compiler import GPUTarget

    sig = {**dict(signature), **{k: "constexpr" for k, _ in constexprs}}
    src = triton.compiler.ASTSource(fn=kernel, signature=sig, constexprs=dict(constexprs))
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                              options={"num_warps": num_warps, "num_stages": num_stages,
                                       "ptx_version": AOT_PTX_VERSION})
    if getattr(compiled.metadata, "global_scratch_size", 0) or getattr(compiled.metadata, "profile_scratch_size", 0):
        raise RuntimeError(f"{kernel.fn.__name__}: needs global/profile scratch, which an AOT plugin cannot provide")
    return compiled


def compile_image(spec: KernelSpec, arch: int = SM90) -> AotImage:
    """Compile ``spec`` for ``sm_<arch>`` (no GPU needed: Triton's bundled ptxas), PTX at ISA ``AOT_PTX_ISA``."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("TRITON_INTERPRET=1: kernels are interpreted, not compiled; use KernelSpec.launch_jit")
    import triton

    if triton.__version__ not in AOT_TRITON_VERSIONS:
        raise RuntimeError(f"AOT images are made only with triton in {AOT_TRITON_VERSIONS} (hidden parameters); "
                           f"found triton {triton.__version__}")
    compiled = _compile_cached(spec.kernel, spec.signature, spec.constexprs, spec.num_warps, spec.num_stages, arch)
    return AotImage(spec=spec, kernel_name=compiled.metadata.name, ptx=compiled.asm["ptx"],
                    cubin=compiled.asm["cubin"], block=(compiled.metadata.num_warps * 32, 1, 1),
                    shared_mem=int(compiled.metadata.shared), num_params=len(spec.signature) + HIDDEN_PARAMS,
                    arch=arch)
