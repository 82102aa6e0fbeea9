"""RULER-style task generators and the ``macattn eval`` harness on the random built-in model."""
import json
import random
from collections import Counter

import pytest
import torch

from macattn.methods.mac.config import MacConfig
from macattn.evaluation import tasks as T
from macattn.evaluation.harness import EvalSettings, byte_encoder, run_eval
from macattn.cli import build_parser
from macattn.methods.a3.config import A3Config
from macattn.evaluation.methods import A3Fusion, Mac, RetrievalCompletion
from macattn.methods.completion.completion_on_miss import MissCompletionConfig

ENC = byte_encoder(2048)


def _hay(n, rng):  # byte-encoded filler text that cannot spell a needle
    return [rng.choice(ENC("qzxj ")) for _ in range(n)]


@pytest.mark.parametrize("task", T.TASKS)
@pytest.mark.parametrize("length", [700, 1500])
def test_samples_exact_length_and_deterministic(task, length):
    a = T.make_sample(task, length, random.Random(3), ENC, _hay, bos=[0])
    b = T.make_sample(task, length, random.Random(3), ENC, _hay, bos=[0])
    c = T.make_sample(task, length, random.Random(4), ENC, _hay, bos=[0])
    assert a == b and a != c
    assert len(a.ids) + len(a.answer) == length and a.ids[0] == 0 and a.answer


def _dec(ids):
    return bytes((i - 3) % 2045 for i in ids).decode(errors="replace")


def test_niah_answer_is_the_queried_needle_value():
    for seed in range(20):
        s = T.make_sample("niah_multikey", 1200, random.Random(seed), ENC, _hay)
        text = _dec(s.ids)
        key = text.rsplit("What is the special magic number for ", 1)[1].split("?")[0]
        assert f"The special magic number for {key} is{_dec(s.answer)}." in text
        assert text.count("The special magic number for") == 4


def test_vt_answer_is_the_chain_holding_the_value():
    s = T.make_sample("vt", 1200, random.Random(1), ENC, _hay)
    text = _dec(s.ids)
    value = text.rsplit("assigned the value", 1)[1].split("?")[0].strip()
    names = _dec(s.answer).split()
    assert f"VAR {names[0]} = {value}." in text
    for prev, cur in zip(names, names[1:]):
        assert f"VAR {cur} = VAR {prev}." in text
        assert text.index(f"VAR {prev} =") < text.index(f"VAR {cur} =")


def test_cwe_answer_words_are_strictly_most_common():
    s = T.make_sample("cwe", 1500, random.Random(2), ENC, _hay)
    body = _dec(s.ids).split("Words:", 1)[1].split("What are")[0]
    counts = Counter(w.strip() for w in body.split(",") if w.strip())
    top = _dec(s.answer).split()
    ranked = [w for w, _ in counts.most_common()]
    assert ranked[:3] == top and counts[top[2]] > counts[ranked[3]]


def test_bad_inputs():
    with pytest.raises(ValueError, match="task"):
        T.make_sample("nope", 500, random.Random(0), ENC, _hay)
    with pytest.raises(ValueError, match="too short"):
        T.make_sample("vt", 40, random.Random(0), ENC, _hay)
    with pytest.raises(ValueError, match="lengths"):
        EvalSettings(lengths=(10,))
    with pytest.raises(ValueError, match="tasks"):
        EvalSettings(tasks=("x",))


@pytest.fixture(scope="module")
def model():
    from macattn.models.builtin import build_builtin_model
    return build_builtin_model("llama", seed=0, num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                               num_attention_heads=8, num_key_value_heads=2, head_dim=16)


HAY = torch.randint(300, 2048, (4096,), generator=torch.Generator().manual_seed(0)).tolist()


def test_run_eval_metrics(model):
    settings = EvalSettings(lengths=(256,), tasks=("niah_single",), n=1, gen=4, seed=0)
    off = Mac(MacConfig(enabled=False), name="mac-off")
    on = Mac(MacConfig(window=256, band=16, tau=0.0))
    comp_cfg = MissCompletionConfig(n_sink=4, n_tail=8, top_k=10_000, feature_dim=8)
    exact_comp = Mac(MacConfig(window=256, band=16, tau=0.99, miss_policy="completion"), completion=comp_cfg,
                     name="mac+exact-completion")
    plain = Mac(MacConfig(window=256, band=16, tau=0.99), name="mac-0.99")
    rc = RetrievalCompletion(MissCompletionConfig(n_sink=4, n_tail=8, top_k=16, feature_dim=8))
    res = run_eval(model, [off, on, exact_comp, plain, rc], settings, encode=ENC, haystack_ids=HAY, progress=False)
    m = res["methods"]
    assert list(m) == ["full", "mac-off", on.name, "mac+exact-completion", "mac-0.99", rc.name]
    # MAC disabled is full attention: same tokens, (fp32-)zero error, nothing skipped, everything read
    assert m["mac-off"]["greedy_agreement"] == 1.0 and m["mac-off"]["kv_skip"] == 0.0
    assert m["mac-off"]["kv_read_fraction"] == 1.0 and m["mac-off"]["rel_error_mean"] < 1e-5
    assert m["mac-off"]["accuracy"] == m["full"]["accuracy"]
    # tau=0 accepts every candidate: hits everywhere, a positive skip, fewer reads, a measurable error
    e = m[on.name]
    assert e["hit_rate"] == 1.0 and 0.0 < e["kv_skip"] < 1.0 and e["kv_read_fraction"] < 1.0
    assert len(e["rel_error_per_layer"]) == 2 and min(e["rel_error_per_layer"]) > 0
    assert abs(e["kv_skip"] + e["kv_read_fraction"] - 1.0) < 0.2   # reads = band + tail on hits
    # every (layer, head, decode step) hit is binned; the first token comes from the (full) prefill
    assert sum(e["error_vs_gap"]["count"]) == 2 * 8 * (e["decode_steps"] - 1)
    # completion on a miss with Top-k covering the mid region is plain MAC
    a, b = m["mac+exact-completion"], m["mac-0.99"]
    for key in ("greedy_agreement", "hit_rate", "kv_skip", "kv_read_fraction"):
        assert a[key] == b[key], key
    assert max(abs(x - y) for x, y in zip(a["rel_error_per_layer"], b["rel_error_per_layer"])) < 1e-6
    # retrieval-completion reads only sink + tail + k + generated (+ its amortised cache)
    assert 0.0 < m[rc.name]["kv_read_fraction"] < 0.5 and m[rc.name]["hit_rate"] == 0.0
    json.dumps(res)


def test_a3_in_the_harness(model):
    """A3 with every document token recomputed is full recompute: identical greedy tokens; it has no
    per-layer decode statistics."""
    settings = EvalSettings(lengths=(256,), tasks=("niah_single", "vt"), n=1, gen=4, seed=0)
    exact = A3Fusion(A3Config(rho=1.0, method="a3"), chunk_tokens=64, question_tokens=16)
    reuse = A3Fusion(A3Config(method="full_reuse"), chunk_tokens=64, question_tokens=16)
    assert exact.name == "a3(rho=1.0,chunk=64)" and reuse.name == "full_reuse(chunk=64)"
    res = run_eval(model, [exact, reuse], settings, encode=ENC, haystack_ids=HAY, progress=False)
    e = res["methods"][exact.name]
    assert e["greedy_agreement"] == 1.0 and e["accuracy"] == res["methods"]["full"]["accuracy"]
    assert e["decode_steps"] >= 2 * 4 and "hit_rate" not in e and "rel_error_mean" not in e
    assert 0.0 <= res["methods"][reuse.name]["greedy_agreement"] <= 1.0


def test_a3_prompt_split():
    m = A3Fusion(A3Config(rho=0.5, method="a3"), chunk_tokens=5, question_tokens=3)
    ids = torch.arange(20).unsqueeze(0)
    rp = m.rag_prompt(ids)
    assert rp.system.tolist() == [0] and rp.question.tolist() == [17, 18, 19]
    assert [c.numel() for c in rp.chunks] == [5, 5, 5, 1] and torch.equal(rp.tokens(), ids[0])
    with pytest.raises(ValueError, match="too short"):
        m.rag_prompt(torch.arange(4).unsqueeze(0))
    with pytest.raises(ValueError, match="chunk_tokens"):
        A3Fusion(A3Config(), chunk_tokens=0)
    with pytest.raises(TypeError, match="A3Config"):
        A3Fusion("a3")


def test_duplicate_method_names_are_rejected(model):
    with pytest.raises(ValueError, match="distinct"):
        run_eval(model, [Mac(MacConfig(), name="a"), Mac(MacConfig(), name="a")], EvalSettings(lengths=(300,)),
                 encode=ENC, haystack_ids=HAY, progress=False)


def test_cli_writes_json_and_pngs(tmp_path, model, monkeypatch):
    pytest.importorskip("matplotlib")
    import macattn.evaluation.harness as harness

    monkeypatch.setattr(harness, "load_eval_model", lambda which, **kw: (model, ENC, HAY, [], "test haystack"))
    p = build_parser()
    out = tmp_path / "eval_tiny.json"
    a = p.parse_args(["eval", "--model", "random", "--lengths", "256", "--tasks", "niah_single", "--n", "1",
                      "--gen", "3", "--taus", "0.0", "--window", "64", "--band", "16", "--bands", "0,16",
                      "--no-completion", "--a3-rhos", "0.5", "--a3-chunk", "64", "--a3-question", "16",
                      "--out", str(out)])
    assert a.func(a) == 0
    res = json.loads(out.read_text())
    assert set(res["methods"]) == {"full", "mac(tau=0.0,K=64,r=16)", "a3(rho=0.5,chunk=64)"}
    assert res["haystack"] == "test haystack"
    assert [r["band"] for r in res["band_sweep"]["rows"]] == [0, 16]
    for name in ("per_layer", "error_vs_band", "error_vs_gap"):
        assert (tmp_path / f"eval_tiny_{name}.png").stat().st_size > 1000
