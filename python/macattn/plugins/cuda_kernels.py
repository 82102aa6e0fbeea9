"""The table of CUDA kernels registered for the ``macattn`` torch ops: ``register_cuda_launchers`` (the
building block of each method's ``ops.register_cuda_kernels``) registers a launcher as an op's CUDA
kernel once, ``registered_kernels`` lists them. ``macattn.methods.kernels.register_kernels`` is the one
call that registers every method's launchers."""
from __future__ import annotations

from typing import Callable, Mapping

import torch

__all__ = ["register_cuda_launchers", "registered_kernels"]

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
