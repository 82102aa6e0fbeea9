"""MAC for TensorRT-LLM's PyTorch backend (the only TensorRT-LLM path on its main branch).

Pure, importable without ``tensorrt_llm`` and tested against our engine's data: ``plan_inputs`` (metadata ->
``MacDecodePlan`` inputs: positions, slots, page tables, KV lengths; paged-pool views; RoPE of the pre-RoPE
query) and ``ring_slots`` (ring slot per request id). ``backend`` defines the subclasses of upstream types
only when ``tensorrt_llm`` imports (``backend.load()``); written against upstream sources, **never run**.
"""
