"""``macattn eval --long-gen``: free-running long generation against full attention; one prefill replayed."""
import json

import pytest
import torch

from macattn.evaluation.harness import byte_encoder
from macattn.cli import build_parser
from macattn.evaluation.long_gen import LongGenSettings, long_generate, run_long_gen
from macattn.evaluation.methods import Mac, Prefill
from macattn.methods.mac.config import MacConfig
from macattn.models.generation import greedy_decode

ENC = byte_encoder(2048)
HAY = torch.randint(300, 2048, (4096,), generator=torch.Generator().manual_seed(4)).tolist()


pytestmark = pytest.mark.usefixtures("one_thread")


def _small_model():
    from macattn.models.builtin import build_builtin_model

    return build_builtin_model("llama", seed=1, num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16)


def test_long_generate_is_free_running_and_asks_the_question():
    model = _small_model()
    doc = torch.randint(0, 2048, (1, 90), generator=torch.Generator().manual_seed(0))
    q = [5, 6, 7]
    res = long_generate(model, None, doc, 12, q, 2)
    own, _ = greedy_decode(model, doc, 12)
    assert res["generated"] == own                            # each token is the previous argmax
    ctx = torch.cat([doc, torch.tensor([own + q])], dim=1)
    want, _ = greedy_decode(model, ctx, 2)
    assert res["answer"] == want


def test_mac_off_never_diverges_and_mac_on_records_every_step():
    model = _small_model()
    settings = LongGenSettings(lengths=(300,), tasks=("niah_single", "niah_multikey"), tokens=24, bins=4)
    on = Mac(MacConfig(window=64, band=8, tau=0.0))
    off = Mac(MacConfig(window=64, band=8, enabled=False), name="off")
    r = run_long_gen(model, [on, off], settings, encode=ENC, haystack_ids=HAY, progress=False)
    json.dumps(r)
    assert r["summary"]["off"]["first_divergence"] == [None, None]
    assert r["summary"]["off"]["accuracy"] == r["summary"]["full"]["accuracy"]
    for s in r["samples"]:
        assert s["methods"]["off"]["answer"] == s["methods"]["full"]["answer"]
        m = s["methods"][on.name]
        assert len(m["hit_over_time"]) == 2 and all(len(x) == 4 for x in m["hit_over_time"])
        assert all(0 <= x <= 1 for row in m["skip_over_time"] for x in row)
        assert m["first_divergence"] is None or 0 <= m["first_divergence"] < 24
    # the last sample's steps: tokens - 1 generation, the last token, the question (300 - answer - document),
    # answer - 1
    rec, last = on.recorder, r["samples"][-1]
    question = 300 - len(last["answer"]) - last["document_tokens"]
    assert len(rec.timeline[0]) == 23 + 1 + question + len(last["answer"]) - 1
    assert r["summary"][on.name]["hit_rate"] > 0


def test_prefill_replay_gives_the_fresh_runs_tokens_and_statistics():
    model = _small_model()
    prompt = torch.randint(0, 2048, (1, 150), generator=torch.Generator().manual_seed(9))
    ref, _ = greedy_decode(model, prompt, 6)
    cfg = MacConfig(window=64, band=8, tau=0.0).with_match_scales([[0.7, 1.1, 0.9, 1.3], [1.2]])
    a, b = Mac(cfg), Mac(cfg)
    ta = a.run(model, prompt, 6, forced=ref)
    pre = Prefill.of(model, prompt)
    tb = b.run(model, prompt, 6, forced=ref, prefilled=pre)
    tc = b.run(model, prompt, 6, forced=ref, prefilled=pre)       # the prefill is reusable
    assert ta == tb == tc
    assert [2 * h for h in a.recorder.hits] == b.recorder.hits and sum(a.recorder.hits) > 0
    assert b.recorder.errors[1][:5] == pytest.approx(a.recorder.errors[1], rel=1e-9, abs=1e-12)


def test_cli_long_gen_writes_json_and_png(tmp_path, monkeypatch):
    import macattn.evaluation.harness as harness

    monkeypatch.setattr(harness, "load_eval_model", lambda which, **kw: (_small_model(), ENC, HAY, [], "test"))
    p = build_parser()
    out = tmp_path / "long.json"
    a = p.parse_args(["eval", "--long-gen", "--long-gen-tokens", "16", "--lengths", "200", "--tasks", "niah_single",
                      "--window", "64", "--band", "8", "--taus", "0.0", "--two-stage", "--bins", "4",
                      "--out", str(out)])
    assert a.func(a) == 0
    r = json.loads(out.read_text())
    assert set(r["summary"]) == {"full", "mac(tau=0.0,K=64,r=8)", "mac+two_stage(fp8,c=4)(tau=0.0,K=64,r=8)"}
    assert r["settings"]["tokens"] == 16 and out.with_suffix(".png").stat().st_size > 0


def test_runs_split_per_method_merge_into_the_single_run(tmp_path, monkeypatch):
    """``--no-uniform`` / one method per process, then ``--long-gen-merge``: the merged result equals one
    run of both methods (samples, per-method entries but their seconds, the summary)."""
    import macattn.evaluation.harness as harness

    monkeypatch.setattr(harness, "load_eval_model", lambda which, **kw: (_small_model(), ENC, HAY, [], "test"))
    p = build_parser()
    common = ["eval", "--long-gen", "--long-gen-tokens", "12", "--lengths", "300", "--tasks", "niah_single,vt",
              "--window", "64", "--band", "8", "--taus", "0.0", "--bins", "4"]
    runs = {"both": ["--two-stage"], "uniform": [], "two_stage": ["--two-stage", "--no-uniform"]}
    for name, extra in runs.items():
        a = p.parse_args([*common, *extra, "--out", str(tmp_path / f"{name}.json")])
        assert a.func(a) == 0
    a = p.parse_args(["eval", "--long-gen-merge", str(tmp_path / "uniform.json"), str(tmp_path / "two_stage.json"),
                      "--out", str(tmp_path / "merged.json")])
    assert a.func(a) == 0
    both, merged = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("both", "merged"))
    strip = lambda r: [{n: {k: v for k, v in m.items() if k != "seconds"} for n, m in e["methods"].items()}  # noqa: E731
                       for e in r["samples"]]
    assert list(merged["summary"]) == list(both["summary"]) and len(merged["summary"]) == 3
    assert strip(merged) == strip(both)
    assert merged["summary"] == both["summary"]
    assert merged["settings"]["tasks"] == ["niah_single", "vt"]
    assert (tmp_path / "merged.png").stat().st_size > 0
    a = p.parse_args([*common, "--no-uniform", "--out", str(tmp_path / "none.json")])
    with pytest.raises(SystemExit, match="--no-uniform leaves no method"):
        a.func(a)


def test_merge_refuses_runs_that_disagree():
    from macattn.evaluation.long_gen import merge_long_gen

    model = _small_model()
    settings = LongGenSettings(lengths=(200,), tasks=("niah_single",), tokens=6, bins=2)
    r1 = run_long_gen(model, [Mac(MacConfig(window=64, band=8, tau=0.0))], settings, encode=ENC, haystack_ids=HAY,
                      progress=False)
    with pytest.raises(ValueError, match="is in two results"):
        merge_long_gen([r1, r1])
    r2 = json.loads(json.dumps(r1))
    r2["samples"][0]["methods"]["full"]["answer"] = [-1]
    r2["samples"][0]["methods"] = {"full": r2["samples"][0]["methods"]["full"]}
    with pytest.raises(ValueError, match="full attention answered"):
        merge_long_gen([r1, r2])
    r3 = {**json.loads(json.dumps(r1)), "settings": {**r1["settings"], "tokens": 7}}
    with pytest.raises(ValueError, match="must share the model and the settings"):
        merge_long_gen([r1, r3])
    with pytest.raises(ValueError, match="at least one"):
        merge_long_gen([])


def test_settings_validation():
    with pytest.raises(ValueError, match="tokens must be an int >= 2"):
        LongGenSettings(tokens=1)
    with pytest.raises(ValueError, match="tasks must be a non-empty subset"):
        LongGenSettings(tasks=("essay",))
