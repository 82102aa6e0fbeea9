"""The two-stage match (``MacConfig(match="two_stage")``) in the runtime on the CPU: with every ring
entry a candidate it is the exact match (same tokens, same hits); the sketch ring equals the sketch
of the query ring for every live slot after prefill and decode steps (the append keeps it); released
slots are empty."""
from __future__ import annotations

from dataclasses import replace

import torch

from macattn.methods.mac.match_sketch import sketch
from macattn.runtime.config import RuntimeConfig
from macattn.runtime.engine import LLMEngine

from _tiny import MAC, prompts, tiny_model


def _engine(mac, max_batch=3) -> LLMEngine:
    return LLMEngine(tiny_model("llama", seed=2), mac, RuntimeConfig(max_batch_size=max_batch, max_seq_len=128))


def _generate(eng, ps, new_tokens=10):
    ids = [eng.add_request(p, max_new_tokens=new_tokens) for p in ps]
    eng.run_to_completion()
    return [eng.pop_finished(i).output for i in ids]


def _sketch_ring_is_kept(eng) -> bool:
    st = eng.mac_state
    live = list(eng.slot_states.in_use)
    assert live
    for layer, sr in enumerate(st.sring):
        kind = st.config.for_layer(layer).match_sketch
        want = sketch(st.qring[layer][live], kind).to(sr.dtype)
        if not torch.equal(sr[live].float(), want.float()):
            return False
    return True


def test_all_candidates_is_the_exact_match():
    ps = prompts(4, seed=3)
    exact = _engine(MAC)
    two = _engine(replace(MAC, match="two_stage", match_candidates=16))      # K = 16: every entry a candidate
    assert _generate(two, ps) == _generate(exact, ps)
    assert torch.equal(two.mac_state.diagnostics.hits, exact.mac_state.diagnostics.hits)
    assert exact.mac_state.diagnostics.hits.sum() > 0


def test_sketch_ring_follows_the_query_ring_through_decode_and_reuse():
    for kind in ("fp8", "proj16"):
        eng = _engine(replace(MAC, match="two_stage", match_sketch=kind, match_candidates=2), max_batch=2)
        assert all(sr is not None for sr in eng.mac_state.sring)
        for p in prompts(3, seed=4):
            eng.add_request(p, max_new_tokens=6)
        for _ in range(5):
            eng.step()
            assert _sketch_ring_is_kept(eng), kind
        assert torch.count_nonzero(eng.mac_state.sring[0].float()) > 0
        eng.run_to_completion()
        assert eng.slot_states.in_use == ()
        for pos in eng.mac_state.ring_pos:      # every slot released: empty again (no entry has a position)
            assert (pos == -1).all()
    assert _engine(MAC).mac_state.sring == [None, None]     # the exact match keeps no sketch ring
