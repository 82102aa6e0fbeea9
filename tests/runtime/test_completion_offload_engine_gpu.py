"""The offloaded retrieval-completion engine method on the GPU (host pages pinned, the page selector, device
LRU, page gather and the shared split-K tail, whole step captured per batch bucket) against the same method on
the CPU (torch gather, fp64 tail) fed the same tokens, and graphs = eager; the quest GPU-resident method too."""
from __future__ import annotations

import pytest
import torch

from macattn.methods.completion.config import CompletionConfig
from macattn.methods.completion.offload import OffloadConfig
from macattn.runtime.config import RuntimeConfig
from macattn.runtime.engine import LLMEngine

from _completion import completion_maps
from _tiny import prompts, tiny_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
pytest.importorskip("triton")

CFG = CompletionConfig(n_sink=4, n_tail=8, top_k=16, feature_dim=16, hidden=32, selector="quest", page_size=16)


def _engine(method, device, dtype, graphs=False, prefetch="query"):
    model = tiny_model("llama", seed=2)
    maps = completion_maps(model, CFG)
    kw = {"maps": maps}
    if method == "completion_offload":
        kw["offload"] = OffloadConfig(hot_pages=4, max_generated=10, max_prefill=100, prefetch=prefetch)
    return LLMEngine(model.to(device=device, dtype=dtype), None,
                     RuntimeConfig(max_batch_size=3, max_seq_len=128, device=device, use_cuda_graphs=graphs),
                     method=method, method_config=CFG, method_kwargs=kw)


def _run(engine, ps, n=8):
    ids = [engine.add_request(p, max_new_tokens=n) for p in ps]
    logits = {i: [] for i in ids}
    while engine.has_unfinished():
        for out in engine.step():
            logits[out.request_id].append(out.logits.double().cpu())
    return [engine.pop_finished(i).output for i in ids], [torch.stack(logits[i]) for i in ids]


@pytest.mark.parametrize("method", ["completion_offload", "completion"])
def test_gpu_method_follows_the_cpu_method(method):
    ps = prompts(5, seed=13, lo=60, hi=95)                    # 5 requests through 3 slots
    want_t, want_l = _run(_engine(method, "cpu", torch.float64), ps)
    got_t, got_l = _run(_engine(method, "cuda", torch.float32, graphs=True), ps)
    for a, b, ta, tb in zip(got_l, want_l, got_t, want_t):   # up to the first differing token (then inputs differ)
        n = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), min(len(ta), len(tb)) - 1) + 1
        torch.testing.assert_close(a[:n], b[:n], rtol=2e-3, atol=2e-3)
    assert sum(x == y for x, y in zip(got_t, want_t)) >= 4


@pytest.mark.parametrize("prefetch", ["none", "query"])
def test_offloaded_graphs_equal_eager(prefetch):
    ps = prompts(4, seed=3, lo=60, hi=95)
    g_t, g_l = _run(_engine("completion_offload", "cuda", torch.float32, graphs=True, prefetch=prefetch), ps)
    e_t, e_l = _run(_engine("completion_offload", "cuda", torch.float32, graphs=False, prefetch=prefetch), ps)
    assert g_t == e_t
    for a, b in zip(g_l, e_l):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_prefix_reuse_on_the_gpu(tmp_path):
    """Persist from pinned host pages (asynchronous copies synchronised), reload, decode: = the prefilled run."""
    from macattn.runtime.chunk_store import model_fingerprint
    from macattn.runtime.chunk_store import prefix_store

    ps = prompts(2, seed=8, lo=60, hi=95)
    model_id = model_fingerprint(tiny_model("llama", seed=2))

    def run():
        eng = _engine("completion_offload", "cuda", torch.float32, graphs=True)
        eng.method.store = prefix_store(tmp_path, model_id=model_id)
        ids = [eng.add_request(p, max_new_tokens=6, reuse_prefix=True) for p in ps]
        eng.run_to_completion()
        return [eng.pop_finished(i).output for i in ids], eng.method.reused

    first, reused0 = run()
    again, reused1 = run()
    assert not reused0 and len(reused1) >= 1 and first == again
