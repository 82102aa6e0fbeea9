"""FastMKA in the runtime: the session summary (``MkaState``) lives in the same per-request
slots as the MAC rings, is reset at admission and release, and no request sees another's."""
from __future__ import annotations

import torch

from macattn.methods.mka.config import MkaConfig
from macattn.models.mka import patch_mka
from macattn.runtime.config import RuntimeConfig
from macattn.runtime.engine import LLMEngine

from _tiny import MAC, prompts, tiny_model


def _engine(gate: float, max_batch: int) -> LLMEngine:
    model = tiny_model("llama", seed=2)
    ctx = patch_mka(model.float(), MkaConfig(summary="ema", ema_beta=0.8, seed=3))
    model.double()
    ctx.set_gate(gate)
    return LLMEngine(model, MAC, RuntimeConfig(max_batch_size=max_batch, max_seq_len=128))


def _generate(eng: LLMEngine, ps, new_tokens=8) -> list[list[int]]:
    ids = [eng.add_request(p, max_new_tokens=new_tokens) for p in ps]
    eng.run_to_completion()
    return [eng.pop_finished(i).output for i in ids]


def test_gate_zero_is_the_plain_model_through_the_runtime():
    ps = prompts(3, seed=4)
    plain = LLMEngine(tiny_model("llama", seed=2), MAC, RuntimeConfig(max_batch_size=3, max_seq_len=128))
    assert _generate(_engine(0.0, 3), ps) == _generate(plain, ps)


def test_session_summary_is_per_request_and_reset_on_reuse():
    ps = prompts(6, seed=5)
    eng = _engine(0.9, 2)                     # 6 requests through 2 slots: every slot is reused
    assert "fastmka" in eng.slot_states.states
    batched = _generate(eng, ps)
    solo = [_generate(_engine(0.9, 2), [p])[0] for p in ps]
    assert batched == solo
    state = eng.executor.mka.state
    for m, c in zip(state.mean, state.count):   # released slots are empty again
        assert torch.count_nonzero(m) == 0 and torch.count_nonzero(c) == 0
    assert batched != _generate(_engine(0.0, 2), ps), "gate 0.9 should change the outputs"
