"""Explicit kernel registration: the one call that makes the ``macattn`` torch ops dispatch to the
Triton launchers of ``macattn.plugins`` on CUDA (the engine's executor calls it on a CUDA device;
scripts and tests call it themselves). Without triton (the CPU CI machine) it registers nothing,
and the ops keep their plain-torch reference on every device."""
from __future__ import annotations

from typing import Callable

import torch

from macattn.plugins import HAVE_TRITON

__all__ = ["register_kernels", "register_cuda_kernel", "registered_kernels"]

_REGISTERED: dict[str, Callable] = {}


def register_cuda_kernel(op: str, make_impl: Callable[[], Callable]) -> bool:
    """Register ``make_impl()`` as ``op``'s CUDA kernel once (later calls: no-op, False)."""
    if op in _REGISTERED:
        return False
    impl = make_impl()
    torch.library.register_kernel(op, "cuda", impl)
    _REGISTERED[op] = impl
    return True


def registered_kernels() -> dict[str, Callable]:
    """``{op name: launcher}`` registered so far."""
    return dict(_REGISTERED)


def register_kernels() -> tuple[str, ...]:
    """Register every method's Triton launchers as its ops' CUDA kernels (idempotent). Returns the
    op names now registered; ``()`` when triton is not importable."""
    if not HAVE_TRITON:
        return ()
    from macattn.methods.completion.ops import register_cuda_kernels as completion
    from macattn.methods.mac.ops import register_cuda_kernels as mac
    from macattn.methods.mka.ops import register_cuda_kernels as mka

    for register in (mac, mka, completion):
        register()
    return tuple(_REGISTERED)
