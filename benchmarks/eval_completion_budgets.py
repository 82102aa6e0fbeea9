"""Retrieval-completion's fidelity at each KV-read budget on the trained checkpoint (issue 20, item 7):
completion vs Top-k-only, the page selector vs the exhaustive one.

    python benchmarks/eval_completion_budgets.py                 # CPU, ~10 min on 2 cores
    python benchmarks/eval_completion_budgets.py --dry-run       # random tiny model, seconds

``macattn eval``'s RULER-style tasks (quick preset: 4K, one sample per task, 32 teacher-forced steps)
on the packaged trained checkpoint with its distilled feature maps (``results/completion_maps_tiny``).
Per budget ``β`` (share of the prefill ``N`` in token-equivalents per step and KV head) each variant
gets the Top-k that fits it (``budget_top_k``: selection-only spends ``anchors + k``; completion
also the amortised cache and ``F/(2d)`` per retrieved token), and runs with the exhaustive selector
and with the page selector (``PageSummaryTopK``: Quest bounds over ``--page-size`` pages, ``ceil(k /
page) x --overfetch`` pages, exact Top-k inside them). Reported: task accuracy, greedy agreement with
full attention, attention-output error, KV read / full. JSON + table:
``benchmarks/results/eval_completion_budgets.json``.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from macattn.evaluation.harness import EvalSettings, load_eval_model, run_eval
from macattn.evaluation.methods import RetrievalCompletion
from macattn.methods.completion.reference import PageSummaryTopK, budget_top_k
from macattn.methods.completion.completion_on_miss import MissCompletionConfig

RESULTS = Path(__file__).resolve().parent / "results"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budgets", type=float, nargs="+", default=[0.02, 0.05], help="shares of N")
    ap.add_argument("--maps", default=str(RESULTS / "completion_maps_tiny"))
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--overfetch", type=int, default=2)
    ap.add_argument("--n-sink", type=int, default=4)
    ap.add_argument("--n-tail", type=int, default=16)
    ap.add_argument("--out", default=str(RESULTS / "eval_completion_budgets.json"))
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args(argv)
    if args.dry_run:
        model, encode, hay, bos, desc = load_eval_model("random")
        settings, maps = EvalSettings(lengths=(160,), tasks=("niah_single",), n=1, gen=2), None
        args.budgets = [0.5]
    else:
        from macattn.methods.completion.feature_maps import load_feature_maps

        model, encode, hay, bos, desc = load_eval_model("trained")
        settings, maps = EvalSettings(lengths=(4096,), n=1, gen=32), load_feature_maps(args.maps)
    N = settings.lengths[0]
    d = model.config.hidden_size // model.config.num_attention_heads
    F = maps.spec.feature_dim if maps is not None else 64
    methods = []
    for beta in args.budgets:
        for completion in (True, False):
            k = budget_top_k(beta * N, anchors=args.n_sink + args.n_tail + settings.gen // 2, feature_dim=F,
                             head_dim=d, gen_len=settings.gen, completion=completion, mid_len=N)
            if k is None:
                continue
            cfg = MissCompletionConfig(n_sink=args.n_sink, n_tail=args.n_tail, top_k=k, feature_dim=F)
            kind = "completion" if completion else "top-k only"
            for sel_name, sel in (("exhaustive", None), ("pages", PageSummaryTopK(args.page_size, args.overfetch))):
                methods.append(RetrievalCompletion(cfg, maps=maps, completion=completion, gen_len=settings.gen,
                                                   selector=sel, name=f"{kind} {sel_name} b={beta:g} k={k}"))
    res = run_eval(model, methods, settings, encode=encode, haystack_ids=hay, bos=bos, progress=not args.dry_run)
    rows = []
    print(f"{'method':<40} {'accuracy':>8} {'agree full':>10} {'rel err':>9} {'KV read':>8}")
    for m in methods:
        r = res["methods"][m.name]
        rows.append({"method": m.name, **{k: r.get(k) for k in ("accuracy_mean", "greedy_agreement", "rel_error_mean",
                                                                 "kv_read_fraction")}})
        print(f"{m.name:<40} {r.get('accuracy_mean', float('nan')):>8.3f} {r.get('greedy_agreement', float('nan')):>10.3f} "
              f"{r.get('rel_error_mean', float('nan')):>9.4f} {r.get('kv_read_fraction', float('nan')):>8.3f}")
    if not args.dry_run:
        out = {"benchmark": "eval_completion_budgets", "model": desc, "settings": vars(args), "torch": torch.__version__,
               "full_attention": res["methods"].get("full"), "rows": rows, "raw": res}
        Path(args.out).write_text(json.dumps(out, indent=1, default=str) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
