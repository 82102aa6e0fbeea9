"""Runtime: the in-flight batching engine over every attention method and the TensorRT-LLM-style
runner (the servers over it are ``macattn.apps.serving``).

Modules (nano-vllm style, one job each): ``slots`` (per-request state registry),
``block_manager`` + ``kv_cache`` (paged KV), ``scheduler`` (in-flight batching), ``executor``
(runs the bound model, one ``StepContext`` per call; packed prefill), ``cuda_decode`` (per-bucket
plans and CUDA graphs) with ``step_inputs`` (a bucket's static inputs, one staged copy per step),
``engine`` (requests + steps), ``model_runner`` (``ModelRunner.generate``), ``a3_assembly`` +
``chunk_store`` (A3's fused prefill, the chunk KV store and the completion method's prefix store).
"""
from macattn.runtime.config import RuntimeConfig
from macattn.runtime.engine import LLMEngine, StepOutput
from macattn.runtime.engine_dir import read_engine_dir, write_engine_dir
from macattn.runtime.model_runner import ModelRunner
from macattn.runtime.sampling import SamplingConfig
from macattn.runtime.slots import SlotStates, TensorSlotState

__all__ = ["RuntimeConfig", "LLMEngine", "StepOutput", "ModelRunner", "SamplingConfig", "SlotStates",
           "TensorSlotState", "read_engine_dir", "write_engine_dir"]
