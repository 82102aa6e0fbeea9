"""Runtime: decode state, paged KV, in-flight batching engine, TensorRT-LLM-style runner, serving.

Modules (nano-vllm style, one job each): ``state`` (MAC rings), ``slots`` (per-request
state registry), ``block_manager`` + ``kv_cache`` (paged KV), ``scheduler`` (in-flight
batching), ``executor`` (runs the patched model), ``engine`` (requests + steps),
``model_runner`` (``ModelRunner.generate``), ``triton_repo`` (Triton model repository).

Names are imported lazily: ``macattn.models.attention`` imports ``runtime.state`` while the
executor imports ``builder.patch``.
"""
import importlib

_EXPORTS = {
    "RuntimeConfig": "config", "LLMEngine": "engine", "StepOutput": "engine", "ModelRunner": "model_runner",
    "SamplingParams": "sampling", "SlotStates": "slots", "TensorSlotState": "slots", "MacState": "state",
    "MacDiagnostics": "state", "read_engine_dir": "engine_dir", "write_engine_dir": "engine_dir",
}
__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
