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


def test_decode_through_the_op_equals_the_modules():
    """``MkaContext.use_op`` (what the GPU executor turns on): a decode step's routing, summary and K/V come
    from ``route_fused_attention`` and the model's own K/V projections run over no tokens; the engine's
    tokens and logits are those of the modules' path (fp32: the CPU op is the same reference math)."""
    ps = prompts(5, seed=6)

    def run(use_op: bool):
        model = tiny_model("llama", seed=2).float()
        ctx = patch_mka(model, MkaConfig(summary="ema", ema_beta=0.8, seed=3))
        ctx.set_gate(0.9)
        ctx.use_op = use_op
        calls = []
        hook = model.model.layers[0].self_attn.k_proj.register_forward_hook(lambda m, a, o: calls.append(a[0].shape[1]))
        eng = LLMEngine(model, MAC, RuntimeConfig(max_batch_size=2, max_seq_len=128))
        ids = [eng.add_request(p, max_new_tokens=6) for p in ps]
        logits = {i: [] for i in ids}
        while eng.has_unfinished():
            for o in eng.step():
                assert o.error is None, o.error
                if o.logits is not None:
                    logits[o.request_id].append(o.logits)
        hook.remove()
        return [eng.pop_finished(i).output for i in ids], [torch.stack(logits[i]) for i in ids], calls

    mods, op = run(False), run(True)
    assert op[0] == mods[0]
    for a, b in zip(op[1], mods[1]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert 0 not in mods[2] and 0 in op[2]      # decode steps projected no token through k_proj
