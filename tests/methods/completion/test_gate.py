"""The per-layer completion gate (issue 40): its file's round trip through ``CompletionConfig`` (with the calibrated
mass ``log_mass``), the equal-cost Top-k of a gated-off layer, and the gate honoured by the resident op, the page op
and the offloaded decode — each equal to the fp64 reference with the completion term masked in the gated-off layers
and ``log φ_q + log_mass`` in the others."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from macattn.methods.base import ModelDims, StepContext
from macattn.methods.completion import ops  # noqa: F401  (defines the torch ops)
from macattn.methods.completion.backend import CompletionAttention
from macattn.methods.completion.config import CompletionConfig
from macattn.methods.completion.feature_maps import CompletionFeatureMaps, FeatureMapSpec
from macattn.methods.completion.gate import CompletionGate, gated_log_phi_q
from macattn.methods.completion.reference import (budget_top_k, build_completion_cache, equal_cost_top_k,
                                                  hybrid_decode_step, layer_top_k, page_retrieval_completion_step,
                                                  partition, retrieval_completion_step)

from offload_case import admit, make_problem, step_inputs


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


def test_gate_file_round_trip(tmp_path):
    gate = CompletionGate((True, False, True), gen_len=16, tuned_for={"budget": 0.02})
    path = gate.save(tmp_path / "sub" / "gate.json")
    back = CompletionGate.load(path)
    assert back == gate and back.tuned_for == gate.tuned_for
    assert CompletionConfig(gate=str(path)).gate == gate == CompletionConfig(gate=path).gate
    assert CompletionConfig(gate=gate) == CompletionConfig(gate=str(path))
    assert json.loads(path.read_text())["layers"] == [True, False, True]
    assert "log_mass" not in json.loads(path.read_text()) and back.log_mass is None


def test_gate_file_round_trip_with_the_calibrated_mass(tmp_path):
    gate = CompletionGate((True, False), gen_len=8, log_mass=[[-1.5, 0.25, -3], [0.0, 0.0, 0.0]],
                          tuned_for={"budget": 0.01})
    assert gate.log_mass == ((-1.5, 0.25, -3.0), (0.0, 0.0, 0.0))
    back = CompletionConfig(gate=gate.save(tmp_path / "gate.json")).gate
    assert back == gate and back.log_mass == gate.log_mass
    assert json.loads((tmp_path / "gate.json").read_text())["log_mass"] == [[-1.5, 0.25, -3.0], [0.0, 0.0, 0.0]]
    gate.check_layers(2, 3)
    with pytest.raises(ValueError, match="3 heads per layer, the model 4"):
        gate.check_layers(2, 4)
    lm = gate.log_mass_tensors()
    assert lm[0].dtype == torch.float32 and lm[0].tolist() == [-1.5, 0.25, -3.0]
    assert CompletionGate((True,), gen_len=1).log_mass_tensors() == [None]


@pytest.mark.parametrize("log_mass", [[[0.0]], [[0.0], []], [[0.0], [1.0, 2.0]], [[0.0], [float("nan")]],
                                      [[0.0], [float("inf")]], [[0.0], [True]], "0"])
def test_bad_log_mass(log_mass):
    with pytest.raises(ValueError, match="log_mass"):
        CompletionGate((True, False), gen_len=1, log_mass=log_mass)


def test_gated_log_phi_q():
    lpq = torch.randn(2, 3, 5)
    assert gated_log_phi_q(lpq, True) is lpq
    assert bool((gated_log_phi_q(lpq, False) == float("-inf")).all())
    lm = torch.tensor([0.5, -1.0, 2.0])
    assert torch.equal(gated_log_phi_q(lpq, True, lm), lpq + lm[:, None])
    assert bool((gated_log_phi_q(lpq, False, lm) == float("-inf")).all())
    with pytest.raises(ValueError, match="log_mass must be"):
        gated_log_phi_q(lpq, True, torch.zeros(4))


@pytest.mark.parametrize("content,err,match", [
    ({"kind": "mac", "layers": [True], "gen_len": 1}, ValueError, "kind"),
    ({"kind": "completion_gate", "layers": [True]}, ValueError, "missing.*gen_len"),
    ({"kind": "completion_gate", "layers": [True], "gen_len": 1, "top_k": 3}, ValueError, "unknown.*top_k"),
    ({"kind": "completion_gate", "layers": [1, 0], "gen_len": 1}, ValueError, "layers"),
    ({"kind": "completion_gate", "layers": [], "gen_len": 1}, ValueError, "layers"),
    ({"kind": "completion_gate", "layers": [True], "gen_len": 0}, ValueError, "gen_len"),
])
def test_bad_gate_files_name_the_field(tmp_path, content, err, match):
    p = tmp_path / "g.json"
    p.write_text(json.dumps(content))
    with pytest.raises(err, match=match):
        CompletionConfig(gate=p)


def test_bad_gate_arguments():
    with pytest.raises(FileNotFoundError, match="macattn tune --completion"):
        CompletionConfig(gate="/nonexistent/gate.json")
    with pytest.raises(TypeError, match="gate"):
        CompletionConfig(gate=3)
    with pytest.raises(ValueError, match="layer must be < the gate's 2 layers"):
        layer_top_k(CompletionGate((True, False), gen_len=1), 2, 5, feature_dim=8, head_dim=16)


@pytest.mark.parametrize("beta", [0.01, 0.02, 0.05])
def test_gated_off_layer_spends_completion_cost_on_tokens(beta):
    """A gated-off layer's Top-k fits the budget Top-k alone gets (budget_top_k), never exceeding it, and loses
    at most the one token of rounding."""
    N, F, d, gen = 4096, 32, 64, 32
    kw = dict(anchors=36, feature_dim=F, head_dim=d, gen_len=gen, mid_len=N)
    kc, kt = budget_top_k(beta * N, completion=True, **kw), budget_top_k(beta * N, completion=False, **kw)
    k_off = equal_cost_top_k(kc, feature_dim=F, head_dim=d, gen_len=gen)
    assert kt - 1 <= k_off <= kt and k_off > kc
    gate = CompletionGate((True, False), gen_len=gen)
    assert layer_top_k(gate, 0, kc, feature_dim=F, head_dim=d) == (kc, True)
    assert layer_top_k(gate, 1, kc, feature_dim=F, head_dim=d) == (k_off, False)
    assert layer_top_k(None, 1, kc, feature_dim=F, head_dim=d) == (kc, True)
    tuned = CompletionGate((True, False), gen_len=gen, off_top_k=(kc, kt))    # what macattn tune writes
    assert layer_top_k(tuned, 1, kc, feature_dim=F, head_dim=d) == (kt, False)
    assert layer_top_k(tuned, 0, kc, feature_dim=F, head_dim=d) == (kc, True)
    other = equal_cost_top_k(kc + 1, feature_dim=F, head_dim=d, gen_len=gen)  # a Top-k it was not tuned at
    assert layer_top_k(tuned, 1, kc + 1, feature_dim=F, head_dim=d) == (other, False)


def test_the_gate_file_keeps_the_budgets_top_k_alone(tmp_path):
    gate = CompletionGate((False, True), gen_len=4, off_top_k=[63, 79])
    assert gate.off_top_k == (63, 79)
    back = CompletionConfig(gate=gate.save(tmp_path / "gate.json")).gate
    assert back == gate and back.off_top_k == (63, 79)
    assert json.loads((tmp_path / "gate.json").read_text())["off_top_k"] == [63, 79]
    assert CompletionGate((True,), gen_len=1).off_top_k is None


@pytest.mark.parametrize("off_top_k,match", [((5,), "pair"), ((5, 4), r"off_top_k\[1\]"), ((-1, 4), r"off_top_k\[0\]"),
                                             ((1.5, 4), r"off_top_k\[0\]"), ("57", "pair")])
def test_bad_off_top_k(off_top_k, match):
    with pytest.raises(ValueError, match=match):
        CompletionGate((True, False), gen_len=1, off_top_k=off_top_k)


# ----------------------------------------------------------------------------- the resident and page ops

L, HQ, HKV, D, F = 2, 4, 2, 16, 8
GATE = CompletionGate((True, False), gen_len=1, log_mass=((-1.5, 0.4, -3.0, 0.0), (2.0, 2.0, 2.0, 2.0)))


def _resident(selector: str, gate):
    """A ``CompletionAttention`` through the torch ops, with one request of 40 prompt tokens prefilled in slot 1
    and one decode step; returns ``(outputs per layer [1, Hq, d], the full K/V/q per layer, maps, config)``."""
    g = torch.Generator().manual_seed(3)
    dims = ModelDims(num_layers=L, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, hidden_size=HQ * D,
                     dtype=torch.float32, device=torch.device("cpu"))
    maps = CompletionFeatureMaps(FeatureMapSpec(L, HQ, HKV, D, feature_dim=F, hidden=16, seed=1))
    cfg = CompletionConfig(n_sink=2, n_tail=4, top_k=6, feature_dim=F, hidden=16, selector=selector, page_size=4,
                           gate=gate)
    m = CompletionAttention(cfg, dims, num_slots=2, maps=maps, max_seq_len=64, use_op=None)
    assert m.use_op
    T = 40
    slots = torch.tensor([1])
    outs, data = [], []
    for layer in range(L):
        k = torch.randn(1, HKV, T + 1, D, generator=g) * 1.5
        v = torch.randn(1, HKV, T + 1, D, generator=g)
        q = torch.randn(1, HQ, T + 1, D, generator=g) * 1.5
        m.prefill(None, layer, q[:, :, :T], k[:, :, :T], v[:, :, :T], None, None, D ** -0.5,
                  StepContext(slots=slots), None)
        out = m.decode(None, layer, q[:, :, T:], k[:, :, T:], v[:, :, T:], None, None, D ** -0.5,
                       StepContext(slots=slots, positions=torch.tensor([T])), None)
        outs.append(out[:, 0])
        data.append((q[:, :, T], k, v))
    return outs, data, maps, cfg


def _reference_inputs(maps, layer, q, k, v, cfg):
    T = k.shape[2]
    p = partition(T - 1, T - 1, n_sink=cfg.n_sink, n_tail=cfg.n_tail)
    with torch.no_grad():
        lpq = gated_log_phi_q(maps.log_phi_q(layer, q), True, torch.tensor(GATE.log_mass[layer]))
        lpk = maps.log_phi_k(layer, k[0].transpose(0, 1)).transpose(0, 1)[None]
    comp = build_completion_cache(lpk[:, :, p.mid_start:p.mid_end], v[:, :, p.mid_start:p.mid_end])
    return (q, k, v, torch.tensor([T]), torch.tensor([T - 1])), (lpq, lpk, *comp)


@pytest.mark.parametrize("selector", ["exact", "quest"])
def test_resident_and_page_ops_honour_the_gate(selector):
    """Layer 0 (on): the completion step at top_k with ``log φ_q + log_mass``; layer 1 (off): Top-k alone at the
    equal-cost Top-k, i.e. the fp64 reference with the completion term masked; both differ from the ungated
    step (layer 0 by its calibrated mass alone)."""
    outs, data, maps, cfg = _resident(selector, GATE)
    ungated, _, _, _ = _resident(selector, None)
    for layer, (q, k, v) in enumerate(data):
        base, comp = _reference_inputs(maps, layer, q, k, v, cfg)
        kl, on = layer_top_k(GATE, layer, cfg.top_k, feature_dim=F, head_dim=D)
        kw = dict(n_sink=cfg.n_sink, n_tail=cfg.n_tail, scale=D ** -0.5)
        raw = (maps.log_phi_q(layer, q).detach(), *comp[1:])      # the maps' own log φ_q: the ungated step
        if selector == "exact":
            ref = (retrieval_completion_step(*base, *comp, top_k=kl, **kw) if on else
                   hybrid_decode_step(*base, top_k=kl, **kw))
            full_comp = retrieval_completion_step(*base, *raw, top_k=cfg.top_k, **kw)
        else:
            pages = dict(page_size=cfg.page_size)
            ref = (page_retrieval_completion_step(*base, *comp, budget_pages=cfg.pages_for(kl), **pages, **kw) if on
                   else hybrid_decode_step(*base, top_k=cfg.pages_for(kl), **pages, **kw))
            full_comp = page_retrieval_completion_step(*base, *raw, budget_pages=cfg.pages_for(cfg.top_k), **pages,
                                                       **kw)
        assert _rel(outs[layer], ref) < 1e-6
        assert _rel(ungated[layer], full_comp) < 1e-6
        assert on == (layer == 0) and (kl > cfg.top_k) == (layer == 1)
        assert _rel(outs[layer], full_comp) > 1e-3     # the gate changed this layer's step


# ----------------------------------------------------------------------------- the offloaded decode


def test_offloaded_decode_honours_the_gate():
    t = make_problem(hot=6, seed=5)
    t["cfg"] = replace(t["cfg"], gate=GATE)
    cfg = t["cfg"]
    st, slots = admit(t)
    plans = [st.layer_plan(layer) for layer in range(t["L"])]
    assert plans[0] == (cfg.pages_for(cfg.top_k), True)
    assert plans[1][1] is False and plans[1][0] > plans[0][0]
    sl = torch.tensor(slots)
    for step in range(t["steps"]):
        for layer in range(t["L"]):
            q_all, lpq_all, lens, npf = step_inputs(t, st, slots, step, layer)
            pos = torch.tensor([n + step for n in t["prompts"]])
            rows = torch.arange(len(slots))
            st.append(layer, sl, pos, t["k"][layer][rows, :, pos], t["v"][layer][rows, :, pos])
            out = st.decode(layer, q_all, lpq_all, lens, npf, 0.25)[sl]
            B = len(t["prompts"])
            comp = [torch.stack([t["comp"][layer][i][j] for i in range(B)]) for j in range(3)]
            base = (t["q"][step][layer], t["k"][layer], t["v"][layer], torch.tensor([n + step + 1 for n in t["prompts"]]),
                    torch.tensor(list(t["prompts"])))
            kw = dict(n_sink=cfg.n_sink, n_tail=cfg.n_tail, page_size=cfg.page_size, scale=0.25)
            pages, on = plans[layer]
            lpq = gated_log_phi_q(t["lpq"][step][layer], True, torch.tensor(GATE.log_mass[layer]))
            completion = (lpq, t["lpk"][layer], *comp)
            ref = hybrid_decode_step(*base, top_k=pages, completion=completion if on else None, **kw)
            assert _rel(out, ref) < 1e-6
            if on:          # the calibrated mass changed the step
                raw = hybrid_decode_step(*base, top_k=pages, completion=(t["lpq"][step][layer], *completion[1:]), **kw)
                assert _rel(out, raw) > 1e-3
            else:
                ungated = hybrid_decode_step(*base, top_k=cfg.pages_for(cfg.top_k), completion=completion, **kw)
                assert _rel(out, ungated) > 1e-3


# ----------------------------------------------------------------------------- the surfaces


def test_every_surface_takes_the_gate_file(tmp_path):
    """``EngineArgs.completion_gate`` (so ``LLM`` and ``macattn serve --completion-gate``) reaches the engine's
    ``CompletionConfig`` through ``completion_method``, which reads the file (its calibrated mass included); other
    methods refuse it."""
    from macattn.runtime.completion_setup import completion_method
    from macattn.runtime.engine_args import EngineArgs
    from macattn.models.builtin import build_builtin_model

    model = build_builtin_model("llama", seed=0)
    L, H = model.config.num_hidden_layers, model.config.num_attention_heads
    gate = CompletionGate(tuple(i % 2 == 0 for i in range(L)), gen_len=4,
                          log_mass=[[-0.5 * i - 0.1 * h for h in range(H)] for i in range(L)])
    path = gate.save(tmp_path / "gate.json")
    name, cfg, _ = completion_method(model, "completion", gate=str(path))
    assert name == "completion" and cfg.gate == gate and cfg.gate.log_mass == gate.log_mass
    name, cfg, _ = completion_method(model, "completion", gate=path, kv_offload="host",
                                     completion=CompletionConfig(selector="quest"))
    assert name == "completion_offload" and cfg.gate == gate
    with pytest.raises(ValueError, match="gate is given twice"):
        completion_method(model, "completion", gate=path, completion=CompletionConfig(gate=gate))
    with pytest.raises(ValueError, match="gate is retrieval-completion's option"):
        completion_method(model, "mac", gate=path)
    assert EngineArgs(method="completion", completion_gate=path).completion_gate == str(path)
    with pytest.raises(ValueError, match="completion_gate is retrieval-completion's option"):
        EngineArgs(method="mac", completion_gate=str(path))
