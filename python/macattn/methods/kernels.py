"""Explicit kernel registration: ``register_kernels()`` is the one call that makes the ``macattn`` torch
ops dispatch to the Triton launchers of ``macattn.plugins`` on CUDA (the engine's executor calls it on a
CUDA device; scripts and tests call it themselves). Importing ``macattn.plugins`` registers nothing.
Without triton (the CPU CI machine) it registers nothing, and the ops keep their plain-torch reference
on every device. The table of registered launchers is ``macattn.plugins.cuda_kernels``."""
from __future__ import annotations

from macattn.plugins import HAVE_TRITON
from macattn.plugins.cuda_kernels import registered_kernels

__all__ = ["register_kernels", "registered_kernels"]


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
