"""Retrieval-completion's fidelity at each KV-read budget on the trained checkpoint (issue 20 item 7, issue 40
item 4): Top-k alone, completion ungated and completion gated at equal token-equivalents.

    python benchmarks/eval_completion_budgets.py --n 3           # CPU, ~14 min on 2 cores (defaults: ~5 min)
    python benchmarks/eval_completion_budgets.py --dry-run       # random tiny model, seconds

``macattn eval``'s RULER-style tasks (``--lengths``, ``--n`` samples per task, ``--gen`` teacher-forced steps)
on the packaged trained checkpoint with its distilled feature maps (``results/completion_maps_tiny``). Per
budget ``β`` (share of the prompt ``N`` in token-equivalents per step and KV head) each variant gets the Top-k
that fits it (``apps.tune.completion_budget_ks``: Top-k alone spends ``anchors + k``; completion also the
amortised cache and ``F/(2d)`` per retrieved token, so it retrieves fewer). The gate of each budget is chosen by
``macattn tune --completion``'s ``tune_completion_gate`` on ``--calibration-n`` calibration prompts of another
sample seed (``--calibration-seed``), never on the evaluated ones; a layer it turns off runs Top-k alone at the
equal-cost Top-k. ``--selectors``: the exhaustive Top-k and/or the page selector (``PageSummaryTopK``: Quest
bounds over ``--page-size`` pages, ``ceil(k / page) x --overfetch`` pages, exact Top-k inside them). Reported:
task accuracy, greedy agreement with full attention, attention-output error, KV read / full, the gates. JSON +
table: ``benchmarks/results/eval_completion_budgets.json``.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from macattn.apps.tune import TuneSettings, calibration_prompts, completion_budget_ks, tune_completion_gate
from macattn.evaluation.harness import EvalSettings, load_eval_model, run_eval
from macattn.evaluation.methods import RetrievalCompletion
from macattn.methods.completion.completion_on_miss import MissCompletionConfig
from macattn.methods.completion.feature_maps import load_feature_maps, maps_for_model
from macattn.methods.completion.reference import PageSummaryTopK

RESULTS = Path(__file__).resolve().parent / "results"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budgets", type=float, nargs="+", default=[0.01, 0.02, 0.05], help="shares of N")
    ap.add_argument("--maps", default=str(RESULTS / "completion_maps_tiny"))
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096])
    ap.add_argument("--n", type=int, default=1, help="samples per task and length")
    ap.add_argument("--gen", type=int, default=32, help="teacher-forced decode steps per sample")
    ap.add_argument("--calibration-n", type=int, default=2, help="calibration prompts of the gate")
    ap.add_argument("--calibration-seed", type=int, default=1, help="their sample seed (the evaluation's is 0)")
    ap.add_argument("--selectors", nargs="+", choices=("exhaustive", "pages"), default=["exhaustive"])
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--overfetch", type=int, default=2)
    ap.add_argument("--n-sink", type=int, default=4)
    ap.add_argument("--n-tail", type=int, default=16)
    ap.add_argument("--out", default=str(RESULTS / "eval_completion_budgets.json"))
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args(argv)
    t0 = time.time()
    if args.dry_run:
        model, encode, hay, bos, desc = load_eval_model("random")
        maps = maps_for_model(model, feature_dim=8, hidden=16)
        args.lengths, args.n, args.gen, args.calibration_n, args.budgets = [256], 1, 3, 1, [0.3]
        settings = EvalSettings(lengths=tuple(args.lengths), tasks=("niah_single",), n=1, gen=args.gen)
    else:
        model, encode, hay, bos, desc = load_eval_model("builtin")
        maps = load_feature_maps(args.maps)
        settings = EvalSettings(lengths=tuple(args.lengths), n=args.n, gen=args.gen)
    spec = maps.spec
    cal_len = args.lengths[0]
    cal = calibration_prompts(model, TuneSettings(lengths=(cal_len,), n=args.calibration_n, gen=args.gen,
                                                  seed=args.calibration_seed), encode, hay, bos,
                              progress=not args.dry_run)
    selectors = {"exhaustive": None, "pages": PageSummaryTopK(args.page_size, args.overfetch)}
    methods, gates = [], {}
    for beta in args.budgets:
        for sel_name in args.selectors:
            sel = selectors[sel_name]
            gate, rep = tune_completion_gate(model, cal, maps=maps, budget=beta, n_sink=args.n_sink,
                                             n_tail=args.n_tail, selector=sel, progress=not args.dry_run)
            gates[f"{beta:g} {sel_name}"] = dict(gate=list(gate.layers), top_k_completion=rep["top_k_completion"],
                                                 top_k_alone=rep["top_k_alone"],
                                                 calibration_error_completion=rep["calibration"]["completion"]["error"],
                                                 calibration_error_topk_alone=rep["calibration"]["topk_alone"]["error"])
            print(f"gate b={beta:g} {sel_name}: {['on' if g else 'off' for g in gate.layers]}", flush=True)
            for length in args.lengths:       # the gate is per layer; each length gets its own budget's Top-k
                kc, kt = completion_budget_ks(beta, length, n_sink=args.n_sink, n_tail=args.n_tail,
                                              gen_len=args.gen, feature_dim=spec.feature_dim, head_dim=spec.head_dim)
                cfg = lambda k: MissCompletionConfig(n_sink=args.n_sink, n_tail=args.n_tail, top_k=k,  # noqa: E731
                                                     feature_dim=spec.feature_dim)
                for kind, k, comp, g in (("top-k alone", kt, False, None), ("completion", kc, True, None),
                                         ("completion gated", kc, True, gate)):
                    methods.append((length, RetrievalCompletion(cfg(k), maps=maps, completion=comp, gen_len=args.gen,
                                                                selector=sel, gate=g,
                                                                name=f"{kind} {sel_name} N={length} b={beta:g} k={k}")))
    rows, raw = [], {}
    print(f"{'method':<50} {'accuracy':>8} {'agree full':>10} {'rel err':>9} {'KV read':>8}")
    for length in args.lengths:
        ms = [m for n, m in methods if n == length]
        res = run_eval(model, ms, EvalSettings(lengths=(length,), tasks=settings.tasks, n=settings.n, gen=settings.gen),
                       encode=encode, haystack_ids=hay, bos=bos, progress=not args.dry_run)
        raw[str(length)] = res
        for m in ms:
            r = res["methods"][m.name]
            rows.append({"method": m.name, "length": length,
                         **{k: r.get(k) for k in ("accuracy_mean", "greedy_agreement", "rel_error_mean",
                                                  "kv_read_fraction")}})
            print(f"{m.name:<50} {r.get('accuracy_mean', float('nan')):>8.3f} "
                  f"{r.get('greedy_agreement', float('nan')):>10.3f} {r.get('rel_error_mean', float('nan')):>9.4f} "
                  f"{r.get('kv_read_fraction', float('nan')):>8.3f}", flush=True)
    if not args.dry_run:
        out = {"benchmark": "eval_completion_budgets", "model": desc, "settings": vars(args), "torch": torch.__version__,
               "samples_per_length": len(settings.tasks) * settings.n, "gates": gates, "rows": rows,
               "full_attention": {n: r["methods"].get("full") for n, r in raw.items()}, "raw": raw,
               "seconds": time.time() - t0}
        Path(args.out).write_text(json.dumps(out, indent=1, default=str) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
