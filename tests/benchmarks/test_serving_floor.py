"""``bench_prefill_floor.py`` and ``bench_serving.py``'s named workloads on the CPU (tiny shapes, the
built-in model): the scripts run end to end and their JSON carries the floor beside every record; the
floor arithmetic; the benchmark-only seeded MAC hit patterns (mask, shapes, registration, and the hit rate
they produce through ``LLM``)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_prefill_floor as floor  # noqa: E402
import bench_serving as serving  # noqa: E402


@pytest.fixture(autouse=True)
def _registry_restored(monkeypatch):
    """The seeded classes register themselves: keep them out of the registry other tests see."""
    from macattn.methods import registry

    monkeypatch.setattr(registry, "METHODS", dict(registry.METHODS))
    monkeypatch.setattr(registry, "ATTENTION_METHODS", registry.ATTENTION_METHODS)


def _run(*argv, timeout=300):
    run = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout


def test_mix_names_round_trip():
    for text, pair in (("16x1K", (16, 1024)), ("4x32K", (4, 32768)), ("2x48", (2, 48))):
        assert floor.parse_mix(text) == pair
        assert floor.mix_name(*pair) == text
    assert floor.parse_mix("4x32768") == (4, 32768)


def test_lower_right_share():
    # a chunk of the last Q rows of a C-row causal prefill: (Q (C - Q + 1) + Q (Q - 1) / 2) / (C (C + 1) / 2)
    assert floor._lower_right_share(8192, 32768) == pytest.approx(0.4375, abs=1e-4)
    assert floor._lower_right_share(128, 128) == pytest.approx(1.0)


@pytest.mark.slow
def test_prefill_floor_dry_run(tmp_path):
    out = tmp_path / "floor.json"
    stdout = _run(str(ROOT / "benchmarks" / "bench_prefill_floor.py"), "--dry-run", "--out", str(out))
    assert "prefill floor" in stdout and "decode BxC" in stdout
    rep = json.loads(out.read_text())
    for key in ("device", "device_uuid", "torch", "triton", "transformers", "shapes", "backends_tried"):
        assert key in rep
    assert set(rep["prefill"]) == set(floor.DRY_MIXES)
    for rec in rep["prefill"].values():
        assert rec["floor_ms"] > 0 and rec["gemm"]["total_ms"] > 0
        ran = {b: r for b, r in rec["attention"]["backends"].items() if "ms" in r}
        assert ran and rec["attention"]["best"] in ran          # what ran on the CPU is recorded
        tm = rec["attention"]["token_major"]                    # the best backend on the engine's layout
        assert tm["backend"] == rec["attention"]["best"] and tm["ms"] > 0
    assert rep["chunk_probe"]["best_ms"] > 0 and 0 < rep["chunk_probe"]["share_fraction"] < 1
    assert all(r["step_ms"] > 0 for r in rep["decode"].values())


@pytest.mark.slow
def test_serving_workloads_dry_run(tmp_path):
    out = tmp_path / "serving.json"
    stdout = _run(str(ROOT / "benchmarks" / "bench_serving.py"), "--dry-run", "--workload", "ttft_1k",
                  "--workload", "mix_1k_64", "--workload", "long_4x32k_1024", "--mac-ab", "--out", str(out))
    assert "output tok/s" in stdout and "x floor" in stdout
    rep = json.loads(out.read_text())
    assert rep["floor"]["benchmark"] == "bench_prefill_floor"       # measured in this run
    assert "llm_takes_max_num_batched_tokens" in rep["engine_options"]
    recs = {(r["workload"], r["variant"]): r for r in rep["records"]}
    assert set(recs) == {("ttft_1k", "mac=on,hits=model"), ("mix_1k_64", "mac=on,hits=model"),
                         ("long_4x32k_1024", "mac=on,hits=model"), ("long_4x32k_1024", "mac=on,hits=seeded90"),
                         ("long_4x32k_1024", "mac=on,hits=seeded100"), ("long_4x32k_1024", "mac=off")}
    for r in rep["records"]:
        assert "error" not in r, r.get("trace")
        assert r["floor"]["prefill_floor_ms"] > 0 and r["ratios"]["ttft_p50_over_prefill_floor"] > 0
    mix = recs[("mix_1k_64", "mac=on,hits=model")]
    assert mix["results"]["requests"] == serving._DRY["mix_1k_64"]["num_prompts"]
    assert mix["floor"]["floor_output_tok_per_s"] > 0 and mix["ratios"]["output_tok_per_s_over_floor"] > 0
    assert recs[("long_4x32k_1024", "mac=on,hits=seeded90")]["method"] == "bench_mac_seeded90"
    assert recs[("long_4x32k_1024", "mac=on,hits=model")]["requests_with_mac_metrics"] > 0
    assert recs[("ttft_1k", "mac=on,hits=model")]["results"]["requests"] == 2   # --ttft-reps under --dry-run
    assert mix["server"]["method"] == "mac"             # the server's description stays beside its means
    server, client = mix["server_means"], mix["results"]    # the server's own latency means, same requests
    assert 0 < server["server_ttft_mean_s"] <= server["server_e2e_mean_s"] and server["server_itl_mean_s"] > 0
    assert server["server_e2e_mean_s"] <= client["e2e_s"]["mean"]     # the client's figure includes the wire


def test_server_means_between_two_scrapes():
    before = {"macattn_e2e_request_latency_seconds_sum": 1.0, "macattn_e2e_request_latency_seconds_count": 2.0}
    after = {"macattn_e2e_request_latency_seconds_sum": 4.0, "macattn_e2e_request_latency_seconds_count": 4.0,
             "macattn_time_to_first_token_seconds_sum": 0.5, "macattn_time_to_first_token_seconds_count": 2.0}
    assert serving.server_means_between(before, after) == {"server_ttft_mean_s": 0.25, "server_itl_mean_s": None,
                                                           "server_e2e_mean_s": 1.5}


def _args(**kw):
    import argparse

    base = dict(workload=None, device="cpu", dry_run=False, ttft_reps=3, hit_patterns=None, model="builtin",
                num_prompts=4, input_len=8, output_len=4, concurrency=2, max_batch_size=None, no_mac=False,
                mac_ab=False, max_num_batched_tokens=None, prefill_chunk=None, async_scheduling=None,
                mac_min_context=None)
    return argparse.Namespace(**{**base, **kw})


def test_workload_selection_and_variants():
    assert [w.name for w in serving.resolve_workloads(_args())] == ["custom"]
    assert [w.name for w in serving.resolve_workloads(_args(device="cuda"))] == list(serving.WORKLOADS)
    long = serving.WORKLOADS["long_4x32k_1024"]
    assert serving.variants(long, _args()) == [("on", "model", None), ("on", "seeded90", None),
                                                ("on", "seeded100", None)]
    assert serving.variants(long, _args(mac_ab=True))[-1] == ("off", None, None)
    assert serving.variants(long, _args(no_mac=True)) == [("off", None, None)]
    assert serving.variants(serving.WORKLOADS["mix_1k_64"], _args(mac_ab=True)) == [("on", "model", None)]
    turns = serving.WORKLOADS["multiturn_32k"]          # a 32K document, then ~100-token questions: cache on, off
    assert serving.variants(turns, _args()) == [("on", "model", True), ("on", "model", False)]
    assert serving.variants(turns, _args(no_mac=True)) == [("off", None, True), ("off", None, False)]
    assert (turns.prefill_mix, turns.decode_point) == ((1, 32768 + 100), None)
    dry = serving.resolve_workloads(_args(workload=["multiturn_32k"], dry_run=True))[0]
    assert (dry.kind, dry.num_prompts, dry.input_len, dry.mac_window) == ("multiturn", 3, 96, 16)
    ttft = serving.resolve_workloads(_args(workload=["ttft_32k"], ttft_reps=5))[0]
    assert (ttft.num_prompts, ttft.concurrency, ttft.prefill_mix, ttft.decode_point) == (5, 1, (1, 32768), None)


def test_the_warm_up_is_a_first_wave_of_a_throughput_workload():
    """Every record's untimed warm-up meets the timed load's paths: a throughput workload's first wave (its
    concurrency, at most 8 output tokens), one short request otherwise."""
    mix, long, ttft = (serving.WORKLOADS[n] for n in ("mix_1k_64", "long_4x32k_1024", "ttft_32k"))
    assert serving.warmup_load(mix) == dict(num_prompts=16, output_len=8, concurrency=16)
    assert serving.warmup_load(long) == dict(num_prompts=4, output_len=8, concurrency=4)
    assert serving.warmup_load(ttft) == dict(num_prompts=1, output_len=2, concurrency=1)


def test_floor_for_arithmetic():
    w = serving.WORKLOADS["mix_1k_64"]            # 64 x (1K in, 64 out), 16 in flight
    rep = {"prefill": {"16x1K": {"floor_ms": 400.0}}, "decode": {"16x1024": {"step_ms": 10.0}}}
    fl = serving.floor_for(w, rep)
    assert fl["waves"] == 4 and fl["decode_steps"] == 4 * 63
    assert fl["prefill_all_ms"] == pytest.approx(1600.0)
    assert fl["floor_output_tok_per_s"] == pytest.approx(64 * 64 / ((1600.0 + 252 * 10.0) / 1e3))
    res = {"ttft_s": {"p50": 0.8, "p99": 1.2}, "output_token_throughput_per_s": fl["floor_output_tok_per_s"] / 2}
    r = serving.ratios(res, fl)
    assert r["ttft_p50_over_prefill_floor"] == pytest.approx(2.0)
    assert r["output_tok_per_s_over_floor"] == pytest.approx(0.5)
    assert serving.floor_for(serving.WORKLOADS["ttft_1k"], {"prefill": {"1x1K": {"floor_ms": 5.0}}, "decode": {}}) \
        == {"prefill_mix": "1x1K", "prefill_floor_ms": 5.0}


def test_engine_options_pass_only_what_llm_takes(capsys):
    from dataclasses import fields

    from macattn.runtime.engine_args import EngineArgs

    takes = {f.name for f in fields(EngineArgs)}          # LLM(**kwargs) takes every engine argument
    kw, info = serving.engine_options(_args(max_num_batched_tokens=4096, prefill_chunk=64, async_scheduling=False,
                                            mac_min_context=0))
    for name, value in (("max_num_batched_tokens", 4096), ("prefill_chunk", 64), ("async_scheduling", False),
                        ("mac_min_context", 0)):
        assert (name in kw) == (name in takes) == info[f"{name}_applied"]
        assert info[name] == value
    assert serving.engine_options(_args())[0] == {}


def _dims(L=3, H=4, d=8):
    from macattn.methods.base import ModelDims

    return ModelDims(num_layers=L, num_q_heads=H, num_kv_heads=2, head_dim=d, hidden_size=H * d,
                     dtype=torch.float32, device=torch.device("cpu"))


def test_seeded_class_mask_and_match_query():
    from macattn.methods import registry
    from macattn.methods.mac.config import MacConfig

    cls = serving.seeded_mac_class(0.9)
    assert serving.seeded_mac_class(0.9) is cls and registry.METHODS[cls.name] is cls   # registered once
    assert registry.method_class(cls.name) is cls          # the engine builds it by name
    assert cls.name == "bench_mac_seeded90" and cls.default_config() == MacConfig()    # MAC on, defaults
    L, H, d = 5, 4, 8
    m = cls(MacConfig(), _dims(L, H, d), num_slots=2)
    assert m.seeded_heads.shape == (L, H) and int(m.seeded_heads.sum()) == round(0.9 * L * H)
    again = cls(MacConfig(), _dims(L, H, d), num_slots=2)                      # the pattern is seeded
    assert torch.equal(again.seeded_heads, m.seeded_heads) and torch.equal(again.seeded_query, m.seeded_query)
    for shape in ((3, H, d), (3, H, 6, d)):
        q = torch.randn(*shape)
        for layer in range(L):
            out = m.match_query(layer, q)
            assert out.shape == q.shape and out.dtype == q.dtype
            for h in range(H):
                expect = m.seeded_query[layer, h] if m.seeded_heads[layer, h] else None
                got = out[:, h]
                if expect is None:
                    assert torch.equal(got, q[:, h])
                else:
                    assert torch.equal(got, expect.expand_as(got) if q.dim() == 3 else
                                       expect.view(1, 1, d).expand_as(got))
    full = serving.seeded_mac_class(1.0)(MacConfig(), _dims(L, H, d), num_slots=1)
    assert bool(full.seeded_heads.all())


@pytest.mark.slow
def test_seeded_hit_rate_through_llm():
    """p = 1.0 hits on every head (a prompt of >= window + band tokens: every ring entry is a valid
    match), the model's own matches stay where they are (well below it)."""
    from macattn import LLM, SamplingParams

    rates = {}
    for method in ("mac", serving.seeded_mac_class(1.0).name):
        llm = LLM("builtin", method=method)
        try:
            ids = [300 + (7 * i) % 7000 for i in range(1300)]
            [out] = llm.generate(ids, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
            rates[method] = out.metrics["mac_hit_rate"]
        finally:
            llm.shutdown()
    assert rates["bench_mac_seeded100"] > 0.99
    assert rates["mac"] < 0.9


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_seeded_match_query_captures_in_a_cuda_graph():
    from macattn.methods.base import ModelDims
    from macattn.methods.mac.config import MacConfig

    dims = ModelDims(num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=64, hidden_size=256,
                     dtype=torch.bfloat16, device=torch.device("cuda"))
    m = serving.seeded_mac_class(0.9)(MacConfig(), dims, num_slots=2)
    q = torch.randn(2, 4, 64, device="cuda", dtype=torch.bfloat16)
    ref = m.match_query(1, q)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        m.match_query(1, q)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = m.match_query(1, q)
    q.copy_(torch.randn_like(q))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, m.match_query(1, q)) and not torch.equal(out, ref)


def test_percentiles_interpolate_between_ranks_as_numpy_does():
    """The p50 of four requests is the mean of the 2nd and 3rd (numpy's linear percentile, vLLM's benchmark's);
    every value of a short workload is kept."""
    xs = [4.0, 1.0, 3.0, 2.0]
    assert serving._pct(xs, 50) == 2.5 and serving._pct(xs, 0) == 1.0 and serving._pct(xs, 100) == 4.0
    many = [float(i) for i in range(101)]
    assert serving._pct(many, 99) == 99.0 and abs(serving._pct(many[:100], 99) - 98.01) < 1e-9
    assert serving._stats(xs)["sorted"] == [1.0, 2.0, 3.0, 4.0] and "sorted" not in serving._stats(many)
    assert serving._pct([], 50) is None


def test_server_itl_quantiles_from_the_buckets_between_two_scrapes(monkeypatch):
    """``scrape_metrics`` reads the per-token gap histogram's buckets with prometheus_client's parser (summed over
    labels); the quantiles are Prometheus's ``histogram_quantile`` of the buckets' increase between two scrapes."""
    import run_clients
    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    r = CollectorRegistry()
    h = Histogram(serving.SERVER_GAPS, "gaps", ["model_name"], buckets=(0.005, 0.01, 0.1, 0.25), registry=r)
    texts = []
    monkeypatch.setattr(run_clients, "metrics_text", lambda url: texts[-1])
    for v in [0.003] * 10:
        h.labels("a").observe(v)
    texts.append(generate_latest(r).decode())
    before = serving.scrape_metrics("http://unused")
    for v in [0.007] * 90 + [0.05] * 9 + [0.2]:                 # the 100 gaps between the scrapes
        h.labels("a" if v < 0.1 else "b").observe(v)
    texts.append(generate_latest(r).decode())
    after = serving.scrape_metrics("http://unused")
    q = serving.server_itl_quantiles_between(before, after)
    assert q["n"] == 100
    assert q["p50"] == pytest.approx(0.005 + 0.005 * 50 / 90)    # rank 50 of the 90 in (0.005, 0.01]
    assert q["p90"] == pytest.approx(0.01)
    assert q["p99"] == pytest.approx(0.1)
    assert serving.server_itl_quantiles_between(after, after) == {}
