"""The classes ``backend.load()`` defines over the installed TensorRT-LLM, importable by name.

``backend._define`` sets their ``__module__`` to this module, so pickle stores a ``MacSparseAttentionConfig``
as ``macattn.builder.trtllm_pytorch.registered.MacSparseAttentionConfig``. The LLM API runs the executor in a
spawned worker process (also for one GPU) and sends it the arguments pickled: unpickling the config there
imports this module and looks the name up, which runs ``backend.install()`` in the worker first, so upstream's
sparse dispatch returns the MAC classes in a process where nobody called ``install()``.

Names: ``MacSparseAttentionConfig``, ``MacKVCacheManager``, ``MacTrtllmAttentionMetadata``,
``MacTrtllmAttention``; looking one up without ``tensorrt_llm`` raises ``backend.require_trtllm_pytorch``'s
``ImportError``.
"""
from __future__ import annotations

from .backend import CLASS_NAMES, install, load

__all__ = list(CLASS_NAMES)


def __getattr__(name: str):
    if name in CLASS_NAMES:
        install()
        return getattr(load(), CLASS_NAMES[name])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
