"""The sampler's processors inside the captured decode step (CUDA; not run on machines without a GPU):
penalties, min-p, logit bias, min-tokens bans and stop ids, forks and prompt log-probabilities give the
same tokens replayed as eager (one graph per sampler variant), and every request's tokens equal the
per-request reference (``_sampler_ref``) applied to the logits it was sampled from. Marked ``gpu``."""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

from macattn.methods.mac.config import MacConfig  # noqa: E402
from macattn.models.builtin import build_builtin_model  # noqa: E402
from macattn.runtime.config import RuntimeConfig  # noqa: E402
from macattn.runtime.engine import LLMEngine  # noqa: E402
from macattn.runtime.sampling import SamplingConfig  # noqa: E402

from _sampler_ref import reference_token  # noqa: E402

pytest.importorskip("triton")

MAC = MacConfig(window=16, band=4, tau=0.2)
SAMPLING = [SamplingConfig(max_new_tokens=12),
            SamplingConfig(max_new_tokens=12, repetition_penalty=1.3, random_seed=1),
            SamplingConfig(max_new_tokens=12, top_k=40, top_p=0.9, temperature=0.9, min_p=0.05, random_seed=2,
                           presence_penalty=0.8, frequency_penalty=0.4),
            SamplingConfig(max_new_tokens=12, logit_bias={5: 3.0, 9: -100.0}, random_seed=3),
            SamplingConfig(max_new_tokens=12, min_tokens=6, end_id=2, stop_token_ids=[7, 11], random_seed=4,
                           top_k=0, top_p=0.95),
            SamplingConfig(max_new_tokens=12, temperature=1.2, top_k=20, random_seed=5)]


def _prompts(n, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 2048, (int(torch.randint(20, 60, (1,), generator=g)),), generator=g) for _ in range(n)]


def _generate(graphs: bool, mac, *, n: int | None = None, overlap: bool | None = None):
    model = build_builtin_model("llama", seed=3).to("cuda", torch.bfloat16)
    eng = LLMEngine(model, mac, RuntimeConfig(max_batch_size=8, max_seq_len=512, device="cuda", use_cuda_graphs=graphs,
                                              async_scheduling=overlap))
    ps = _prompts(len(SAMPLING), seed=8)
    ids = []
    for p, sp in zip(ps, SAMPLING):
        got = eng.add_request(p, sp, n=n)
        ids += got if n is not None else [got]
    steps = {i: [] for i in ids}
    while eng.has_unfinished():
        for o in eng.step():
            steps[o.request_id].append((o.token, o.logits.float().cpu(), o.finish_reason))
    seqs = {i: eng.requests[i] for i in ids}
    return [eng.pop_finished(i).output for i in ids], steps, seqs, eng


@pytest.mark.parametrize("mac", [MAC, None], ids=["mac-on", "mac-off"])
def test_the_processors_in_the_graph_equal_eager_and_the_reference(mac):
    eager, *_ = _generate(False, mac)
    graph, steps, seqs, eng = _generate(True, mac)
    assert graph == eager
    keys = {k[0] for b in eng.executor.decoder.buckets.values() for k in b.graphs}
    assert any(k.penalize for k in keys) and any(k.bias for k in keys) and any(k.draw for k in keys)
    for rid, seq in seqs.items():
        out = []
        for j, (token, logits, reason) in enumerate(steps[rid]):
            want = reference_token(logits, seq.sampling, seq.seed, len(seq.prompt) + j, seq.prompt, out)
            if token is None:
                assert want == seq.sampling.end_id and reason == "end_id"
            else:
                assert token == want, (rid, j)
                out.append(token)


def test_forks_in_the_graph_equal_independent_requests():
    forked, *_ = _generate(True, MAC, n=2)
    alone, *_ = _generate(True, MAC)
    assert forked[0::2] == alone
    assert forked[1::2] != forked[0::2]


@pytest.mark.parametrize("mac", [MAC, None], ids=["mac-on", "mac-off"])
def test_async_scheduling_equals_serial_steps_on_the_gpu(mac):
    """The overlapped loop (the default on CUDA: each step replayed before the previous step's tokens are read,
    its pending tokens fed from the device) gives the serial loop's tokens, finish reasons and logits (within
    rounding: a request ending on a stop token still fills its row in the step after)."""
    serial, serial_steps, *_ = _generate(True, mac, overlap=False)
    overlapped, steps, _, eng = _generate(True, mac, overlap=True)
    assert eng.async_scheduling and overlapped == serial
    assert [len(v) for v in steps.values()] == [len(v) for v in serial_steps.values()]
    for a, b in zip(serial_steps.values(), steps.values()):
        for (ta, la, ra), (tb, lb, rb) in zip(a, b):
            assert (ta, ra) == (tb, rb) and torch.allclose(la, lb, atol=2e-2, rtol=0)
