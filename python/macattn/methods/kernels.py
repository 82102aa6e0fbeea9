"""Explicit kernel registration: ``register_kernels()`` is the one call that makes the ``macattn`` torch
ops dispatch to the Triton launchers of ``macattn.plugins`` on CUDA (the engine's executor calls it on a
CUDA device; scripts and tests call it themselves). Importing ``macattn.plugins`` registers nothing.
Without triton (the CPU CI machine) it registers nothing, and the ops keep their plain-torch reference
on every device."""
from __future__ import annotations

from typing import Callable, Mapping

import torch

from macattn.plugins import HAVE_TRITON

__all__ = ["register_kernels", "registered_kernels", "register_cuda_launchers"]

_REGISTERED: dict[str, Callable] = {}


def register_cuda_launchers(launchers: Mapping[str, Callable[[], Callable]]) -> tuple[str, ...]:
    """``{op name: factory}``: register ``factory()`` as each op's CUDA kernel, once per op (an op
    registered before keeps its launcher). Returns the op names (registered now or before). The
    building block of the methods' ``register_cuda_kernels``."""
    for op, make in launchers.items():
        if op not in _REGISTERED:
            impl = make()
            torch.library.register_kernel(op, "cuda", impl)
            _REGISTERED[op] = impl
    return tuple(launchers)


def registered_kernels() -> dict[str, Callable]:
    """``{op name: launcher}`` registered so far (the launcher instances the ops dispatch to on CUDA)."""
    return dict(_REGISTERED)


def register_kernels() -> tuple[str, ...]:
    """Register every method's Triton launchers as its ops' CUDA kernels (``mac``, ``mka``, ``completion``:
    their ``ops.register_cuda_kernels``). Idempotent. Returns the op names registered; ``()`` when triton
    is not importable."""
    if not HAVE_TRITON:
        return ()
    from macattn.methods.completion.ops import register_cuda_kernels as completion
    from macattn.methods.mac.ops import register_cuda_kernels as mac
    from macattn.methods.mka.ops import register_cuda_kernels as mka

    return mac() + mka() + completion()
