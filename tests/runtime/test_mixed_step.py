"""The one-forward mixed step (``ModelExecutor.fuses`` / ``mixed_step``): a step's decode rows that attend in full
(``AttentionMethod.decode_in_full``) ride its prompt chunks' packed call as a decode tail (``core.ragged.DecodeTail``).

On the CPU (fp64 tiny model) the fused engine's outputs equal the engine's that runs every mixed step as two calls
(``fuses`` forced False), request by request — tokens, finish reasons, logits — for the full method through the
plain-torch tail and through the bucketed decode's plans (``CudaDecoder.tail``, eagerly over the paged reference),
for MAC off, and for MAC with ``min_context`` where requests cross it (steps with an engaged row run as two calls,
the others fused); serial and overlapped (async) loops alike; MAC's rings equal too. The GPU side (the split-KV
plans, the prefill graphs' tail ids) is in ``test_cuda_decode_gpu.py``.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from macattn.methods.base import ModelDims
from macattn.methods.full.config import FullConfig
from macattn.methods.mac.config import MacConfig
from macattn.runtime.config import RuntimeConfig
from macattn.runtime.engine import LLMEngine
from _paged_reference import attach_cpu_decoder
from _tiny import MAC, prompts, tiny_model
from test_async_scheduling import _run as run_requests
from test_engine_sampling import _PagedFull

KINDS = ("full", "bucketed", "mac_off", "mac_min_context")


def _engine(kind: str, fuse: bool, overlap: bool) -> LLMEngine:
    model = tiny_model("llama", seed=3)
    rc = RuntimeConfig(max_batch_size=3, max_seq_len=128, num_blocks=48, block_size=8, max_num_batched_tokens=13,
                       async_scheduling=overlap)
    if kind == "full":
        eng = LLMEngine(model, None, rc, method="full")
    elif kind == "bucketed":
        dims = ModelDims.of(model)
        eng = LLMEngine(model, None, rc, method=lambda n: _PagedFull(FullConfig(), dims, num_slots=n + 1))
        attach_cpu_decoder(eng)
    elif kind == "mac_off":
        eng = LLMEngine(model, replace(MAC, enabled=False), rc)
    else:            # prompts of 10..40 tokens and 8 new: some requests decode across 30
        eng = LLMEngine(model, replace(MAC, min_context=30), rc)
    ex = eng.executor
    ex.fused_steps = []
    if not fuse:
        ex.fuses = lambda decodes, chunks: False
    else:
        mixed = ex.mixed_step
        ex.mixed_step = lambda d, c, feed=None: (ex.fused_steps.append((len(d), len(c))), mixed(d, c, feed))[1]
    return eng


def _run(eng: LLMEngine) -> tuple[dict, list]:
    """Nine requests, two arriving per step (greedy, sampled, penalised, n = 2; ``test_async_scheduling._run``);
    per request its outputs, and MAC's ring positions of every running request after every step, in the layers
    with MAC on (the CPU reference's MAC-off layers append to rings nothing reads; the GPU's do not)."""
    ps = prompts(9, seed=5, lo=10, hi=40)
    kw = [dict(max_new_tokens=8), dict(max_new_tokens=6, temperature=0.9, top_p=0.9, random_seed=7),
          dict(max_new_tokens=8, repetition_penalty=1.4), dict(max_new_tokens=1), dict(max_new_tokens=5, n=2),
          dict(max_new_tokens=8, logit_bias={3: 2.0}), dict(max_new_tokens=7), dict(max_new_tokens=8),
          dict(max_new_tokens=3)]
    rings = []

    def record(eng, ids):
        if eng.mac_state is None:
            return
        index = {rid: (i, f) for i, rids in enumerate(ids) for f, rid in enumerate(rids)}
        on = [layer for layer in range(len(eng.mac_state.ring_pos)) if eng.method.config.for_layer(layer).enabled]
        rings.append({index[s.request_id]: torch.stack([eng.mac_state.ring_pos[layer][s.slot] for layer in on])
                      for s in eng.requests.values() if s.slot is not None and not s.finished and on})

    return run_requests(eng, list(zip(ps, kw)), each_step=record), rings


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "async"])
@pytest.mark.parametrize("kind", KINDS)
def test_fused_mixed_step_equals_two_calls(kind, overlap):
    fused_eng, apart_eng = _engine(kind, True, overlap), _engine(kind, False, overlap)
    fused, fused_rings = _run(fused_eng)
    apart, apart_rings = _run(apart_eng)
    steps = fused_eng.executor.fused_steps
    assert len(steps) >= 3 and all(d >= 1 and c >= 1 for d, c in steps)       # the decode rows rode prefill calls
    assert fused.keys() == apart.keys()
    for key in fused:
        assert [o[:3] for o in fused[key]] == [o[:3] for o in apart[key]], key
        for a, b in zip(fused[key], apart[key]):
            if a[3] is not None:
                torch.testing.assert_close(a[3], b[3], rtol=1e-9, atol=1e-9)
    assert len(fused_rings) == len(apart_rings)
    for a, b in zip(fused_rings, apart_rings):
        assert a.keys() == b.keys()
        for rid in a:
            assert torch.equal(a[rid], b[rid])
    if kind == "mac_min_context":     # some rings seeded or appended past 30, and those steps ran as two calls
        assert any((r >= 0).any() for step in fused_rings for r in step.values())
        assert len(steps) < sum(1 for _ in fused_rings)


def test_which_decode_rows_attend_in_full():
    """``decode_in_full``: MAC at ``min_context`` 0 never (every step matches); below ``min_context`` or with MAC off
    always; the full method always."""
    rc = RuntimeConfig(max_batch_size=3, max_seq_len=128)
    method = lambda mac, **kw: LLMEngine(tiny_model("llama", seed=3), mac, rc, **kw).method   # noqa: E731
    assert not method(MAC).decode_in_full([5])
    below = method(replace(MAC, min_context=30))
    assert below.decode_in_full([5, 29]) and not below.decode_in_full([5, 30])
    assert method(MacConfig(enabled=False)).decode_in_full([5, 100])
    assert method(None, method="full").decode_in_full([100])
