"""Tensor parallelism on GPUs over NCCL (``runtime/tensor_parallel/``): every rank's decode step as
CUDA graphs per batch bucket over its paged pool = TP = 1 on one GPU; a killed worker stops the group
within its timeout. Marked ``gpu``; the TP = 2 tests need two visible GPUs."""
from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from test_tensor_parallel import MAC, STEPS, _drive, _gone, _prompts, tp_model

from macattn.methods.mac.config import MacConfig
from macattn.models.checkpoint import builtin_checkpoint_available, heldout_text, load_builtin_checkpoint
from macattn.runtime import LLMEngine, ModelRunner, RuntimeConfig
from macattn.runtime.tensor_parallel import EXIT_WEDGED

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
    mac = MAC if mac_on else MacConfig(enabled=False)
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
@pytest.mark.skipif(not builtin_checkpoint_available(), reason="needs the built-in checkpoint")
@pytest.mark.parametrize("mac_on", [True, False], ids=["mac", "mac_off"])
def test_tp2_bf16_builtin_checkpoint_equals_tp1(mac_on):
    """The trained checkpoint in bf16 (6 / 2 heads: 3 / 1 per rank), two 512-token held-out prompts, 64
    greedy steps under CUDA graphs, against the TP = 1 run. The all-reduce sums two bf16 partial products
    where TP = 1 rounds once, so the runs differ by bf16 rounding; the bf16 logits (0.125 apart at 16..32)
    tie exactly now and then, and a tie's argmax is decided by that rounding. So: the greedy tokens are
    identical up to the first step whose TP = 1 top-2 logits are tied within one bf16 step of their
    magnitude — the only place a divergence is allowed: TP = 1 scored TP = 2's token within one bf16 step
    of its best; after it the texts differ and are not compared. Logits up to there within 3 % of their scale with MAC
    off; with MAC on 10 %, because a rounding-level change can flip a head's match decision (a distance at
    the threshold), which changes that head's output by MAC's own approximation error. MAC on hits."""
    _, tok = load_builtin_checkpoint()
    text = heldout_text()
    ps = [tok(text[i * 40_000:i * 40_000 + 8_000]).input_ids[:512] for i in range(2)]
    mac = MacConfig(window=256, band=64, tau=0.45) if mac_on else MacConfig(enabled=False)

    def run(tp):
        eng = LLMEngine(load_builtin_checkpoint(dtype=torch.bfloat16)[0], mac, _cuda(tp))
        try:
            out = _drive(eng, [(p, STEPS) for p in ps])
            out["hit_rate"] = [eng.pop_finished(rid).metrics.get("mac_hit_rate", 0.0) for rid in list(eng.requests)]
            return out
        finally:
            eng.close()

    ref, got = run(1), run(2)
    for b in range(2):
        assert len(got["tokens"][b]) == STEPS
        a, c = ref["logits"][b].float().cpu(), got["logits"][b].float().cpu()
        div = next((i for i, (x, y) in enumerate(zip(got["tokens"][b], ref["tokens"][b])) if x != y), STEPS)
        if div < STEPS:
            best = a[div].max()
            ulp = 2.0 ** (torch.floor(torch.log2(best.abs())) - 7)               # bf16's step at that magnitude
            gap = float(best - a[div][got["tokens"][b][div]])
            print(f"request {b}: diverges at step {div}: TP = 1 scored TP = 2's token {gap} below its best "
                  f"(bf16 step {float(ulp)})")
            assert gap <= ulp, "a divergence where TP = 1's choice was not a bf16 tie"
        diff, scale = (c[:div + 1] - a[:div + 1]).abs().max().item(), a.abs().max().item()
        print(f"request {b}: identical for {div} of {STEPS} steps; max |logit TP2 - TP1| = {diff:.4f} (scale {scale:.1f})")
        assert diff <= (0.10 if mac_on else 0.03) * scale
    print(f"MAC hit rate TP1 {ref['hit_rate']} TP2 {got['hit_rate']}")
    assert (min(got["hit_rate"]) > 0) == mac_on


@two_gpus
def test_tp2_in_flight_batching_on_cuda_equals_tp1():
    ps = [p % 250 for p in _prompts()]
    ref = ModelRunner.from_hf(tp_model("llama"), MAC, runtime_config=_cuda(1)).generate(ps, max_new_tokens=24)
    runner = ModelRunner.from_hf(tp_model("llama"), MAC, runtime_config=_cuda(2, max_num_batched_tokens=16))
    try:
        assert torch.equal(runner.generate(ps, max_new_tokens=24).cpu(), ref.cpu())
    finally:
        runner.engine.close()


_KILLED_WORKER = textwrap.dedent("""
    import os, signal, sys, time
    sys.path.insert(0, {tests!r})
    from test_tensor_parallel import MAC, _prompts, tp_model
    from macattn.runtime import ModelRunner, RuntimeConfig
    from macattn.runtime.tensor_parallel import TensorParallelError

    if __name__ == "__main__":
        rc = RuntimeConfig(max_batch_size=2, block_size=8, device={device!r}, use_cuda_graphs={graphs},
                           tensor_parallel_size=2, tp_timeout_s={timeout})
        runner = ModelRunner.from_hf(tp_model("llama"), MAC, runtime_config=rc)
        pids = [p.pid for p in runner.engine.executor.group.procs]
        print(*pids, flush=True)
        gen = runner.generate(_prompts(), max_new_tokens=200, streaming=True)
        for _ in range(3):
            next(gen)
        os.kill(pids[0], signal.SIGKILL)
        try:
            for _ in gen:
                pass
        except TensorParallelError as exc:
            print("RAISED", exc, flush=True)
            sys.exit(0)
        print("NOT RAISED", flush=True)
        sys.exit(5)
""")


def killed_worker_script(*, timeout: float, device: str = "cuda", graphs: bool = True) -> str:
    """The killed-worker script (rank 0 in a child process); ``device="cpu"``: the same script over gloo, which
    ``test_tensor_parallel.py`` runs on the CPU (its names and except path are the GPU run's)."""
    return _KILLED_WORKER.format(tests=str(Path(__file__).parent), timeout=timeout, device=device, graphs=graphs)


@two_gpus
def test_killed_worker_ends_an_nccl_group_within_the_timeout(tmp_path):
    """A worker killed mid-generation (SIGKILL) with rank 0 inside the collectives: rank 0 either raises
    ``TensorParallelError`` naming rank 1 and its exit code, or — its stream wedged on the NCCL kernel that
    waits for the dead peer — prints the same and exits with ``EXIT_WEDGED``; within the group's timeout,
    no process left behind. Run in a child process: the second outcome ends the process."""
    timeout = 60.0
    script = tmp_path / "killed_worker.py"
    script.write_text(killed_worker_script(timeout=timeout))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.strip(), proc.stderr.read()[-3000:]
        pids = [int(x) for x in line.split()]
        t0 = time.monotonic()
        out, err = proc.communicate(timeout=timeout + 30)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    print(f"rank 0 ended with code {proc.returncode} after {took:.1f} s; {out.strip()[-300:]} {err.strip()[-300:]}")
    assert took < timeout + 15
    if proc.returncode == 0:
        assert re.search(r"RAISED .*rank 1 .* exited with code -9", out), out
    else:
        assert proc.returncode == EXIT_WEDGED, (proc.returncode, err[-3000:])
        assert re.search(r"rank 1 \(pid \d+\) exited with code -9.*exits with code 70", err), err[-3000:]
    assert all(_gone(pid) for pid in pids)


def test_tp_larger_than_the_visible_gpus_is_refused():
    n = torch.cuda.device_count()
    tp = 1 << n.bit_length()                       # the next power of two above n: a model of 2·tp heads takes it
    with pytest.raises(ValueError, match=rf"tensor_parallel_size={tp} needs CUDA devices"):
        LLMEngine(tp_model("llama", num_attention_heads=2 * tp, num_key_value_heads=2 * tp), None, _cuda(tp))
