"""The calibrated match threshold against the paper's global tau, at equal greedy agreement.

    python benchmarks/eval_calibrated_threshold.py                      # CPU, trained checkpoint (~6 min, 1 thread)
    python benchmarks/eval_calibrated_threshold.py --device cuda --n 4 --gen 256 --lengths 4096,8192   # H100
    python benchmarks/eval_calibrated_threshold.py --dry-run            # tiny random model, seconds

Query scales (``macattn.evaluation.calibration``) come from ``macattn tune``'s calibration prompts; every
method is then evaluated by ``macattn eval``'s harness (task accuracy, greedy agreement, error, hit, skip)
on other prompts (sample seed ``--seed``, default 1; the calibration prompts use seed 0). Rows: MAC under
the paper's rule and under the calibrated one at several tau, and the two-stage match (E4M3 sketch,
4 candidates) next to the exact match at one tau of each rule. The comparison at equal agreement
interpolates each rule's skip linearly in agreement between its measured taus (``skip_at_agreement``).
JSON + PNG (skip vs agreement) in ``benchmarks/results/eval_calibrated_threshold.{json,png}``.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from macattn.apps.tune import TuneSettings, calibration_prompts
from macattn.evaluation.calibration import calibrate_match_scales
from macattn.evaluation.harness import EvalSettings, load_eval_model, parse_csv, run_eval
from macattn.evaluation.methods import Mac
from macattn.methods.mac.config import MacConfig


def skip_at_agreement(points: list[tuple[float, float]], agreement: float) -> float | None:
    """Skip of a rule at ``agreement``, linear between its measured ``(agreement, skip)`` points (None
    outside their range). Where agreement is not monotone in skip, the largest skip reaching it is taken."""
    best = None
    pts = sorted(points)
    for (a0, s0), (a1, s1) in zip(pts, pts[1:]):
        if a0 <= agreement <= a1:
            s = s0 if a1 == a0 else s0 + (s1 - s0) * (agreement - a0) / (a1 - a0)
            best = s if best is None else max(best, s)
    for a, s in pts:
        if a >= agreement - 1e-12:
            best = s if best is None else max(best, s)
    return best


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="trained")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--lengths", default="4096")
    p.add_argument("--n", type=int, default=1, help="evaluation samples per task and length")
    p.add_argument("--gen", type=int, default=64)
    p.add_argument("--calibration-n", type=int, default=4, help="calibration prompts per length")
    p.add_argument("--seed", type=int, default=1, help="sample seed of the evaluation prompts (calibration: 0)")
    p.add_argument("--paper-taus", default="0.45,0.6,0.75,0.85")
    p.add_argument("--calibrated-taus", default="0.6,0.75,0.85")
    p.add_argument("--two-stage-tau", type=float, default=0.75)
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--band", type=int, default=256)
    p.add_argument("--out", default="benchmarks/results/eval_calibrated_threshold.json")
    p.add_argument("--dry-run", action="store_true", help="tiny random model, short prompts (a smoke test)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    t0 = time.time()
    if args.dry_run:
        from macattn.evaluation.harness import byte_encoder
        from macattn.models.builtin import build_builtin_model

        model = build_builtin_model("llama", seed=0, num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=16)
        encode, bos, desc = byte_encoder(model.config.vocab_size), [], "haystack: uniform random ids"
        hay = torch.randint(300, model.config.vocab_size, (4096,), generator=torch.Generator().manual_seed(1)).tolist()
        lengths, gen, window, band = (256,), 4, 64, 16
    else:
        model, encode, hay, bos, desc = load_eval_model(args.model, haystack=None, device=args.device)
        lengths, gen, window, band = parse_csv(args.lengths, int), args.gen, args.window, args.band
    cal = calibration_prompts(model, TuneSettings(lengths=lengths, n=args.calibration_n, gen=2), encode, hay, bos,
                              progress=False)
    scales = calibrate_match_scales(model, [q for q, _ in cal])
    base = MacConfig(window=window, band=band)
    methods, rule = [], {}
    for t in parse_csv(args.paper_taus, float):
        m = Mac(replace(base, tau=t), gen_len=gen)
        methods.append(m)
        rule[m.name] = ("paper", t, "exact")
    for t in parse_csv(args.calibrated_taus, float):
        m = Mac(replace(base, tau=t).with_match_scales(scales), gen_len=gen)
        methods.append(m)
        rule[m.name] = ("calibrated", t, "exact")
    t2 = args.two_stage_tau
    for cal_rule in ("paper", "calibrated"):
        cfg = replace(base, tau=t2, match="two_stage", match_sketch="fp8", match_candidates=4)
        m = Mac(cfg.with_match_scales(scales) if cal_rule == "calibrated" else cfg, gen_len=gen)
        methods.append(m)
        rule[m.name] = (cal_rule, t2, "two_stage(fp8,c=4)")
    settings = EvalSettings(lengths=lengths, n=args.n, gen=gen, seed=args.seed)
    res = run_eval(model, methods, settings, encode=encode, haystack_ids=hay, bos=bos, progress=False)
    rows = []
    for name, e in res["methods"].items():
        r, t, match = rule.get(name, ("full", None, None))
        rows.append(dict(method=name, rule=r, tau=t, match=match, accuracy_mean=e["accuracy_mean"],
                         greedy_agreement=e.get("greedy_agreement", 1.0), rel_error_mean=e.get("rel_error_mean", 0.0),
                         hit_rate=e.get("hit_rate"), kv_skip=e.get("kv_skip", 0.0),
                         skip_per_layer=e.get("skip_per_layer"), hit_rate_per_layer=e.get("hit_rate_per_layer")))
    curves = {r: [(x["greedy_agreement"], x["kv_skip"]) for x in rows if x["rule"] == r and x["match"] == "exact"]
              for r in ("paper", "calibrated")}
    compare = []
    for a in sorted({a for a, _ in curves["paper"] + curves["calibrated"]}):
        sp, sc = skip_at_agreement(curves["paper"], a), skip_at_agreement(curves["calibrated"], a)
        compare.append(dict(agreement=a, skip_paper=sp, skip_calibrated=sc,
                            calibrated_minus_paper=None if sp is None or sc is None else sc - sp))
    out = dict(benchmark="eval_calibrated_threshold", model=("tiny random (dry run)" if args.dry_run else args.model),
               haystack=desc, device=str(next(model.parameters()).device),
               machine=f"{platform.machine()} {'CPU' if args.device == 'cpu' else args.device}, "
                       f"{torch.get_num_threads()} threads",
               torch=torch.__version__, settings=res["settings"], window=window, band=band,
               calibration_prompts=len(cal), evaluation_seed=args.seed, match_scales=scales, rows=rows,
               skip_at_equal_agreement=compare, seconds=round(time.time() - t0, 1))
    path = Path(args.out) if not args.dry_run else Path(tempfile.gettempdir()) / "eval_calibrated_threshold_dry.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"{'method':<58}{'acc':>6}{'agree':>7}{'err':>9}{'hit':>7}{'skip':>7}")
    for r in rows:
        hit = "-" if r["hit_rate"] is None else f"{r['hit_rate']:.3f}"
        print(f"{r['method']:<58}{r['accuracy_mean']:>6.3f}{r['greedy_agreement']:>7.3f}{r['rel_error_mean']:>9.2e}"
              f"{hit:>7}{r['kv_skip']:>7.3f}")
    print("skip at equal agreement (paper / calibrated):")
    for c in compare:
        f = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
        print(f"  agreement {c['agreement']:.3f}: {f(c['skip_paper'])} / {f(c['skip_calibrated'])}")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6.5, 4.4))
        for r, mk in (("paper", "o-"), ("calibrated", "s-")):
            pts = sorted((x["kv_skip"], x["greedy_agreement"], x["tau"]) for x in rows
                         if x["rule"] == r and x["match"] == "exact")
            ax.plot([q[0] for q in pts], [q[1] for q in pts], mk, label=f"{r} threshold (exact match)")
            for s_, a_, t_ in pts:
                ax.annotate(f"{t_}", (s_, a_), fontsize=7, textcoords="offset points", xytext=(3, 3))
        for x in rows:
            if x["match"] and x["match"].startswith("two_stage"):
                ax.scatter([x["kv_skip"]], [x["greedy_agreement"]], marker="x", s=60,
                           label=f"{x['rule']} two-stage (fp8, c=4), tau={x['tau']}")
        ax.set_xlabel("KV skip")
        ax.set_ylabel("greedy agreement with full attention")
        ax.set_title(f"calibrated vs paper threshold ({out['model']}, {out['device']})", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(path.with_suffix(".png"), dpi=110)
        print(f"wrote {path}, {path.with_suffix('.png')}")
    except ImportError:
        print(f"wrote {path} (no matplotlib: no PNG)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
