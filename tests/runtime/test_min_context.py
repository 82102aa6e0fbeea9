"""``MacConfig.min_context`` in the runtime on the CPU (the reference ops): a decode step at ``m < C`` attends in
full — its logits are the MAC-off engine's — and leaves the request's rings as they were; a prompt shorter than
``C`` seeds no ring, whole or chunked, one segment at a time or as one varlen call; a request at ``m >= C`` from
its first step runs as with ``C = 0``; the diagnostics count the engaged steps only. The GPU plans' variants
are checked against the same rule in ``test_cuda_decode_gpu.py``."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from macattn.core import ragged
from macattn.core.ragged import PrefillSegment
from macattn.methods.mac.config import DEFAULT_CUDA_MIN_CONTEXT, MacConfig
from macattn.methods.mac.flags import add_mac_flags, mac_config_from_args
from macattn.methods.mac.seeding import packed_seeds, ring_positions
from macattn.runtime.config import RuntimeConfig
from macattn.runtime.engine import LLMEngine
from macattn.runtime.engine_args import EngineArgs

from _tiny import MAC, prompts, tiny_model

C = 50            # the prompts below are 20..60 tokens: some start below C, some cross it, some start past it
NEW = 16


class _Recording(LLMEngine):
    """Greedy, and keeps every request's ``(position, logits)`` per step."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.steps: dict[int, list[tuple[int, torch.Tensor]]] = {}

    def _append(self, seq, token, logits):
        self.steps.setdefault(seq.request_id, []).append((seq.num_tokens - 1, logits.clone()))
        return super()._append(seq, token, logits)


def _engine(mac: MacConfig, budget: int | None = None) -> _Recording:
    return _Recording(tiny_model("llama", seed=2), mac, RuntimeConfig(max_batch_size=3, max_seq_len=128,
                                                                      max_num_batched_tokens=budget,
                                                                      async_scheduling=False))


def _ring_positions_of(eng, slot: int) -> torch.Tensor:
    return torch.cat([eng.mac_state.ring_pos[layer][slot] for layer in range(len(eng.mac_state.ring_pos))])


def _run(eng, ps, check_rings: bool = False):
    ids = [eng.add_request(p, max_new_tokens=NEW) for p in ps]
    while eng.has_unfinished():
        eng.step()
        if not check_rings:
            continue
        for seq in eng.requests.values():
            if seq.slot is None or seq.finished or not seq.prefilled:
                continue
            pos = _ring_positions_of(eng, seq.slot)
            kept = pos[pos >= 0]
            decoded_past = seq.num_tokens - 2 >= C          # a decode step at m >= C has run
            if len(seq.prompt) >= C:      # seeded by its prefill
                assert kept.numel() > 0
            elif not decoded_past:        # nothing yet: no seeding, no append
                assert kept.numel() == 0, (seq.request_id, kept)
            else:                         # only the engaged steps' entries
                assert kept.min() >= C
    return ids


def _steps(eng, ids):
    return [eng.steps[i] for i in ids]


@pytest.mark.parametrize("match", ["exact", "two_stage"])
@pytest.mark.parametrize("budget", [None, 24], ids=["whole", "chunked"])
def test_steps_before_min_context_are_full_attention_and_leave_the_ring(budget, match):
    """Below ``C`` a step's logits are the MAC-off engine's and the request's ring stays empty; past ``C`` from its
    first step, the paper's. With ``two_stage`` the E4M3 sketch ring's columns are put back through their raw bytes
    (``core.indexing.storage_view``)."""
    ps = prompts(6, seed=8, lo=20, hi=60)           # 23, 24, 28, 47, 56, 57 tokens
    lengths = sorted(len(p) for p in ps)
    assert lengths[0] + NEW < C and lengths[-1] >= C and any(L < C <= L + NEW - 2 for L in lengths)
    runs = {}
    mac_ = MAC if match == "exact" else replace(MAC, match="two_stage", match_sketch="fp8", match_candidates=2)
    for name, mac in (("on", replace(mac_, min_context=C)), ("off", replace(mac_, enabled=False)), ("paper", mac_)):
        eng = _engine(mac, budget)
        runs[name] = (eng, _run(eng, ps, check_rings=name == "on"))
    (on, ids), (off, off_ids), (paper, paper_ids) = runs["on"], runs["off"], runs["paper"]
    engaged_steps = 0
    for p, got, full, mac in zip(ps, _steps(on, ids), _steps(off, off_ids), _steps(paper, paper_ids)):
        for (m, logits), (m_full, logits_full), (m_mac, logits_mac) in zip(got, full, mac):
            assert m == m_full == m_mac
            if m < C:          # the prefill's logits too (m = L - 1)
                torch.testing.assert_close(logits, logits_full, rtol=1e-9, atol=1e-9)
            elif len(p) >= C:  # engaged from its first step: the paper's MAC
                torch.testing.assert_close(logits, logits_mac, rtol=1e-9, atol=1e-9)
            engaged_steps += m >= C and m >= len(p)        # decode steps (m >= L) at m >= C
    diag = on.mac_state.diagnostics
    assert torch.all(diag.steps == engaged_steps) and engaged_steps > 0
    assert paper.mac_state.diagnostics.hits.sum() > 0
    # the check is not empty: without min_context the short prompts' steps are not full attention
    assert any(not torch.allclose(a[1], b[1], rtol=1e-9, atol=1e-9)
               for s_mac, s_full in zip(_steps(paper, paper_ids), _steps(off, off_ids))
               for a, b in zip(s_mac, s_full))


def test_a_packed_varlen_call_seeds_no_ring_for_prompts_below_min_context(monkeypatch):
    """The varlen path (forced on the CPU through its reference): the rings of the prompts of ``L >= C`` equal the
    paper's, the others stay empty."""
    monkeypatch.setattr(ragged, "varlen_applies", lambda query: True)
    ps = [p[:18] for p in prompts(2, seed=5, lo=30, hi=40)] + prompts(1, seed=6, lo=C, hi=C + 2)
    rings = {}
    for name, mac in (("on", replace(MAC, min_context=C, band=32)), ("paper", replace(MAC, band=32))):
        eng = _engine(mac)
        for p in ps:
            eng.add_request(p, max_new_tokens=4)
        eng.step()                                     # the three prompts in one packed call
        rings[name] = {len(seq.prompt): _ring_positions_of(eng, seq.slot) for seq in eng.requests.values()}
    for L, pos in rings["on"].items():
        if L < C:
            assert (pos == -1).all()
        else:
            assert torch.equal(pos, rings["paper"][L]) and (pos >= 0).any()


def test_ring_positions_and_packed_seeds_skip_short_prompts():
    fresh = PrefillSegment(0, 40, 0, slot=1)
    chunk = PrefillSegment(40, 16, 40, slot=2, prompt_end=60)      # positions 40..55 of a 60-token prompt
    assert ring_positions(fresh, 16) == 16 and ring_positions(fresh, 16, 40) == 16
    assert ring_positions(fresh, 16, 41) == 0
    assert ring_positions(chunk, 16, 60) == 12 and ring_positions(chunk, 16, 61) == 0
    seeds = packed_seeds((fresh, PrefillSegment(40, 60, 0, slot=2)), 16, 4, torch.device("cpu"), 50)
    assert seeds.slots.unique().tolist() == [2] and seeds.positions.tolist() == list(range(44, 60))
    assert packed_seeds((fresh,), 16, 4, torch.device("cpu"), 50) is None


def test_config_flags_and_engine_args(monkeypatch, tmp_path):
    with pytest.raises(ValueError, match="min_context must be"):
        MacConfig(min_context=-1)
    c = MacConfig(min_context=4096)
    assert c.engages(4096) and not c.engages(4095) and MacConfig().engages(0)
    assert MacConfig.from_dict(c.to_dict()) == c and "min_context" not in MacConfig().to_dict()
    with pytest.raises(ValueError, match="min_context=4096 .* accepted min_context=0"):
        c.require_from_first_step("the ONNX decode graph")
    MacConfig().require_from_first_step("the ONNX decode graph")
    import argparse

    p = argparse.ArgumentParser()
    add_mac_flags(p)
    assert mac_config_from_args(p.parse_args(["--min-context", "128", "--tau", "0.5"])) == MacConfig(min_context=128,
                                                                                                     tau=0.5)
    # EngineArgs: None is the measured crossover on CUDA, 0 elsewhere; a file's value or the flag wins
    assert EngineArgs().mac_config().min_context == 0
    monkeypatch.setattr(EngineArgs, "_on_cuda", property(lambda self: True))      # (graphs off: no GPU here)
    assert EngineArgs(use_cuda_graphs=False).mac_config().min_context == DEFAULT_CUDA_MIN_CONTEXT
    assert EngineArgs(use_cuda_graphs=False, mac_min_context=0).mac_config().min_context == 0
    assert EngineArgs(use_cuda_graphs=False, mac={"min_context": 512}).mac_config().min_context == 512
    assert EngineArgs(use_cuda_graphs=False, mac="off").mac_config() == MacConfig(enabled=False)
    with pytest.raises(ValueError, match="mac='off' takes no"):
        EngineArgs(use_cuda_graphs=False, mac="off", mac_min_context=5)


def test_the_graph_builds_and_the_evaluation_refuse_min_context(tmp_path):
    from macattn.builder.build import build_engine_dir
    from macattn.builder.trtllm_attention import mac_network_io

    with pytest.raises(ValueError, match="macattn build .* accepted min_context=0"):
        build_engine_dir("llama", tmp_path / "e", mac=MacConfig(min_context=64))
    from macattn.evaluation.methods import Mac

    with pytest.raises(ValueError, match="evaluation's MAC step"):
        Mac(MacConfig(min_context=64))
    with pytest.raises(ValueError, match="TensorRT-LLM attention swap"):
        mac_network_io(MacConfig(min_context=64), 2, max_batch=2, num_heads=4, head_dim=16, dtype=torch.float16)
