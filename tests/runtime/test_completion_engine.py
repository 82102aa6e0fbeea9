"""Retrieval-completion as an engine method: per-request slot state, batched == solo, exactness, budget."""
from __future__ import annotations

import pytest
import torch

from macattn.methods.base import ModelDims, StepContext
from macattn.methods.completion.backend import CompletionAttention
from macattn.methods.completion.config import CompletionConfig
from macattn.methods.completion.reference import token_equivalents
from macattn.methods.completion.state import CompletionState
from macattn.models.attention import binding_of

from _completion import CompletionEngine
from _tiny import prompts, tiny_model

CFG = CompletionConfig(n_sink=4, n_tail=8, top_k=3, feature_dim=16, hidden=32)


def _decoder(cfg=CFG, slots=2, seed=2, **kw):
    return CompletionEngine(tiny_model("llama", seed=seed), cfg, slots=slots, **kw)


def _greedy_plain(model, p, n):
    ids, out, logits = p[None], [], []
    with torch.no_grad():
        for _ in range(n):
            lg = model(ids).logits[0, -1]
            logits.append(lg)
            out.append(int(lg.argmax()))
            ids = torch.cat([ids, torch.tensor([[out[-1]]])], 1)
    return out, logits


def test_batched_equals_solo_and_reused_slots_carry_nothing():
    ps = prompts(5, seed=5, lo=30, hi=60)
    dec = _decoder(slots=2)        # 5 requests through 2 slots: slots are reused
    batched = dec.generate(ps, max_new_tokens=6)
    solo = [_decoder(slots=2).generate([p], max_new_tokens=6)[0] for p in ps]
    assert batched == solo
    assert all(dec.state.is_empty(s) for s in range(2)) and dec.state.num_free == 2


def test_reused_slot_sees_nothing_of_the_previous_request():
    long_p, short_p = prompts(2, seed=7, lo=50, hi=60)[0], prompts(2, seed=8, lo=20, hi=25)[1]
    dec = _decoder(slots=1)
    seq, _ = dec.admit(long_p)
    slot = seq.slot
    dec.decode([seq], [1])
    dec.release(seq)
    seq2, logits = dec.admit(short_p)
    assert seq2.slot == slot
    n = short_p.numel()
    for layer in range(dec.state.num_layers):   # rows past the new prompt are still zero
        assert not dec.state.k[layer][slot, :, n:].any() and not dec.state.log_phi_k[layer][slot, :, n:].any()
    step = dec.decode([seq2], [2])
    fresh = _decoder(slots=1)
    s, logits_f = fresh.admit(short_p)
    torch.testing.assert_close(logits, logits_f, rtol=0, atol=0)
    torch.testing.assert_close(step, fresh.decode([s], [2]), rtol=0, atol=0)


def test_top_k_covering_mid_is_the_plain_model_and_small_k_is_not():
    ps = prompts(2, seed=9, lo=40, hi=50)
    dec = _decoder(CompletionConfig(n_sink=4, n_tail=8, top_k=10_000, feature_dim=16, hidden=32))
    plain = tiny_model("llama", seed=2)
    for p in ps:
        want, want_logits = _greedy_plain(plain, p, 4)
        seq, lg = dec.admit(p)
        got = [int(lg.argmax())]
        torch.testing.assert_close(lg, want_logits[0], rtol=1e-9, atol=1e-9)
        for i in range(1, 4):
            lg = dec.decode([seq], [got[-1]])[0]
            torch.testing.assert_close(lg, want_logits[i], rtol=1e-9, atol=1e-9)
            got.append(int(lg.argmax()))
        dec.release(seq)
        assert got == want
    small = _decoder(CompletionConfig(n_sink=2, n_tail=2, top_k=1, feature_dim=16, hidden=32))
    seq, _ = small.admit(ps[0])
    lg = small.decode([seq], [5])[0]
    ref = _greedy_plain(plain, torch.cat([ps[0], torch.tensor([5])]), 1)[1][0]
    assert (lg - ref).abs().max() > 1e-6   # the approximation is in the path


def test_budget_report_matches_formula():
    cfg = CompletionConfig(n_sink=4, n_tail=8, top_k=3, feature_dim=16, hidden=32)
    dec = _decoder(cfg, slots=1)
    p = prompts(1, seed=11, lo=40, hi=40)[0]
    dec.generate([p], max_new_tokens=3)   # 2 decode steps at seq_len 41, 42
    rep = dec.method.budget_report()
    assert rep["steps"] == 2 and rep["requests"] == 1
    mid = 40 - 4 - 8
    want = [token_equivalents(exact_tokens=L - mid + 3, feature_dim=16, head_dim=16, gen_len=2, retrieved=3)["total"]
            for L in (41, 42)]
    assert rep["total"] == pytest.approx(sum(want) / 2)
    assert rep["fraction_of_full"] == pytest.approx(sum(want) / (41 + 42))
    worst = dec.method.budget_report(gen_len=1)
    assert worst["total"] > rep["total"] and worst["total_kv_worst"] >= worst["total"]


def test_pages_selector_and_budget_fraction_run():
    cfg = CompletionConfig(n_sink=2, n_tail=4, top_k=None, budget=0.2, selector="pages", page_size=4,
                           feature_dim=16, hidden=32)
    ps = prompts(3, seed=12, lo=25, hi=60)
    out = _decoder(cfg, slots=3).generate(ps, max_new_tokens=3)
    solo = [_decoder(cfg, slots=1).generate([p], max_new_tokens=3)[0] for p in ps]
    assert out == solo


def test_bad_inputs():
    dec = _decoder(slots=1)
    with pytest.raises(ValueError, match="too long"):
        dec.engine.add_request(torch.zeros(200, dtype=torch.int64), max_new_tokens=1)
    with pytest.raises(RuntimeError, match="under the engine"):   # no state rows given for the call
        with binding_of(dec.model).step(StepContext()):
            dec.model(input_ids=torch.zeros(1, 4, dtype=torch.int64), use_cache=False)
    dims = ModelDims.of(dec.model)
    with pytest.raises(TypeError, match="config"):
        CompletionAttention({"top_k": 3}, dims, num_slots=1, maps=dec.maps, max_seq_len=16)
    with pytest.raises(TypeError, match="maps"):
        CompletionAttention(CFG, dims, num_slots=1, maps=None, max_seq_len=16)
    with pytest.raises(ValueError, match="already patched"):
        CompletionEngine(dec.model, CFG, slots=1, maps=dec.maps)
    with pytest.raises(ValueError, match="num_slots"):
        CompletionState.allocate(num_layers=1, num_slots=0, num_kv_heads=1, max_seq_len=4, head_dim=2, feature_dim=2)


def test_through_the_ops_equals_the_reference_functions():
    """use_op=None routes prefill and decode through torch.ops.macattn.completion_cache /
    retrieval_completion (the reference on the CPU): same tokens, same logits."""
    ps = prompts(3, seed=11, lo=30, hi=60)
    ref = _decoder(slots=2)
    via_ops = _decoder(slots=2, use_op=None)
    assert via_ops.method.use_op and not ref.method.use_op
    assert ref.generate(ps, max_new_tokens=5) == via_ops.generate(ps, max_new_tokens=5)


def test_through_the_ops_with_a_budget_fraction_groups_rows_by_top_k():
    """A budget fraction gives each request its own Top-k: the op path calls the op once per distinct
    k over the state's rows in place (rows of other groups dropped) = the reference functions; such
    a decode reads host values, so it is not captured, while a fixed top_k through the op is."""
    cfg = CompletionConfig(n_sink=2, n_tail=4, top_k=None, budget=0.2, feature_dim=16, hidden=32)
    ps = prompts(3, seed=14, lo=25, hi=70)
    ops = _decoder(cfg, slots=3, use_op=None)
    assert ops.generate(ps, max_new_tokens=4) == _decoder(cfg, slots=3).generate(ps, max_new_tokens=4)
    assert len({e["retrieved"] for e in ops.method.step_log}) > 1, "the prompts should need different k"
    assert not ops.method.decode_capturable()
    assert _decoder(slots=1, use_op=None).method.decode_capturable()
    assert not _decoder(slots=1).method.decode_capturable()
