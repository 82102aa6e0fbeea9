"""Prompt log-probabilities from the prefill (``SamplingConfig.prompt_logprobs = k``): per prompt position
the log-probability of the prompt token given its prefix and the top-k, from the packed prefill's logits
of that request's positions, equal a plain transformers forward's log-softmax of the same model (fp32 and
fp64, CPU) within 1e-4 — whole prompts, prompts chunked across engine steps under a token budget, with
other requests (with and without) packed in the same model calls, and for a method that keeps its own KV."""
from __future__ import annotations

import pytest
import torch

from macattn.runtime.config import RuntimeConfig
from macattn.runtime.engine import LLMEngine

from _tiny import MAC, prompts, tiny_model
from test_every_method import _exact_engine


def _reference(model, p: torch.Tensor) -> torch.Tensor:
    """``[L, V]`` log-softmax of a plain forward over the prompt (fp64 of the model's logits)."""
    with torch.no_grad():
        return torch.log_softmax(model(p[None]).logits[0].double(), -1)


def _check(entries, p: torch.Tensor, k: int, ref: torch.Tensor, tol: float) -> None:
    L = len(p)
    assert len(entries) == L and entries[0] is None
    for i in range(1, L):
        e, row, tok = entries[i], ref[i - 1], int(p[i])
        assert next(iter(e)) == tok                                     # the prompt token first
        assert abs(e[tok] - float(row[tok])) < tol, (i, e[tok], float(row[tok]))
        top = row.topk(k)
        assert list(e)[1:] == [t for t in top.indices.tolist() if t != tok][:len(e) - 1]
        assert set(e) == {tok, *top.indices.tolist()}
        for t, v in e.items():
            assert abs(v - float(row[t])) < tol


def _run(eng, ps, ks, *, staggered=True):
    """Requests (``prompt_logprobs = ks[i]``) arriving over the first steps; the prompt log-probabilities
    each got and the packed prefill calls' chunks ``(request id, start, end)``."""
    ids, got, calls = [], {}, []
    ex = eng.executor
    packed = ex._prefill_packed
    ex._prefill_packed = lambda chunks, *a: (calls.append([(c.seq.request_id, c.start, c.end) for c in chunks]),
                                             packed(chunks, *a))[1]
    pending = list(zip(ps, ks))
    while pending or eng.has_unfinished():
        if pending:
            p, k = pending.pop(0)
            ids.append(eng.add_request(p, max_new_tokens=3, prompt_logprobs=k))
            if staggered and len(pending) % 2:
                continue
        for o in eng.step():
            if o.prompt_logprobs is not None:
                assert o.request_id not in got
                got[o.request_id] = o.prompt_logprobs
            else:
                assert eng.requests[o.request_id].sampling.prompt_logprobs is None or o.request_id in got
    return ids, got, calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("budget", [None, 7, 16])
def test_prompt_logprobs_equal_a_transformers_forward(dtype, budget):
    ps = prompts(5, seed=31, lo=9, hi=40)
    ks = [3, None, 0, 5, None]
    eng = LLMEngine(tiny_model("llama", seed=8).to(dtype), MAC,
                    RuntimeConfig(max_batch_size=3, max_seq_len=128, max_num_batched_tokens=budget))
    ids, got, calls = _run(eng, ps, ks)
    plain = tiny_model("llama", seed=8).to(dtype)
    tol = 1e-4 if dtype == torch.float32 else 1e-9
    for rid, p, k in zip(ids, ps, ks):
        if k is None:
            assert rid not in got
            continue
        _check(got[rid], p, k, _reference(plain, p), tol)
    want = {rid for rid, k in zip(ids, ks) if k is not None}
    # whole prompts with and without log-probabilities packed in one call (under a budget below these prompts' lengths
    # none packs: a chunk that leaves part of its prompt is its step's first); with a budget, prompts split across calls
    packed = any(len(c) > 1 and {r for r, _, _ in c} & want and {r for r, _, _ in c} - want for c in calls)
    assert packed or budget is not None
    if budget is not None:
        assert any(r in want and start > 0 for c in calls for r, start, _ in c)
    # the same tokens as without prompt log-probabilities
    eng2 = LLMEngine(tiny_model("llama", seed=8).to(dtype), MAC,
                     RuntimeConfig(max_batch_size=3, max_seq_len=128, max_num_batched_tokens=budget))
    ids2, _, _ = _run(eng2, ps, [None] * 5)
    assert [eng.pop_finished(i).output for i in ids] == [eng2.pop_finished(i).output for i in ids2]


def test_prompt_logprobs_of_one_token_prompts_and_of_a_method_keeping_its_own_kv():
    eng = LLMEngine(tiny_model("llama", seed=8), MAC, RuntimeConfig(max_batch_size=2, max_seq_len=64))
    rid = eng.add_request([17], max_new_tokens=2, prompt_logprobs=2)
    first = eng.step()[0]
    assert first.prompt_logprobs == [None] and first.request_id == rid
    model = tiny_model("llama", seed=4)
    eng = _exact_engine("completion", model)
    assert not eng.executor.paged_kv
    ps = prompts(2, seed=3, lo=20, hi=30)
    ids = [eng.add_request(p, max_new_tokens=2, prompt_logprobs=4) for p in ps]
    got = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.prompt_logprobs is not None:
                got[o.request_id] = o.prompt_logprobs
    plain = tiny_model("llama", seed=4)
    for rid, p in zip(ids, ps):
        _check(got[rid], p, 4, _reference(plain, p), 1e-9)


def test_prompt_logprobs_are_refused_where_the_prompt_is_not_computed():
    eng = LLMEngine(tiny_model(), MAC, RuntimeConfig(max_batch_size=2, max_seq_len=64))
    seq = eng.make_request(prompts(1)[0], max_new_tokens=2, prompt_logprobs=1)
    seq.rag = object()                   # an A3 chunked prompt: its prefix is fused, not computed here
    with pytest.raises(ValueError, match="prompt_logprobs is not available"):
        eng.executor.prefill(seq)
