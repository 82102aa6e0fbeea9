"""Packed prefill on CUDA with MAC's fresh-segment split (``seeding.fresh_split_attention``): the tiny model in bf16
through the runtime's packed calls (piecewise prefill graphs on) gives the logits and rings of the unsplit path (the
split forced off), within bf16 rounding, over calls mixing fresh prompts at the split's edges (``L = K + b``,
``L = K + b - 1``, within the window, longer) with a prompt prefilled in two chunks (a fresh first chunk whose ring
tail straddles the next, then a continued chunk). Marked ``gpu``."""
from __future__ import annotations

import pytest
import torch

from macattn.methods.mac import backend
from macattn.runtime.config import RuntimeConfig
from macattn.runtime.engine import LLMEngine
from macattn.runtime.sequence import PrefillChunk

from _tiny import MAC, TINY, prompts, tiny_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

K, B = MAC.window, MAC.band
LENGTHS = [40, K + B, K + B - 1, K - 4, 50]
# per call (request, start, end); request 0 in two chunks: its first keeps 1 ring position (40 - K = 24 < 25)
CALLS = [[(0, 0, 25), (1, 0, K + B), (2, 0, K + B - 1)], [(0, 25, 40), (3, 0, K - 4), (4, 0, 50)]]
# fresh_split_attention's answers per call and layer: request 0's first chunk, 1, 2 | 3, 4 (not the continued chunk)
SPLITS = [[True, True, False], [False, True]]


def _prefill(monkeypatch, split: bool):
    """Logits of every call's chunks, MAC's rings after both calls, and whether each fresh call split."""
    eng = LLMEngine(tiny_model("llama", seed=4).to(torch.bfloat16), MAC,
                    RuntimeConfig(max_batch_size=len(LENGTHS), max_seq_len=128, device="cuda", use_cuda_graphs=True))
    seqs = [eng.make_request(p, max_new_tokens=2) for p in prompts_of(LENGTHS)]
    for s in seqs:
        eng.submit(s)
    assert len(eng.scheduler.admit()) == len(seqs)
    real, taken = backend.fresh_split_attention, []

    def spy(*args, **kw):
        got = real(*args, **kw) if split else None
        taken.append(got is not None)
        return got

    with monkeypatch.context() as m:
        m.setattr(backend, "fresh_split_attention", spy)
        logits = [eng.executor.prefill_chunks([PrefillChunk(seqs[r], a, b) for r, a, b in call]) for call in CALLS]
    st = eng.mac_state
    rings = [t[layer][[s.slot for s in seqs]].clone() for t in (st.qring, st.oring, st.ring_lse, st.ring_pos)
             for layer in range(st.num_layers)]
    return logits, rings, taken


def prompts_of(lengths: list[int]) -> list[torch.Tensor]:
    return [prompts(1, seed=30 + n, lo=n, hi=n)[0] for n in lengths]


def test_packed_prefill_with_fresh_splits_equals_the_unsplit_path(monkeypatch):
    logits, rings, taken = _prefill(monkeypatch, split=True)
    old_logits, old_rings, _ = _prefill(monkeypatch, split=False)
    assert taken == [split for call in SPLITS for split in call * TINY["num_hidden_layers"]]
    for call, old_call in zip(logits, old_logits):
        for a, b in zip(call, old_call):
            assert (a is None) == (b is None)
            if a is not None:
                assert torch.isfinite(a).all()
                assert (a.float() - b.float()).norm() / b.float().norm() < 2e-2
    layers = len(rings) // 4
    for i, (a, b) in enumerate(zip(rings, old_rings)):
        if i >= 3 * layers or i % layers == 0:     # positions, and the first layer (same inputs): bit for bit
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        else:                                      # later layers see the first's outputs, rounded differently
            torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)
