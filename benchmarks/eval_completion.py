"""Retrieval-completion vs selection-only Top-k at matched token-equivalent KV-read budgets (CPU).

    python3 benchmarks/eval_completion.py                         # built-in model (+ trained checkpoint if present)
    python3 benchmarks/eval_completion.py --maps DIR --ckpt-maps DIR2   # distilled maps instead of training here

Protocol (paper §6-7, App. D/H; docs/spec.md §3):

* model: the built-in LLaMA (random weights, ``macattn.models.builtin``) and, when present, the trained
  tiny LLaMA (``macattn.models.checkpoint``; ``--model-dir``). Text: Python stdlib docstrings
  (``finetune_mka.stdlib_corpus``) for the built-in model, the checkpoint's ``heldout.txt`` for the
  trained one; the first 85 % of the token stream trains the maps, evaluation windows come from
  the rest;
* a window = ``N`` prefill tokens + ``Q`` decode positions; the frozen model runs once with full
  attention and post-RoPE q/k/v of every layer are captured. The decode query at position
  ``N + j`` sees the prefill (sink ``n_sink``, tail ``n_tail``, mid between) and ``j + 1``
  generated tokens; its attention output per (layer, query head) is computed by full attention,
  selection-only Top-k (renormalised) and Top-k + completion (``macattn.methods.completion.reference``);
* budgets ``β ∈ {1..5} %`` of ``N`` token-equivalents per step and KV head. Selection-only
  retrieves ``k = β·N - anchors``; completion ``k = (β·N - anchors - cache/G) / (1 + F/(2d))``
  where ``cache = (F·d + 2F)/(2d)`` is the one-time cache fetch amortised over ``G`` generated
  tokens (``--gen-len``; G = 1 is the paper's worst case, also reported) and ``F/(2d)`` per
  retrieved token pays for reading its ``log φ_k`` row (``macattn.methods.completion.reference.budget_top_k``);
* the same two with the Quest-style page selector (``PageSummaryTopK``: per-page key bounds, the
  ``ceil(k / page) x overfetch`` best pages, exact Top-k inside them) at the exhaustive selector's ``k``;
* error: ``‖o - o_full‖ / ‖o_full‖`` averaged over queries and windows, per (layer, query head);
  mid-normalised entropy ``H_M = -Σ_{t∈M} p_t log p_t / log|M|`` with ``p`` the teacher softmax
  restricted to the mid region; gain = error(selection) - error(completion).

Feature maps are distilled here for ``--train-steps`` steps (``macattn.apps.distill_completion``) unless
``--maps`` is given. Writes ``benchmarks/results/eval_completion.{json,png}``.
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

from macattn.models.checkpoint import builtin_checkpoint_available, BUILTIN_CHECKPOINT_DIR
from macattn.methods.completion.reference import (PageSummaryTopK, budget_top_k, build_completion_cache, full_attention_step, hybrid_decode_step,
                                token_equivalents)
from macattn.methods.completion.feature_maps import load_feature_maps
from macattn.models.attention import capture_qkv
from macattn.apps.distill_completion import DistillConfig, distill, load_model_and_tokens, maps_for_model

RESULTS = Path(__file__).resolve().parent / "results"


def _windows(tokens: torch.Tensor, n: int, length: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, tokens.numel() - length, (n,), generator=g).tolist()
    return [tokens[s:s + length] for s in starts]


@torch.no_grad()
def evaluate_model(model, tokens, maps, args, budgets) -> dict:
    hf = model.config
    n_layers, hq, hkv = hf.num_hidden_layers, hf.num_attention_heads, hf.num_key_value_heads
    d = maps.spec.head_dim
    f = maps.spec.feature_dim
    npf, nq = args.prefill, args.queries
    mid_len = npf - args.n_sink - args.n_tail
    methods = {"selection": [], "completion": [], "completion_worst": [], "selection_pages": [],
               "completion_pages": []}
    ks = {m: [] for m in methods}
    pages = PageSummaryTopK(args.page_size, args.page_overfetch)
    for beta in budgets:
        btok = beta * npf
        anchors = args.n_sink + args.n_tail + nq // 2   # generated tokens: mean over the Q decode positions
        ks["selection"].append(budget_top_k(btok, anchors=anchors, feature_dim=f, head_dim=d, completion=False,
                                            mid_len=mid_len))
        ks["completion"].append(budget_top_k(btok, anchors=anchors, feature_dim=f, head_dim=d, completion=True,
                                             gen_len=args.gen_len, mid_len=mid_len))
        ks["completion_worst"].append(budget_top_k(btok, anchors=anchors, feature_dim=f, head_dim=d, completion=True,
                                                   gen_len=1, mid_len=mid_len))
        # the page selector at the exhaustive one's k (its bounds, 2 d per page and KV head, are read besides)
        ks["selection_pages"].append(ks["selection"][-1])
        ks["completion_pages"].append(ks["completion"][-1])
    err = {m: torch.zeros(len(budgets), n_layers, hq, dtype=torch.float64) for m in methods}
    ent = torch.zeros(n_layers, hq, dtype=torch.float64)
    share = torch.zeros(len(budgets), n_layers, hq, dtype=torch.float64)   # completion mass share (App. H.5)
    wins = _windows(tokens, args.windows, npf + nq, args.seed + 17)
    seq_lens = torch.arange(npf + 1, npf + nq + 1)
    n_prefill = torch.full((nq,), npf)
    for ids in wins:
        for layer, (q, k, v) in enumerate(capture_qkv(model, ids[None])):
            qd = q[0, :, npf:npf + nq].transpose(0, 1).double()              # [Q, Hq, d]
            kc = k[0].double().expand(nq, -1, -1, -1)                           # [Q, Hkv, T, d]
            vc = v[0].double().expand(nq, -1, -1, -1)
            full = full_attention_step(qd, kc, vc, seq_lens)
            s = maps.spec.attn_scale
            grp = hq // hkv
            lm = s * torch.einsum("qhd,htd->qht", qd, k[0, :, args.n_sink:npf - args.n_tail].double()
                                  .repeat_interleave(grp, 0))
            p = torch.softmax(lm, -1)
            ent[layer] += (-(p * torch.log(p.clamp_min(1e-300))).sum(-1) / math.log(mid_len)).mean(0) / len(wins)
            lpq = maps.log_phi_q(layer, qd.float())                              # [Q, Hq, F]
            lpk = maps.log_phi_k(layer, k[0].transpose(0, 1).float()).transpose(0, 1)   # [Hkv, T, F]
            a, b, c = build_completion_cache(lpk[:, args.n_sink:npf - args.n_tail],
                                             v[0, :, args.n_sink:npf - args.n_tail])
            comp = (lpq, lpk.expand(nq, -1, -1, -1), a.expand(nq, -1, -1, -1), b.expand(nq, -1, -1),
                    c.expand(nq, -1, -1))
            fn = full.norm(dim=-1).clamp_min(1e-12)
            for bi in range(len(budgets)):
                for m in methods:
                    kk = ks[m][bi]
                    if kk is None:
                        err[m][bi, layer] = math.nan
                        continue
                    o, parts = hybrid_decode_step(qd, kc, vc, seq_lens, n_prefill, n_sink=args.n_sink,
                                                  n_tail=args.n_tail, top_k=kk,
                                                  selector=pages if m.endswith("_pages") else None,
                                                  completion=None if m.startswith("selection") else comp,
                                                  return_parts=True)
                    err[m][bi, layer] += ((o - full).norm(dim=-1) / fn).mean(0) / len(wins)
                    if m == "completion":
                        sh = torch.sigmoid(parts["lse_comp"] - parts["lse_exact"])
                        share[bi, layer] += sh.mean(0) / len(wins)
    te = lambda k, comp, g: None if k is None else token_equivalents(  # noqa: E731
        exact_tokens=args.n_sink + args.n_tail + nq // 2 + k, feature_dim=f, head_dim=d, gen_len=g, retrieved=k,
        completion=comp)["total"]
    per_budget = []
    for bi, beta in enumerate(budgets):
        row = {"budget_fraction": beta, "budget_tokens": beta * npf}
        for m in methods:
            e = err[m][bi]
            g = 1 if m == "completion_worst" else args.gen_len
            row[m] = {"top_k": ks[m][bi], "token_equivalents": te(ks[m][bi], not m.startswith("selection"), g),
                      "mean_rel_error": None if ks[m][bi] is None else float(e.mean()),
                      "per_head_rel_error": None if ks[m][bi] is None else e.tolist()}
        gain = err["selection"][bi] - err["completion"][bi]
        row["gain_per_head"] = gain.tolist()
        row["heads_improved"] = int((gain > 0).sum())
        row["completion_mass_share_per_head"] = share[bi].tolist()
        per_budget.append(row)
    return {"mid_entropy_per_head": ent.tolist(), "budgets": per_budget, "mid_len": mid_len,
            "layers": n_layers, "q_heads": hq, "kv_heads": hkv, "head_dim": d}


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(results)
    fig, axes = plt.subplots(len(models), 2, figsize=(12, 4.6 * len(models)), squeeze=False)
    for r, name in enumerate(models):
        res = results[name]
        bud = res["budgets"]
        x = [100 * b["budget_fraction"] for b in bud]
        ax = axes[r][0]
        for m, style in (("selection", "o-"), ("completion", "s-"), ("completion_worst", "^--"),
                         ("selection_pages", "o:"), ("completion_pages", "s:")):
            y = [b[m]["mean_rel_error"] if b[m]["mean_rel_error"] is not None else float("nan") for b in bud]
            lab = {"selection": "Top-k only (renormalised)", "completion": f"Top-k + completion (G={res['gen_len']})",
                   "completion_worst": "Top-k + completion (G=1, worst case)",
                   "selection_pages": "Top-k only, page selector", "completion_pages": "Top-k + completion, page selector"}[m]
            ax.plot(x, y, style, label=lab)
        ax.set_xlabel("token-equivalent KV-read budget per step and KV head (% of prefill N)")
        ax.set_ylabel("mean relative L2 error vs full attention")
        ax.set_title(f"{name}: error at matched budget (N={res['prefill']})")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        ax = axes[r][1]
        ent = torch.tensor(res["mid_entropy_per_head"]).flatten()
        cmap = plt.get_cmap("viridis")
        for i, b in enumerate(bud):
            gain = torch.tensor(b["gain_per_head"]).flatten()
            ax.scatter(ent, gain, s=14, color=cmap(i / max(1, len(bud) - 1)), label=f"{100 * b['budget_fraction']:.0f}%")
        ax.axhline(0, color="k", lw=0.8)
        ax.set_xlabel("mid-normalised attention entropy H_M (per layer x query head)")
        ax.set_ylabel("gain = err(Top-k) - err(Top-k + completion)")
        ax.set_title(f"{name.split(' ')[0]}: gain vs mid entropy (dot = layer x head)")
        ax.grid(alpha=0.3)
        ax.legend(title="budget", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(RESULTS / "eval_completion.json"))
    ap.add_argument("--png", default=str(RESULTS / "eval_completion.png"))
    ap.add_argument("--model-dir", default=None, help="trained checkpoint (default: the packaged one when present)")
    ap.add_argument("--no-checkpoint", action="store_true", help="evaluate only the built-in random-weight model")
    ap.add_argument("--maps", default=None, help="distilled maps dir (feature_maps.safetensors) for the built-in model")
    ap.add_argument("--ckpt-maps", default=None, help="distilled maps dir for the trained checkpoint")
    ap.add_argument("--prefill", type=int, default=4096, help="prefill length N")
    ap.add_argument("--queries", type=int, default=8, help="decode positions per window")
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--n-sink", type=int, default=4)
    ap.add_argument("--n-tail", type=int, default=16)
    ap.add_argument("--features", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--gen-len", type=int, default=128, help="generation length G the cache fetch is amortised over")
    ap.add_argument("--train-steps", type=int, default=80)
    ap.add_argument("--train-seq-len", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--page-size", type=int, default=16, help="page selector (Quest bounds): tokens per page")
    ap.add_argument("--page-overfetch", type=int, default=2, help="page selector: pages kept = ceil(k / page) x this")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    budgets = [0.01, 0.02, 0.03, 0.04, 0.05]
    torch.manual_seed(args.seed)
    todo = [("builtin-llama (random weights)", None)]
    ckpt = args.model_dir or (str(BUILTIN_CHECKPOINT_DIR) if builtin_checkpoint_available() else None)
    if ckpt and not args.no_checkpoint:
        todo.append(("tiny_llama (trained)", ckpt))
    results, t0 = {}, time.time()
    for name, mdir in todo:
        t1 = time.time()
        text = Path(mdir) / "heldout.txt" if mdir else None   # the checkpoint's own held-out text when shipped
        model, tokens = load_model_and_tokens(model_dir=mdir, seed=args.seed,
                                              corpus=str(text) if text is not None and text.is_file() else None)
        cut = int(0.85 * tokens.numel())
        train, held = tokens[:cut], tokens[cut:]
        given = args.ckpt_maps if mdir else args.maps
        if given:
            maps, train_rep = load_feature_maps(given), {"loaded": given}
        else:
            maps = maps_for_model(model, feature_dim=args.features, hidden=args.hidden, seed=args.seed)
            cfg = DistillConfig(steps=args.train_steps, batch=1, seq_len=args.train_seq_len, n_queries=16,
                                n_sink=args.n_sink, n_tail=args.n_tail, lr=1e-2, save_every=10 ** 6, seed=args.seed)
            with tempfile.TemporaryDirectory() as tmp:
                rep = distill(model, train, cfg, maps, tmp, progress=not args.no_progress)
            train_rep = {"steps": cfg.steps, "seq_len": cfg.seq_len, "loss_first": rep["losses"][0],
                         "loss_last": rep["losses"][-1], "loss_last10_mean": sum(rep["losses"][-10:]) / 10,
                         "parts_first": rep["parts_first"], "parts_last": rep["parts_last"],
                         "log_partition_bias_removed_mean": float(torch.tensor(rep["log_partition_bias_removed"]).mean())}
        maps.eval()
        res = evaluate_model(model, held, maps, args, budgets)
        res.update(prefill=args.prefill, gen_len=args.gen_len, training=train_rep, seconds=time.time() - t1,
                   feature_dim=args.features, hidden=args.hidden)
        results[name] = res
        print(f"{name}: N={args.prefill}, entropy mean {torch.tensor(res['mid_entropy_per_head']).mean():.3f}")
        for b in res["budgets"]:
            fmt = lambda m: "  -  " if b[m]["mean_rel_error"] is None else f"{b[m]['mean_rel_error']:.4f} (k={b[m]['top_k']})"  # noqa: E731
            print(f"  budget {100 * b['budget_fraction']:.0f}%: top-k {fmt('selection')}  completion {fmt('completion')}"
                  f"  completion G=1 {fmt('completion_worst')}  heads improved {b['heads_improved']}"
                  f"  | page selector: top-k {fmt('selection_pages')}  completion {fmt('completion_pages')}")
    out = {"protocol": __doc__, "args": vars(args), "budgets": budgets, "results": results,
           "versions": {"torch": torch.__version__, "python": platform.python_version()},
           "device": "cpu", "seconds": time.time() - t0}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    plot(results, Path(args.png))
    print(f"wrote {args.out} and {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
