"""Isolation under in-flight batching: every stream equals its solo run, reused slots carry
nothing over, bad requests fail alone."""
import pytest
import torch
from _tiny import MAC, prompts, tiny_model

from macattn.runtime import LLMEngine, RuntimeConfig

NEW = 8


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(tiny_model(), MAC, RuntimeConfig(max_batch_size=16, block_size=8))


def _solo(engine, ids, n=NEW):
    rid = engine.add_request(ids, max_new_tokens=n)
    engine.run_to_completion()
    return engine.pop_finished(rid).output


def test_64_staggered_streams_equal_their_solo_outputs(engine):
    ps = prompts(64, seed=42)
    solo = [_solo(engine, p) for p in ps]
    diag = engine.mac_state.diagnostics
    diag.reset()
    pending = list(enumerate(ps))
    rids, widest, lengths_mixed = {}, 0, False
    while pending or engine.has_unfinished():
        for _ in range(3):                       # 3 arrivals per step: requests join mid-flight
            if pending:
                i, p = pending.pop(0)
                rids[engine.add_request(p, max_new_tokens=NEW)] = i
        batch = engine.scheduler.decode_batch()
        widest = max(widest, len(batch))
        lengths_mixed |= len({s.num_tokens for s in batch}) > 1
        engine.step()
    assert widest == 16 and lengths_mixed
    assert diag.hits.sum() > 0, "no MAC hit: the test would not exercise ring reuse"
    for rid, i in rids.items():
        assert engine.pop_finished(rid).output == solo[i], f"stream {i} differs from its solo run"
    assert engine.slot_states.num_free == 16 and not engine.mac_state.in_use.any()


def test_reused_slot_never_matches_previous_request(engine):
    p = prompts(1, seed=7, lo=40, hi=40)[0]
    diag = engine.mac_state.diagnostics
    diag.reset()
    rid = engine.add_request(p, max_new_tokens=NEW)
    while len(engine.requests[rid].output) < NEW - 1:
        engine.step()
    seq = engine.requests[rid]
    slot = seq.slot
    st = engine.mac_state
    snap = [tuple(t[slot].clone() for t in st.layer(layer)) for layer in range(st.num_layers)]
    assert all((pos >= 0).any() for _, _, _, pos in snap)
    engine.run_to_completion()
    first = engine.pop_finished(rid).output
    assert diag.hits.sum() > 0
    for layer in range(st.num_layers):             # release emptied every row of the slot (the values stay, unread)
        q, o, lse, pos = (t[slot] for t in st.layer(layer))
        assert (pos == -1).all() and torch.isneginf(lse).all()
    # poison: put the finished request's entries back with NaN summaries, into the slot the
    # next request will get. The same prompt gives identical queries (distance 0): any match
    # against them would turn the output into NaN garbage.
    for layer, (q, o, lse, pos) in enumerate(snap):
        rq, ro, rl, rp = st.layer(layer)
        rq[slot], rp[slot], rl[slot] = q, pos, lse
        ro[slot] = float("nan")
    assert engine.slot_states._free[-1] == slot     # the next acquire hands out this slot
    diag.reset()
    rid2 = engine.add_request(p, max_new_tokens=NEW)
    engine.step()
    assert engine.requests[rid2].slot == slot
    engine.run_to_completion()
    assert engine.pop_finished(rid2).output == first
    assert diag.hits.sum() > 0                       # it did hit: on its own entries only
    assert all(torch.isfinite(o[slot]).all() for o in st.oring)


BAD = [
    (dict(input_ids=torch.tensor([], dtype=torch.int64)), ValueError, "input_ids is empty"),
    (dict(input_ids=torch.arange(256) % 256), ValueError, "input_ids too long"),
    (dict(input_ids=torch.ones(30)), TypeError, "input_ids must be an integer tensor"),
    (dict(input_ids=torch.full((30,), 300)), ValueError, "input_ids must lie in"),
    (dict(input_ids=[3, True, 4]), TypeError, "input_ids must be a sequence of ints"),
    (dict(input_ids=(3, 4.0)), TypeError, "input_ids must be a sequence of ints"),
    (dict(input_ids=[3, -1]), ValueError, "input_ids must lie in"),
    (dict(input_ids=torch.ones(2, 30, dtype=torch.int64)), ValueError, "input_ids must be 1-D"),
    (dict(max_new_tokens=0), ValueError, "max_new_tokens"),
    (dict(max_new_tokens=-3), ValueError, "max_new_tokens"),
    (dict(max_new_tokens=2.0), TypeError, "max_new_tokens"),
    (dict(temperature=0.0), ValueError, "temperature"),
    (dict(temperature=float("nan")), ValueError, "temperature"),
    (dict(temperature="hot"), TypeError, "temperature"),
    (dict(top_k=-1), ValueError, "top_k"),
    (dict(top_k=2.5), TypeError, "top_k"),
    (dict(top_p=1.5), ValueError, "top_p"),
    (dict(top_p=-0.1), ValueError, "top_p"),
    (dict(end_id="eos"), TypeError, "end_id"),
]


def test_bad_requests_fail_alone(engine):
    good = prompts(7, seed=99)
    solo = [_solo(engine, p) for p in good]
    rids = [engine.add_request(p, max_new_tokens=NEW) for p in good[:3]]
    engine.step()
    engine.step()                                    # in flight when the bad ones arrive
    for i, (kwargs, exc, msg) in enumerate(BAD):
        kw = {"input_ids": torch.arange(30), "max_new_tokens": 4, **kwargs}
        with pytest.raises(exc, match=msg):
            engine.add_request(kw.pop("input_ids"), **kw)
        if i % 5 == 0:                               # more good ones join between the bad ones
            rids.append(engine.add_request(good[len(rids)], max_new_tokens=NEW))
            engine.step()
    engine.run_to_completion()
    assert [engine.pop_finished(r).output for r in rids] == solo


def test_runner_rejects_a_bad_batch_before_queueing_anything():
    from macattn.runtime import ModelRunner

    runner = ModelRunner.from_hf(tiny_model(), MAC, max_batch_size=4)
    ps = prompts(3, seed=5)
    with pytest.raises(TypeError, match=r"batch_input_ids\[1\]: input_ids must be an integer tensor"):
        runner.generate([ps[0], ps[1].float(), ps[2]], max_new_tokens=4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        runner.generate(ps, max_new_tokens=0)
    with pytest.raises(ValueError, match="num_beams"):
        runner.generate(ps, max_new_tokens=2, num_beams=4)
    with pytest.raises(ValueError, match=r"stop_words_list must hold one list of words per request \(3\), got 1"):
        runner.generate(ps, max_new_tokens=2, stop_words_list=[[1]])
    with pytest.raises(TypeError, match="unexpected keyword argument 'colour'"):
        runner.generate(ps, max_new_tokens=2, colour=1)
    assert not runner.engine.has_unfinished()
    assert runner.generate(ps, max_new_tokens=4).shape[0] == 3
