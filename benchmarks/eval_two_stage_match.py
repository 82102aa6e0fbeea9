"""Fidelity of MAC's two-stage match (``MacConfig(match="two_stage")``) against the exact match.

    python benchmarks/eval_two_stage_match.py                # CPU: trained checkpoint + random queries
    python benchmarks/eval_two_stage_match.py --dry-run      # tiny random model, seconds

On the trained built-in checkpoint (``macattn eval``'s RULER-style tasks, teacher-forced, the CPU
reference MAC, tau 0.45 / K 1024 / r 256): for the exact match and each (sketch, candidates)
two-stage variant, the harness's task accuracy, greedy agreement with full attention and with the
exact-match MAC, attention-output error and hit rate; and, at every decode step, layer and head, on
the variant's own rings: how often its chosen entry is the exact nearest (its exact distance equals
the exact match's), how often its decision (position or miss) equals the exact match's, and how
many exact hits it keeps. The same per-head counts on random queries: a bf16 N(0, 1) ring of
``K`` entries per head, each query an entry plus Gaussian noise (scale drawn so about half the
queries fall inside the threshold). JSON (+ table) in ``benchmarks/results/eval_two_stage_match.json``.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
from dataclasses import replace
from pathlib import Path

import torch

from macattn.evaluation.harness import EvalSettings, load_eval_model, run_eval
from macattn.evaluation.methods import Mac
from macattn.methods.mac.config import MATCH_SKETCHES, MacConfig
from macattn.methods.mac.reference import mac_match_reference, mac_match_two_stage_reference

FIELDS = ("heads", "valid", "nearest_equal", "decision_equal", "exact_hits", "hits_kept")


def compare(q_pre, qring, lse, pos, slots, positions, p, counts: dict) -> None:
    """Accumulate the exact-vs-two-stage counts of one match call into ``counts`` (``FIELDS``)."""
    args = (q_pre, qring, lse, pos, slots, positions)
    exact, dist_e = mac_match_reference(*args, band=p.band, tau=p.tau)
    two, dist_t = mac_match_two_stage_reference(*args, band=p.band, tau=p.tau, sketch=p.match_sketch,
                                                candidates=p.match_candidates)
    valid = torch.isfinite(dist_e)
    counts["heads"] += exact.numel()
    counts["valid"] += int(valid.sum())
    counts["nearest_equal"] += int((valid & (dist_t <= dist_e * (1 + 1e-6) + 1e-6)).sum())
    counts["decision_equal"] += int((exact == two).sum())
    counts["exact_hits"] += int((exact >= 0).sum())
    counts["hits_kept"] += int(((exact >= 0) & (two == exact)).sum())


class MatchCountingMac(Mac):
    """``Mac`` that also compares its match with the exact one on its own rings, before each step."""

    def __init__(self, config: MacConfig, **kw) -> None:
        super().__init__(config, **kw)
        self.counts = dict.fromkeys(FIELDS, 0)

    def decode(self, mac, layer, q, q_pre, key, value, positions, scale):
        p = self.mac_config.for_layer(layer)
        if p.enabled and p.match == "two_stage":
            qring, _, lse, pos = mac.state.layer(layer)
            compare(q_pre, qring, lse, pos, mac.slots, positions, p, self.counts)
        return super().decode(mac, layer, q, q_pre, key, value, positions, scale)


def rates(counts: dict) -> dict:
    return {**counts,
            "nearest_rate": counts["nearest_equal"] / max(1, counts["valid"]),
            "decision_agreement": counts["decision_equal"] / max(1, counts["heads"]),
            "exact_hit_recall": counts["hits_kept"] / max(1, counts["exact_hits"])}


def random_queries(config: MacConfig, *, heads: int, d: int, steps: int, seed: int) -> dict:
    """The counts on synthetic rings (module doc): ``steps`` query batches of ``heads`` heads."""
    g = torch.Generator().manual_seed(seed)
    K, counts = config.window, dict.fromkeys(FIELDS, 0)
    thr = (2 * d) ** 0.5 * (1 - config.tau)
    p = config.for_layer(0)
    for _ in range(steps):
        qring = torch.randn(1, heads, K, d, generator=g).to(torch.bfloat16)
        m = K + config.band + 1
        t = torch.arange(m - K, m)
        pos = torch.empty(1, K, dtype=torch.int64)
        pos[0, t % K] = t                                              # positions m - K .. m - 1, slot t mod K
        lse = torch.zeros(1, heads, K)
        pick = torch.randint(0, K, (heads,), generator=g)
        noise = torch.rand(heads, 1, generator=g) * 2 * thr / d ** 0.5   # |noise| ~ U(0, 2 thr)
        q = qring[0, torch.arange(heads), pick].float() + noise * torch.randn(heads, d, generator=g)
        compare(q[None].to(torch.bfloat16), qring, lse, pos, torch.tensor([0]), torch.tensor([m]), p, counts)
    return rates(counts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="tiny random model, one short task")
    ap.add_argument("--candidates", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--sketches", nargs="+", default=list(MATCH_SKETCHES), choices=MATCH_SKETCHES)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    dry = args.dry_run
    torch.manual_seed(0)
    if dry:
        model, encode, hay, bos, desc = load_eval_model("random")
        settings = EvalSettings(lengths=(192,), tasks=("niah_single",), n=1, gen=4)
        exact_cfg = MacConfig(window=32, band=8, tau=0.3)
    else:
        model, encode, hay, bos, desc = load_eval_model("trained")
        settings = EvalSettings(lengths=(4096,), n=1, gen=32)
        exact_cfg = MacConfig(window=1024, band=256, tau=0.45)
    variants = [exact_cfg] + [replace(exact_cfg, match="two_stage", match_sketch=s, match_candidates=c)
                              for s in args.sketches for c in args.candidates]
    methods = [MatchCountingMac(cfg) for cfg in variants]
    result = run_eval(model, methods, settings, encode=encode, haystack_ids=hay, bos=bos, progress=not dry,
                      baseline=methods[0].name)
    cfg = model.config
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    rows = []
    for m, c in zip(methods, variants):
        r = result["methods"][m.name]
        rows.append({"method": m.name, "match": c.match, "sketch": c.match_sketch if c.match == "two_stage" else None,
                     "candidates": c.match_candidates if c.match == "two_stage" else None,
                     "accuracy_mean": r["accuracy_mean"], "greedy_agreement_vs_full": r["greedy_agreement"],
                     "greedy_agreement_vs_exact": r["greedy_agreement_vs_baseline"],
                     "rel_error_mean": r["rel_error_mean"], "hit_rate": r["hit_rate"], "kv_skip": r["kv_skip"],
                     "real_queries": rates(m.counts) if c.match == "two_stage" else None,
                     "random_queries": random_queries(c, heads=32, d=d if not dry else 32, steps=2 if dry else 16,
                                                      seed=1) if c.match == "two_stage" else None})
    report = {"benchmark": "eval_two_stage_match", "model": desc if dry else f"trained built-in checkpoint; {desc}",
              "machine": f"{platform.machine()} CPU", "torch": torch.__version__, "settings": result["settings"],
              "full_attention": result["methods"]["full"], "rows": rows}
    hdr = (f"{'method':<44} {'acc':>5} {'agree full':>10} {'agree exact':>11} {'rel err':>8} {'hit':>6} "
           f"{'nearest':>8} {'decision':>8} {'recall':>7} {'rand nearest':>12}")
    print(hdr)
    for r in rows:
        q, z = r["real_queries"], r["random_queries"]
        counts = (f"{q['nearest_rate']:>8.3f} {q['decision_agreement']:>8.3f} {q['exact_hit_recall']:>7.3f} "
                  f"{z['nearest_rate']:>12.3f}") if q else f"{'(the exact match)':>38}"
        print(f"{r['method']:<44} {r['accuracy_mean']:>5.2f} {r['greedy_agreement_vs_full']:>10.3f} "
              f"{r['greedy_agreement_vs_exact']:>11.3f} {r['rel_error_mean']:>8.4f} {r['hit_rate']:>6.3f} {counts}")
    out = args.out or (None if dry else Path(__file__).parent / "results" / "eval_two_stage_match.json")
    if out:
        Path(out).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
