"""Chunked prefill (``RuntimeConfig(max_num_batched_tokens=...)``): a prompt prefilled a chunk per engine step
beside the decodes gives the tokens and logits of the whole-prompt prefill (MAC, full attention,
FastMKA; fp64), running streams keep getting a token every step while a long prompt is prefilled,
and methods that build their KV their own way fall back to whole prompts."""
from __future__ import annotations

import pytest
import torch

from macattn.methods.mka.config import MkaConfig
from macattn.models.mka import patch_mka
from macattn.runtime.config import RuntimeConfig
from macattn.runtime.engine import LLMEngine

from _tiny import MAC, prompts, tiny_model


def _run(make_engine, ps, new_tokens=6):
    eng = make_engine()
    ids = [eng.add_request(p, max_new_tokens=new_tokens) for p in ps]
    logits = {i: [] for i in ids}
    while eng.has_unfinished():
        for o in eng.step():
            if o.logits is not None:
                logits[o.request_id].append(o.logits)
    return [eng.pop_finished(i).output for i in ids], [logits[i] for i in ids]


def _mka_model():
    model = tiny_model("llama", seed=2)
    patch_mka(model.float(), MkaConfig(summary="ema", ema_beta=0.8, seed=3)).set_gate(0.9)
    return model.double()


@pytest.mark.parametrize("case", ["mac", "full", "mka"])
@pytest.mark.parametrize("chunk", [5, 16])
def test_chunked_prefill_equals_whole_prefill(case, chunk):
    ps = prompts(4, seed=21, lo=30, hi=60)

    def engine(budget):
        model = _mka_model() if case == "mka" else tiny_model("llama", seed=2)
        kw = {"method": "full"} if case == "full" else {}
        return lambda: LLMEngine(model, None if case == "full" else MAC,
                                 RuntimeConfig(max_batch_size=2, max_seq_len=128, max_num_batched_tokens=budget), **kw)

    whole_tokens, whole_logits = _run(engine(None), ps)
    chunk_tokens, chunk_logits = _run(engine(chunk), ps)
    assert chunk_tokens == whole_tokens
    for a, b in zip(whole_logits, chunk_logits):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            torch.testing.assert_close(y, x, rtol=1e-9, atol=1e-9)


def test_running_streams_decode_while_a_long_prompt_is_prefilled():
    eng = LLMEngine(tiny_model("llama", seed=2), MAC, RuntimeConfig(max_batch_size=2, max_seq_len=256,
                                                                   max_num_batched_tokens=8))
    short = eng.add_request(prompts(1, seed=3, lo=6, hi=6)[0], max_new_tokens=30)
    eng.step()                                            # the short prompt: one chunk, its first token
    long = eng.add_request(prompts(1, seed=4, lo=100, hi=100)[0], max_new_tokens=4)
    steps_to_first = 0
    while True:
        out = {o.request_id: o for o in eng.step()}
        steps_to_first += 1
        assert short in out and out[short].token is not None      # a token every step, no stall
        if long in out:
            break
    assert steps_to_first == 15                           # ceil(100 / 7): the budget less the decode's token
    assert eng.requests[long].num_prefilled == 100


def test_methods_with_their_own_prefill_take_whole_prompts():
    from _completion import completion_maps
    from macattn.methods.completion.config import CompletionConfig

    cfg = CompletionConfig(n_sink=4, n_tail=8, top_k=3, feature_dim=16, hidden=32)
    model = tiny_model("llama", seed=2)
    maps = completion_maps(model, cfg)
    eng = LLMEngine(model, None, RuntimeConfig(max_batch_size=2, max_seq_len=128, max_num_batched_tokens=4),
                    method="completion", method_config=cfg, method_kwargs={"maps": maps, "use_op": False})
    rid = eng.add_request(prompts(1, seed=5)[0], max_new_tokens=3)
    assert any(o.request_id == rid and o.token is not None for o in eng.step())   # whole prompt in one step
    eng.run_to_completion()


@pytest.mark.parametrize("L,budget,parts", [(11, 5, [5, 5, 1]), (3, 2, [2, 1]), (12, 5, [5, 5, 2]), (7, 2, [2] * 3 + [1])])
def test_chunks_fill_the_budget(L, budget, parts):
    """A lone request's prompt is cut into chunks of exactly the budget (the last takes the rest; a
    one-token chunk is a prefill under the packed plan, not a decode); the first token comes with the last."""
    eng = LLMEngine(tiny_model("llama", seed=2), MAC, RuntimeConfig(max_batch_size=1, max_seq_len=64,
                                                                   max_num_batched_tokens=budget))
    rid = eng.add_request(prompts(1, seed=6, lo=L, hi=L)[0], max_new_tokens=2)
    got = []
    while not eng.requests[rid].output:
        before = eng.requests[rid].num_prefilled
        out = eng.step()
        got.append(eng.requests[rid].num_prefilled - before)
        assert bool(out) == (eng.requests[rid].num_prefilled == L)
    assert got == parts


def test_max_num_batched_tokens_is_validated():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        RuntimeConfig(max_num_batched_tokens=0)
    with pytest.raises(ValueError, match="max_num_batched_tokens must be > max_batch_size=4"):
        RuntimeConfig(max_batch_size=4, max_num_batched_tokens=4)


@pytest.mark.parametrize("chunk", [5, 16, 40])
def test_chunked_ring_equals_the_whole_prompts_ring_in_a_reused_slot(chunk):
    """MAC seeds only the chunks that hold the prompt's last ``window`` positions (earlier chunks' ring
    columns are all overwritten): after a chunked prefill into a slot another request used, the ring row
    (queries, summaries, log-sum-exps: to fp32 rounding; positions: exactly) equals a whole-prompt prefill's."""
    def ring_after(budget):
        eng = LLMEngine(tiny_model("llama", seed=2), MAC,
                        RuntimeConfig(max_batch_size=1, max_seq_len=128, max_num_batched_tokens=budget))
        first = eng.add_request(prompts(1, seed=5, lo=50, hi=50)[0], max_new_tokens=3)
        while eng.has_unfinished():
            eng.step()
        eng.pop_finished(first)
        rid = eng.add_request(prompts(1, seed=6, lo=57, hi=57)[0], max_new_tokens=2)
        while not any(o.request_id == rid for o in eng.step()):
            pass
        state, slot = eng.executor.method.state, eng.requests[rid].slot
        return [[t[slot].clone() for t in state.layer(layer)] for layer in range(eng.executor.num_layers)]

    whole, chunked = ring_after(None), ring_after(chunk)
    for a, b in zip(whole, chunked):
        assert torch.equal(a[-1], b[-1])                  # the positions each column holds
        for x, y in zip(a[:-1], b[:-1]):
            torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-5)
