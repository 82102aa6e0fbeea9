"""Tensor parallelism on GPUs over NCCL (``runtime/tensor_parallel.py``): every rank's decode step as
CUDA graphs per batch bucket over its paged pool = TP = 1 on one GPU; a killed worker stops the group
within its timeout. Marked ``gpu``; the TP = 2 tests need two visible GPUs."""
from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from test_tensor_parallel import MAC, STEPS, _drive, _gone, _prompts, tp_model

from macattn.runtime import LLMEngine, ModelRunner, RuntimeConfig
from macattn.runtime.tensor_parallel import TensorParallelError

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 visible GPUs")


def _cuda(tp: int, **kw) -> RuntimeConfig:
    return RuntimeConfig(max_batch_size=2, block_size=8, device="cuda", use_cuda_graphs=True,
                         tensor_parallel_size=tp, **kw)


@two_gpus
@pytest.mark.parametrize("mac_on", [True, False], ids=["mac", "mac_off"])
@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_tp2_cuda_graphs_equal_tp1(family, mac_on):
    """fp32 weights; every rank captures its buckets' whole step (NCCL all-reduces and the LM head's
    gather inside the graph). Tokens identical over 64 steps, logits within fp32 reduction-order noise,
    MAC hit decisions identical."""
    mac = MAC if mac_on else None
    ref = _drive(LLMEngine(tp_model(family), mac, _cuda(1)), [(p, STEPS) for p in _prompts()])
    eng = LLMEngine(tp_model(family), mac, _cuda(2))
    try:
        assert eng.executor.local.decoder is not None and eng.executor.local.decoder.use_cuda_graphs
        got = _drive(eng, [(p, STEPS) for p in _prompts()])
    finally:
        eng.close()
    for b in range(2):
        assert got["tokens"][b] == ref["tokens"][b]
        assert (got["logits"][b].cpu() - ref["logits"][b].cpu()).abs().max() <= 1e-4


@two_gpus
def test_tp2_in_flight_batching_on_cuda_equals_tp1():
    ps = [p % 250 for p in _prompts()]
    ref = ModelRunner.from_hf(tp_model("llama"), MAC, runtime_config=_cuda(1)).generate(ps, max_new_tokens=24)
    runner = ModelRunner.from_hf(tp_model("llama"), MAC, runtime_config=_cuda(2, prefill_chunk=16))
    try:
        assert torch.equal(runner.generate(ps, max_new_tokens=24).cpu(), ref.cpu())
    finally:
        runner.engine.close()


@two_gpus
def test_killed_worker_stops_an_nccl_group_within_the_timeout():
    timeout = 60.0
    runner = ModelRunner.from_hf(tp_model("llama"), MAC, runtime_config=_cuda(2, tp_timeout_s=timeout))
    pids = [p.pid for p in runner.engine.executor.group.procs]
    gen = runner.generate(_prompts(), max_new_tokens=40, streaming=True)
    for _ in range(3):
        next(gen)
    os.kill(pids[0], signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(TensorParallelError, match=r"rank 1 .* exited with code -9"):
        for _ in gen:
            pass
    assert time.monotonic() - t0 < timeout + 15
    assert all(_gone(pid) for pid in pids)


def test_tp_larger_than_the_visible_gpus_is_refused():
    n = torch.cuda.device_count()
    with pytest.raises(ValueError, match=rf"tensor_parallel_size={n + 1} needs CUDA devices"):
        LLMEngine(tp_model("llama"), None, _cuda(n + 1))
