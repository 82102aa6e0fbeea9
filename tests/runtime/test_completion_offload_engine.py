"""The offloaded retrieval-completion as an engine method (``completion_offload``) on the CPU: step by step the
same logits as the GPU-resident page-selector method (``completion`` with ``selector="quest"``); requests checked
against the tiers' limits before they are queued; persisted prefixes reused through the engine (a reused
prompt decodes as a prefilled one) and a tampered entry rejected; the LLM API (``kv_offload="host"``,
``generate(..., reuse_prefix=True)``) and the OpenAI server's ``reuse_prefix`` field."""
from __future__ import annotations

import pytest
import torch

from macattn.methods.completion.config import CompletionConfig
from macattn.methods.completion.offload import OffloadConfig
from macattn.runtime.chunk_store import model_fingerprint
from macattn.runtime.config import RuntimeConfig
from macattn.runtime.engine import LLMEngine
from macattn.runtime.chunk_store import prefix_store

from _completion import completion_maps
from _tiny import prompts, tiny_model

CFG = CompletionConfig(n_sink=4, n_tail=8, top_k=16, feature_dim=16, hidden=32, selector="quest", page_size=8)
OFF = OffloadConfig(hot_pages=4, max_generated=8, max_prefill=100, prefetch="none")


def _engine(method, *, slots=2, store=None, off=OFF, seed=2):
    model = tiny_model("llama", seed=seed)
    kw = {"maps": completion_maps(model, CFG)}
    if method == "completion_offload":
        kw.update(offload=off, store=store)
    else:
        kw.update(use_op=True)
    return LLMEngine(model, None, RuntimeConfig(max_batch_size=slots, max_seq_len=128), method=method,
                     method_config=CFG, method_kwargs=kw)


def _run(engine, ps, n, **kw):
    """Greedy generation of ``n`` tokens per prompt, all in flight together: (tokens, logits per step)."""
    ids = [engine.add_request(p, max_new_tokens=n, **kw) for p in ps]
    logits = {i: [] for i in ids}
    while engine.has_unfinished():
        for out in engine.step():
            logits[out.request_id].append(out.logits)
    return [engine.pop_finished(i).output for i in ids], [torch.stack(logits[i]) for i in ids]


def test_offloaded_method_decodes_as_the_resident_page_method():
    ps = prompts(3, seed=11, lo=60, hi=90)
    off_tokens, off_logits = _run(_engine("completion_offload"), ps, 6)
    res_tokens, res_logits = _run(_engine("completion"), ps, 6)
    assert off_tokens == res_tokens
    for a, b in zip(off_logits, res_logits):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)
    full = LLMEngine(tiny_model("llama", seed=2), None, RuntimeConfig(max_batch_size=2, max_seq_len=128), method="full")
    _, full_logits = _run(full, ps, 6)
    assert any((a[1:] - b[1:]).abs().max() > 1e-6 for a, b in zip(off_logits, full_logits))   # pages really chosen


def test_requests_are_checked_against_the_tiers():
    eng = _engine("completion_offload")
    with pytest.raises(ValueError, match="max_prefill=100"):
        eng.add_request(torch.zeros(101, dtype=torch.int64), max_new_tokens=2)
    with pytest.raises(ValueError, match="max_generated=8"):
        eng.add_request(torch.zeros(10, dtype=torch.int64), max_new_tokens=9)
    with pytest.raises(ValueError, match="prefix store"):
        eng.add_request(torch.zeros(10, dtype=torch.int64), max_new_tokens=2, reuse_prefix=True)
    assert not eng.has_unfinished()
    with pytest.raises(ValueError, match="host_budget_bytes"):
        _engine("completion_offload", off=OffloadConfig(hot_pages=4, max_prefill=100, host_budget_bytes=1000))


def test_persisted_prefix_is_reused_and_a_tampered_one_rejected(tmp_path):
    ps = prompts(2, seed=5, lo=60, hi=80)
    model_id = model_fingerprint(tiny_model("llama", seed=2))
    store = prefix_store(tmp_path, model_id=model_id)
    first = _engine("completion_offload", store=store)
    want, want_logits = _run(first, ps, 5, reuse_prefix=True)          # prefilled, then persisted
    assert len(list(tmp_path.glob("*.safetensors"))) == 2 and not first.method.reused
    again = _engine("completion_offload", store=prefix_store(tmp_path, model_id=model_id))
    got, got_logits = _run(again, ps, 5, reuse_prefix=True)            # loaded: no prompt through the model
    assert got == want
    for a, b in zip(got_logits, want_logits):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)
    assert len(again.method.reused) >= 1
    other = prefix_store(tmp_path, model_id="another-model")           # another model's id: a miss
    assert other.get(ps[0].tolist(), torch.float64) is None
    path = sorted(tmp_path.glob("*.safetensors"))[0]
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF                                                   # one payload byte flipped
    path.write_bytes(bytes(data))
    store = prefix_store(tmp_path, model_id=model_id)
    third = _engine("completion_offload", store=store, slots=1)
    with pytest.warns(RuntimeWarning, match="quarantined"):    # the bad entry: prefilled from scratch, not a failure
        got, _ = _run(third, ps, 5, reuse_prefix=True)
    assert got == want and store.quarantined == 1
    assert len(list(tmp_path.glob("*.safetensors"))) == 2        # and persisted again


def test_llm_api_and_openai_server_offload_with_prefix_reuse(tmp_path):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from macattn.apps.llm import LLM, SamplingParams
    from macattn.apps.serving.openai_server import build_app

    cfg = CompletionConfig(n_sink=4, n_tail=8, top_k=16, feature_dim=16, hidden=32, selector="quest", page_size=8)
    with pytest.raises(ValueError, match="kv_offload"):
        LLM("builtin", method="completion", kv_offload="disk")
    with pytest.raises(ValueError, match="kv_offload"):
        LLM("builtin", method="full", kv_offload="host")
    with pytest.raises(ValueError, match="device_budget_bytes"):
        LLM("builtin", method="completion", kv_offload="host", completion=cfg, max_seq_len=128,
            offload=OffloadConfig(hot_pages=4, max_prefill=100, max_generated=8, device_budget_bytes=1000))
    with LLM("builtin", method="completion", kv_offload="host", completion=cfg, max_batch_size=2, max_seq_len=128,
             offload=OffloadConfig(hot_pages=4, max_prefill=100, max_generated=8, prefetch="none"),
             prefix_store=tmp_path) as llm:
        prompt = list(range(5, 75))
        sp = SamplingParams(max_tokens=4, temperature=0)
        [a] = llm.generate(prompt, sp, reuse_prefix=True)
        [b] = llm.generate(prompt, sp, reuse_prefix=True)
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.metrics["prefix_reused"] == 0.0 and b.metrics["prefix_reused"] == 1.0
        assert 0.0 <= b.metrics["offload_hit_rate"] <= 1.0 and b.metrics["offload_bytes_fetched"] > 0
        client = TestClient(build_app(llm, "m"))
        r = client.post("/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 4, "temperature": 0,
                                                  "reuse_prefix": True})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == a.outputs[0].text
        r = client.post("/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 9})
        assert r.status_code == 400 and "max_generated" in r.json()["error"]["message"]
