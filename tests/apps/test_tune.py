"""``macattn tune``: the per-layer search respects its error budget and writes a loadable MacConfig."""
import argparse
import json

import pytest
import torch

from macattn.methods.mac.config import MacConfig
from macattn.evaluation.harness import byte_encoder
from macattn.apps.tune import TuneSettings, calibration_prompts, measure, tune
from macattn.cli import build_parser

ENC = byte_encoder(2048)
HAY = torch.randint(300, 2048, (4096,), generator=torch.Generator().manual_seed(1)).tolist()


pytestmark = pytest.mark.usefixtures("one_thread")
BASE = MacConfig(window=64, band=16, tau=0.45)


def _small_model():
    from macattn.models.builtin import build_builtin_model

    return build_builtin_model("llama", seed=0, num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16)


@pytest.fixture(scope="module")
def setup():
    model = _small_model()
    settings = TuneSettings(taus=(0.0, 0.9), windows=(64,), bands=(0, 32), lengths=(256,), n=1, gen=3,
                            error_budget=0.05)
    return model, settings, calibration_prompts(model, settings, ENC, HAY, progress=False)


def test_fixed_budget_is_respected_and_file_loads(setup, tmp_path):
    model, settings, prompts = setup
    cfg, report = tune(model, settings, prompts, base=BASE, progress=False)
    cal = report["calibration"]["tuned"]
    for i in range(2):
        p = cfg.for_layer(i)
        assert cal["error"][i] <= settings.error_budget or not p.enabled
        assert (p.tau, p.window, p.band) in {(t, k, r) for t in settings.taus + (BASE.tau,)
                                             for k in settings.windows + (BASE.window,)
                                             for r in settings.bands + (BASE.band,)}
    # the chosen candidate per layer has the largest calibration skip among those within budget
    grid, stats = report["grid"], report["grid_stats"]
    best = max(s["skip"][0] for s in stats if s["error"][0] <= settings.error_budget)
    chosen = next(s for c, s in zip(grid, stats) if (c["tau"], c["window"], c["band"]) ==
                  (cfg.for_layer(0).tau, cfg.for_layer(0).window, cfg.for_layer(0).band))
    assert chosen["skip"][0] == best or len(report["rounds"]) > 1
    cfg.save(tmp_path / "per_layer.json")
    back = MacConfig.load(tmp_path / "per_layer.json")
    assert back == cfg and [back.for_layer(i) for i in range(2)] == [cfg.for_layer(i) for i in range(2)]
    # the measured skip of the written config is what the report says
    again = measure(model, back, prompts)
    assert again["skip"] == pytest.approx(cal["skip"]) and again["error"] == pytest.approx(cal["error"], rel=1e-4)


def test_tiny_budget_disables_every_layer(setup):
    model, settings, prompts = setup
    tight = TuneSettings(**{**settings.__dict__, "error_budget": 1e-12, "taus": (0.0,), "bands": (16,)})
    cfg, report = tune(model, tight, prompts, base=MacConfig(window=64, band=16, tau=0.0), progress=False)
    assert [cfg.for_layer(i).enabled for i in range(2)] == [False, False]
    assert max(report["calibration"]["tuned"]["error"]) < 1e-5 and report["calibration"]["tuned"]["mean_skip"] == 0


def test_default_budget_never_trades_error_and_reports_held_out(setup):
    model, settings, prompts = setup
    auto = TuneSettings(**{**settings.__dict__, "error_budget": None, "bands": (32,)})
    held = calibration_prompts(model, auto, ENC, HAY, held_out=True, progress=False)
    assert held[0][0].tolist() != prompts[0][0].tolist()
    cfg, report = tune(model, auto, prompts, base=BASE, held_out=held, progress=False)
    budget, cal = report["budget_per_layer"], report["calibration"]
    assert budget == cal["default"]["error"]
    for i in range(2):
        assert cal["tuned"]["error"][i] <= budget[i] * (1 + 1e-6) or cfg.for_layer(i) == BASE.for_layer(i)
    h = report["held_out"]
    assert h["tuned_beats_default"] == (h["tuned"]["mean_skip"] >= h["default"]["mean_skip"]
                                        and h["tuned"]["mean_error"] <= h["default"]["mean_error"])
    json.dumps(report)


def test_settings_validation():
    with pytest.raises(ValueError, match="error_budget"):
        TuneSettings(error_budget=0.0)
    with pytest.raises(ValueError, match="taus"):
        TuneSettings(taus=(1.0,))
    with pytest.raises(ValueError, match="windows"):
        TuneSettings(windows=())
    with pytest.raises(ValueError, match="gen"):
        TuneSettings(gen=1)


def test_cli_writes_config_and_report(tmp_path, monkeypatch):
    import macattn.evaluation.harness as harness

    monkeypatch.setattr(harness, "load_eval_model", lambda which, **kw: (_small_model(), ENC, HAY, [], "test"))
    p = build_parser()
    out, rep = tmp_path / "tune.json", tmp_path / "tune_report.json"
    a = p.parse_args(["tune", "--model", "random", "--taus", "0.0", "--windows", "64", "--bands", "16",
                      "--lengths", "200", "--n", "1", "--gen", "2", "--window", "64", "--band", "0", "--tau", "0.0",
                      "--out", str(out), "--report", str(rep)])
    assert a.func(a) == 0
    cfg = MacConfig.load(out)
    report = json.loads(rep.read_text())
    assert cfg.to_dict() == report["tuned_config"] and "tuned_beats_default" in report["held_out"]


def _meets(stats, target):
    return stats["greedy_agreement"] >= target - 1e-12


@pytest.mark.parametrize("target", [0.75, 1.0])
def test_agreement_search_picks_the_most_skip_meeting_the_target(setup, target):
    from macattn.apps.tune import tune_for_agreement

    model, settings, prompts = setup
    st = TuneSettings(**{**settings.__dict__, "error_budget": None, "taus": (0.0, 0.6), "bands": (0, 16), "n": 2,
                         "gen": 6, "min_agreement": target, "thresholds": "both", "levels": 3})
    cal = calibration_prompts(model, st, ENC, HAY, progress=False)
    held = calibration_prompts(model, st, ENC, HAY, held_out=True, progress=False)
    cfg, rep = tune_for_agreement(model, st, cal, held, base=BASE, progress=False)
    json.dumps(rep)
    front = rep["frontier"]
    kinds = {f["kind"] for f in front}
    assert {"uniform paper", "uniform calibrated"} <= kinds and len(front) >= 2 * 2 * 2
    assert len(rep["match_scales"]) == 2 and all(len(s) == 4 and min(s) > 0 for s in rep["match_scales"])
    chosen = front[rep["chosen"]]
    assert MacConfig.from_dict(chosen["config"]) == cfg and cfg.to_dict() == rep["tuned_config"]
    # re-measuring the written config on the held-out prompts reproduces the report
    again = measure(model, cfg, held)
    assert again["greedy_agreement"] == rep["held_out"]["greedy_agreement"]
    assert again["mean_skip"] == pytest.approx(rep["held_out"]["mean_skip"])
    if rep["target_met"]:
        assert _meets(again, target) and _meets(chosen["calibration"], target)
        # no verified config with more calibration skip met the target on both prompt sets
        for f in front:
            if "held_out" in f and f["calibration"]["mean_skip"] > chosen["calibration"]["mean_skip"]:
                assert not (_meets(f["calibration"], target) and _meets(f["held_out"], target))
    if target == 1.0:   # MAC off everywhere always reaches 1.0: a config meeting it is always found
        assert rep["target_met"]


def test_agreement_search_needs_held_out_and_a_target(setup):
    from macattn.apps.tune import tune_for_agreement

    model, settings, prompts = setup
    with pytest.raises(ValueError, match="min_agreement"):
        tune_for_agreement(model, settings, prompts, prompts)
    with pytest.raises(ValueError, match="held_out must hold"):
        tune_for_agreement(model, TuneSettings(min_agreement=0.9), prompts, [])
    with pytest.raises(ValueError, match=r"min_agreement must be a float in \(0.0, 1.0\]"):
        TuneSettings(min_agreement=1.5)
    with pytest.raises(ValueError, match="thresholds must be one of"):
        TuneSettings(thresholds="auto")


def test_cli_min_agreement_on_an_hf_checkpoint_dir(tmp_path):
    """``--model DIR``: any transformers checkpoint directory (here a tiny random LLaMA without a tokenizer);
    the written per-layer file runs in the runtime and through the MAC flags of generate / build."""
    from macattn.methods.mac.flags import add_mac_flags, mac_config_from_args
    from macattn.runtime import ModelRunner

    hf_dir = tmp_path / "hf"
    _small_model().save_pretrained(hf_dir)
    p = build_parser()
    out, rep = tmp_path / "per_layer.json", tmp_path / "report.json"
    a = p.parse_args(["tune", "--model", str(hf_dir), "--min-agreement", "0.99", "--max-error", "0.5",
                      "--thresholds", "both", "--taus", "0.0,0.6", "--windows", "64", "--bands", "0",
                      "--lengths", "200", "--n", "1", "--gen", "4", "--levels", "2", "--out", str(out),
                      "--report", str(rep)])
    assert a.func(a) == 0
    report = json.loads(rep.read_text())
    assert (tmp_path / "per_layer_frontier.png").stat().st_size > 0
    assert report["settings"]["error_budget"] == 0.5 and report["haystack"] == "haystack: uniform random token ids"
    cfg = MacConfig.load(out)
    assert cfg.to_dict() == report["tuned_config"]
    if report["target_met"]:
        assert report["held_out"]["greedy_agreement"] >= 0.99 and report["held_out"]["max_error"] <= 0.5
    flags = argparse.ArgumentParser()
    add_mac_flags(flags)
    assert mac_config_from_args(flags.parse_args(["--per-layer", str(out)])) == cfg
    ids = torch.randint(0, 2048, (40,), generator=torch.Generator().manual_seed(2))
    toks = ModelRunner.from_hf(_small_model(), cfg, max_batch_size=1).generate([ids], max_new_tokens=3)
    assert toks.shape[-1] >= 43


def test_a_tuned_file_reaches_the_openai_server_and_the_llm_api(tmp_path):
    from macattn.apps.llm import LLM
    from macattn.cli import _engine_args, build_parser

    cfg = MacConfig(tau=0.6, window=64, band=16).with_match_scales([[1.5]] * 8).with_overrides({3: {"tau": 0.9}})
    cfg.save(tmp_path / "per_layer.json")
    args = build_parser().parse_args(["serve", "--model", "builtin", "--per-layer", str(tmp_path / "per_layer.json")])
    kw = {k: v for k, v in vars(_engine_args(args)).items() if k != "model"}
    with LLM("builtin", **kw) as llm:
        assert llm.engine.method.config == cfg
        [out] = llm.generate([5, 6, 7, 8] * 20)
        assert out.outputs[0].token_ids
    bad = build_parser().parse_args(["serve", "--model", "builtin", "--no-mac", "--per-layer", "x.json"])
    with pytest.raises(ValueError, match="at most one of --no-mac and --mac / --per-layer"):
        _engine_args(bad)


def test_a_calibration_tie_turns_the_term_off_layer_by_layer(monkeypatch):
    """The agreement check keeps a gate only where the gated model beats Top-k alone on the calibration prompts: on
    a tie every layer the error kept is turned off, least relative gain first, one try per layer."""
    import macattn.apps.tune as tune
    from macattn.evaluation.methods import CompletionProbe
    from macattn.methods.completion.feature_maps import maps_for_model

    real = tune.measure_methods

    def tied(model, methods, prompts, progress=False):
        if isinstance(methods[0], CompletionProbe):
            return real(model, methods, prompts, progress=progress)
        return [{"greedy_agreement": 0.75} for _ in methods]

    monkeypatch.setattr(tune, "measure_methods", tied)
    model = _small_model()
    maps = maps_for_model(model, feature_dim=8, hidden=16)
    prompts = calibration_prompts(model, TuneSettings(lengths=(256,), n=1, gen=3), ENC, HAY, progress=False)
    gate, rep = tune.tune_completion_gate(model, prompts, maps=maps, budget=0.3, n_sink=4, n_tail=8,
                                          calibrate_mass=False, progress=False)
    cal = rep["calibration"]
    first = [c < t for c, t in zip(cal["completion_calibrated"]["error"], cal["topk_alone"]["error"])]
    assert any(first), "the case needs a layer whose error keeps the term"
    assert not any(gate.layers)
    trail = rep["agreement_trail"]
    assert len(trail) == sum(first) and trail[0]["layers"] == first
    assert all(t["greedy_agreement"] == t["topk_alone_agreement"] for t in trail)
    assert [sum(t["layers"]) for t in trail] == list(range(sum(first), 0, -1))


def test_completion_gate_keeps_the_term_where_it_lowers_the_error_and_the_cli_writes_it(tmp_path, monkeypatch):
    """``tune_completion_gate``: the term's mass calibrated per layer and head (never worse than uncalibrated on
    the calibration steps); without the agreement check a layer's term is on iff its calibrated error is below
    Top-k alone's at the equal-cost Top-k; with it, the gated model's calibration agreement exceeds Top-k alone's
    or every layer is off; held-out stats for the three variants; ``macattn tune --completion`` writes a gate file
    ``CompletionConfig`` reads, its ``log_mass`` included."""
    import macattn.evaluation.harness as harness
    from macattn.apps.tune import tune_completion_gate
    from macattn.methods.completion.config import CompletionConfig
    from macattn.methods.completion.feature_maps import maps_for_model, save_feature_maps

    model = _small_model()
    maps = maps_for_model(model, feature_dim=8, hidden=16)
    prompts = calibration_prompts(model, TuneSettings(lengths=(256,), n=1, gen=3), ENC, HAY, progress=False)
    gate, rep = tune_completion_gate(model, prompts, maps=maps, budget=0.3, n_sink=4, n_tail=8,
                                     held_out=prompts, agreement=False, progress=False)
    cal = rep["calibration"]
    assert list(gate.layers) == [c < t for c, t in zip(cal["completion_calibrated"]["error"],
                                                       cal["topk_alone"]["error"])]
    assert all(c <= u + 1e-12 for c, u in zip(cal["completion_calibrated"]["error"], cal["completion"]["error"]))
    assert [list(x) for x in gate.log_mass] == rep["log_mass"] and len(rep["log_mass"][0]) == maps.spec.num_q_heads
    assert rep["top_k_alone"] > rep["top_k_completion"] and gate.gen_len == 3 and rep["agreement_trail"] == []
    assert set(rep["held_out"]) >= {"completion", "topk_alone", "gated"}
    raw, rep_raw = tune_completion_gate(model, prompts, maps=maps, budget=0.3, n_sink=4, n_tail=8,
                                        calibrate_mass=False, progress=False)
    assert raw.log_mass is None and rep_raw["calibration"]["completion_calibrated"] == rep_raw["calibration"]["completion"]
    for t in rep_raw["agreement_trail"][:-1]:
        assert t["greedy_agreement"] < t["topk_alone_agreement"]
    if any(raw.layers):
        last = rep_raw["agreement_trail"][-1]
        assert last["layers"] == list(raw.layers) and last["greedy_agreement"] > last["topk_alone_agreement"]
    with pytest.raises(ValueError, match="budget"):
        tune_completion_gate(model, prompts, maps=maps, budget=0.001, n_sink=4, n_tail=8, progress=False)
    save_feature_maps(maps, tmp_path / "maps")
    monkeypatch.setattr(harness, "load_eval_model", lambda which, **kw: (_small_model(), ENC, HAY, [], "test"))
    out, report = tmp_path / "gate.json", tmp_path / "gate_report.json"
    a = build_parser().parse_args(["tune", "--completion", "--feature-maps", str(tmp_path / "maps"), "--budget", "0.3",
                                   "--n-sink", "4", "--n-tail", "8", "--lengths", "256", "--n", "1", "--gen", "3",
                                   "--out", str(out), "--report", str(report)])
    assert a.func(a) == 0
    written = CompletionConfig(gate=out).gate
    assert list(written.layers) == json.loads(report.read_text())["gate"]
    assert [list(x) for x in written.log_mass] == json.loads(report.read_text())["log_mass"]


def test_an_all_off_tuned_gate_is_top_k_alone_at_its_budget():
    """Every layer off, a tuned gate (``off_top_k``: the budget's own Top-k alone) gives exactly Top-k alone's
    greedy tokens and attention outputs at that budget, not the cost model's rounded-down Top-k."""
    from macattn.apps.tune import completion_budget_ks, measure_methods
    from macattn.evaluation.methods import RetrievalCompletion
    from macattn.methods.completion.completion_on_miss import MissCompletionConfig
    from macattn.methods.completion.feature_maps import maps_for_model
    from macattn.methods.completion.gate import CompletionGate

    model = _small_model()
    maps = maps_for_model(model, feature_dim=8, hidden=16)
    prompts = calibration_prompts(model, TuneSettings(lengths=(256,), n=1, gen=3), ENC, HAY, progress=False)
    N = max(int(p.shape[1]) for p, _ in prompts)
    kc, kt = completion_budget_ks(0.3, N, n_sink=4, n_tail=8, gen_len=3, feature_dim=8, head_dim=maps.spec.head_dim)
    assert kt > kc
    cfg = lambda k: MissCompletionConfig(n_sink=4, n_tail=8, top_k=k, feature_dim=8)  # noqa: E731
    gate = CompletionGate((False,) * maps.spec.num_layers, gen_len=3, off_top_k=(kc, kt))
    methods = [RetrievalCompletion(cfg(kc), maps=maps, completion=True, gen_len=3, gate=gate),
               RetrievalCompletion(cfg(kt), maps=maps, completion=False, gen_len=3)]
    gated, alone = measure_methods(model, methods, prompts)
    assert gated["greedy_agreement"] == alone["greedy_agreement"]
    assert gated["error"] == alone["error"] and gated["max_error"] == alone["max_error"]    # per layer, exactly
