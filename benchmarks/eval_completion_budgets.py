"""Retrieval-completion's fidelity at each KV-read budget on the trained checkpoint (issue 20 item 7, issue 40
item 4): Top-k alone, completion ungated and completion gated at equal token-equivalents.

    python benchmarks/eval_completion_budgets.py --n 4 --calibration-n 4   # CPU, ~25 min on 2 cores
    python benchmarks/eval_completion_budgets.py --device cuda --lengths 16384 --n 1 --gen 128 \
        --selectors exhaustive pages --out $OUT/eval_completion_budgets_16k.json   # GPU
    python benchmarks/eval_completion_budgets.py --device cuda --lengths 16384 --n 3 --gen 128 --calibration-n 4 \
        --selectors pages --budgets 0.01 --variants "top-k alone" "completion gated" --out $OUT/p1.json   # one part
    python benchmarks/eval_completion_budgets.py --merge A.json B.json --out C.json   # runs of disjoint budgets
    python benchmarks/eval_completion_budgets.py --dry-run       # random tiny model, seconds

``macattn eval``'s RULER-style tasks (``--lengths``, ``--n`` samples per task, ``--gen`` teacher-forced steps)
on the packaged trained checkpoint with its distilled feature maps (``results/completion_maps_tiny``). Per
budget ``β`` (share of the prompt ``N`` in token-equivalents per step and KV head) each variant gets the Top-k
that fits it (``apps.tune.completion_budget_ks``: Top-k alone spends ``anchors + k``; completion also the
amortised cache and ``F/(2d)`` per retrieved token, so it retrieves fewer). The gate of each budget is chosen by
``macattn tune --completion``'s ``tune_completion_gate`` on ``--calibration-n`` calibration prompts of another
sample seed (``--calibration-seed``), never on the evaluated ones: the term's mass calibrated per layer and head
on what the Top-k leaves (``--no-mass-calibration``: the maps' own mass, the gate of the first re-run), the layers
chosen on the error, then checked on the calibration prompts' agreement; a layer it turns off runs Top-k alone at
the equal-cost Top-k. ``--selectors``: the exhaustive Top-k and/or the page selector (``PageSummaryTopK``: Quest
bounds over ``--page-size`` pages, ``ceil(k / page) x --overfetch`` pages, exact Top-k inside them). Reported:
task accuracy, greedy agreement with full attention, attention-output error, KV read / full, the gates. JSON +
table: ``benchmarks/results/eval_completion_budgets.json``, figure: the same name with ``.png``.
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
VARIANTS = ("top-k alone", "completion", "completion gated")


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
    ap.add_argument("--no-mass-calibration", action="store_true", help="gate without the calibrated mass")
    ap.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS),
                    help="which of the three to evaluate (the ungated term reads no gate: a re-run of the gate alone "
                         "may leave it out)")
    ap.add_argument("--out", default=str(RESULTS / "eval_completion_budgets.json"))
    ap.add_argument("--device", default="cpu", help="the model's and the maps' device (the references follow it)")
    ap.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                    help="combine runs of disjoint budgets (one process each, e.g. one per GPU) into --out, no model")
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args(argv)
    if args.merge:
        out = merge([json.loads(Path(f).read_text()) for f in args.merge])
        Path(args.out).write_text(json.dumps(out, indent=1, default=str) + "\n")
        print(f"wrote {args.out}, {plot(out['rows'], Path(args.out).with_suffix('.png'))}")
        return 0
    t0 = time.time()
    if args.dry_run:
        model, encode, hay, bos, desc = load_eval_model("random")
        maps = maps_for_model(model, feature_dim=8, hidden=16)
        args.lengths, args.n, args.gen, args.calibration_n, args.budgets = [256], 1, 3, 1, [0.3]
        settings = EvalSettings(lengths=tuple(args.lengths), tasks=("niah_single",), n=1, gen=args.gen)
    else:
        model, encode, hay, bos, desc = load_eval_model("builtin", device=args.device)
        maps = load_feature_maps(args.maps).to(args.device)
        settings = EvalSettings(lengths=tuple(args.lengths), n=args.n, gen=args.gen)
    spec = maps.spec
    selectors = {"exhaustive": None, "pages": PageSummaryTopK(args.page_size, args.overfetch)}
    gates, rows, raw = {}, [], {}
    cfg = lambda k: MissCompletionConfig(n_sink=args.n_sink, n_tail=args.n_tail, top_k=k,  # noqa: E731
                                         feature_dim=spec.feature_dim)
    for length in args.lengths:     # each length and selector: its gates (tuned at that length), then its rows
        cal = calibration_prompts(model, TuneSettings(lengths=(length,), n=args.calibration_n, gen=args.gen,
                                                      seed=args.calibration_seed), encode, hay, bos,
                                  progress=not args.dry_run)
        for sel_name in args.selectors:
            sel, methods = selectors[sel_name], []
            for beta in args.budgets:
                gate, rep = tune_completion_gate(model, cal, maps=maps, budget=beta, n_sink=args.n_sink,
                                                 n_tail=args.n_tail, selector=sel, progress=not args.dry_run,
                                                 calibrate_mass=not args.no_mass_calibration)
                c = rep["calibration"]
                gates[f"{beta:g} {sel_name} N={length}"] = dict(
                    gate=list(gate.layers), log_mass=rep["log_mass"], top_k_completion=rep["top_k_completion"],
                    top_k_alone=rep["top_k_alone"], top_k_gated_off=rep["top_k_gated_off"],
                    calibration_error_completion=c["completion"]["error"],
                    calibration_error_completion_calibrated=c["completion_calibrated"]["error"],
                    calibration_error_topk_alone=c["topk_alone"]["error"], agreement_trail=rep["agreement_trail"])
                print(f"gate b={beta:g} {sel_name} N={length}: {['on' if g else 'off' for g in gate.layers]}",
                      flush=True)
                kc, kt = rep["top_k_completion"], rep["top_k_alone"]
                for kind, k, comp, g in (("top-k alone", kt, False, None), ("completion", kc, True, None),
                                         ("completion gated", kc, True, gate)):
                    if kind not in args.variants:
                        continue
                    methods.append(RetrievalCompletion(cfg(k), maps=maps, completion=comp, gen_len=args.gen,
                                                       selector=sel, gate=g,
                                                       name=f"{kind} {sel_name} N={length} b={beta:g} k={k}"))
            res = run_eval(model, methods, EvalSettings(lengths=(length,), tasks=settings.tasks, n=settings.n,
                                                        gen=settings.gen),
                           encode=encode, haystack_ids=hay, bos=bos, progress=not args.dry_run)
            raw[f"{length} {sel_name}"] = res
            print(f"{'method':<50} {'accuracy':>8} {'agree full':>10} {'rel err':>9} {'KV read':>8}")
            for m in methods:
                r = res["methods"][m.name]
                rows.append({"method": m.name, "length": length,
                             **{k: r.get(k) for k in ("accuracy_mean", "greedy_agreement", "rel_error_mean",
                                                      "kv_read_fraction")}})
                print(f"{m.name:<50} {r.get('accuracy_mean', float('nan')):>8.3f} "
                      f"{r.get('greedy_agreement', float('nan')):>10.3f} {r.get('rel_error_mean', float('nan')):>9.4f} "
                      f"{r.get('kv_read_fraction', float('nan')):>8.3f}", flush=True)
            if not args.dry_run:      # written after every (length, selector): a run cut short keeps what it did
                out = {"benchmark": "eval_completion_budgets", "model": desc, "settings": vars(args),
                       "torch": torch.__version__, "device": str(next(model.parameters()).device),
                       "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
                       "samples_per_length": len(settings.tasks) * settings.n, "gates": gates, "rows": rows,
                       "full_attention": {n: r["methods"].get("full") for n, r in raw.items()}, "raw": raw,
                       "seconds": time.time() - t0}
                Path(args.out).write_text(json.dumps(out, indent=1, default=str) + "\n")
                print(f"wrote {args.out}, {plot(rows, Path(args.out).with_suffix('.png'))}", flush=True)
    return 0


def merge(runs: list[dict]) -> dict:
    """One report from runs of the same lengths, selectors and samples over disjoint budgets: their gates, rows
    and per-(length, selector) methods together; ``settings.budgets`` all of theirs; ``seconds`` the longest run's
    (they ran side by side); ``merged_from`` each run's settings and GPU, ``gpu`` the GPUs of all. Full attention
    is the same in every run (the same prompts and model): the first run's is kept, and a differing one is refused."""
    first = runs[0]
    gpus = sorted({r["gpu"] for r in runs if r.get("gpu")})
    out = {**first, "gates": {}, "rows": [], "raw": {}, "merged_from": [{**r["settings"], "gpu": r.get("gpu")}
                                                                        for r in runs],
           "gpu": ", ".join(gpus) or None, "seconds": max(r["seconds"] for r in runs)}
    out["settings"] = {**first["settings"], "budgets": sorted(b for r in runs for b in r["settings"]["budgets"]),
                       "selectors": sorted({sel for r in runs for sel in r["settings"]["selectors"]})}
    for r in runs:
        clash = set(out["gates"]) & set(r["gates"])
        if clash:
            raise ValueError(f"runs overlap in {sorted(clash)}: merge takes disjoint budgets")
        out["gates"].update(r["gates"])
        out["rows"].extend(r["rows"])
        for key, res in r["raw"].items():
            have = out["raw"].setdefault(key, {**res, "methods": {}})
            full, other = have["methods"].get("full"), res["methods"].get("full")
            if full is not None and other is not None and full.get("accuracy") != other.get("accuracy"):
                raise ValueError(f"{key}: full attention differs between runs (not the same prompts)")
            have["methods"].update(res["methods"])
    out["full_attention"] = {n: r["methods"].get("full") for n, r in out["raw"].items()}
    return out


def plot(rows: list, path: Path) -> Path:
    """Greedy agreement and attention-output error per budget: Top-k alone, completion ungated and gated, one
    panel pair per (length, selector)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def key(name):              # "<kind> <selector> N=<len> b=<beta> k=<k>"
        kind, rest = name.split(" exhaustive " if " exhaustive " in name else " pages ")
        sel = "exhaustive" if " exhaustive " in name else "pages"
        n, b, _ = rest.split()
        return kind, sel, int(n[2:]), float(b[2:])

    groups = sorted({key(r["method"])[1:3] for r in rows})
    fig, axes = plt.subplots(len(groups), 2, figsize=(9, 3.2 * len(groups)), squeeze=False)
    kinds = VARIANTS
    for (sel, n), (ax_a, ax_e) in zip(groups, axes):
        for j, kind in enumerate(kinds):
            pts = sorted((key(r["method"])[3], r) for r in rows if key(r["method"])[:3] == (kind, sel, n))
            xs = [i + (j - 1) * 0.27 for i in range(len(pts))]
            ax_a.bar(xs, [r["greedy_agreement"] for _, r in pts], 0.27, label=kind, color=f"C{j}")
            ax_e.bar(xs, [r["rel_error_mean"] for _, r in pts], 0.27, label=kind, color=f"C{j}")
            for ax in (ax_a, ax_e):
                ax.set_xticks(range(len(pts)), [f"{b:.0%}" for b, _ in pts])
        ax_a.set_ylabel(f"greedy agreement\n{sel}, N={n}")
        ax_e.set_ylabel("attention-output rel. error")
        ax_a.set_ylim(0, 1)
        ax_a.legend(fontsize=7, loc="lower right")
    for ax in axes[-1]:
        ax.set_xlabel("KV-read budget (token-equivalents / N)")
    fig.suptitle("Retrieval-completion vs Top-k alone at equal token-equivalents", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


if __name__ == "__main__":
    sys.exit(main())
