"""Runtime: the in-flight batching engine over every attention method and the TensorRT-LLM-style
runner (the servers over it are ``macattn.apps.serving``).

Modules (nano-vllm style, one job each): ``slots`` (per-request state registry),
``block_manager`` + ``kv_cache`` (paged KV), ``scheduler`` (in-flight batching), ``executor``
(runs the bound model, one ``StepContext`` per call; packed prefill), ``cuda_decode`` (per-bucket
plans and CUDA graphs) with ``step_inputs`` (a bucket's static inputs, one staged copy per step),
``engine`` (requests + steps), ``model_runner`` (``ModelRunner.generate``), ``a3_assembly`` +
``chunk_store`` (A3's fused prefill, the chunk KV store and the completion method's prefix store).
"""
import importlib

# the public names and their modules, imported on first use: ``import macattn.runtime.engine_args`` (the
# command line's flags) loads neither torch nor the engine
_EXPORTS = {"RuntimeConfig": "config", "LLMEngine": "engine", "StepOutput": "engine", "ModelRunner": "model_runner",
            "SamplingConfig": "sampling", "SlotStates": "slots", "TensorSlotState": "slots",
            "read_engine_dir": "engine_dir", "write_engine_dir": "engine_dir"}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    """The public names of ``_EXPORTS``, from their module on first use."""
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"macattn.runtime.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'macattn.runtime' has no attribute {name!r}")
