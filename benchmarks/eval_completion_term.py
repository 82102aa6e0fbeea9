"""Why retrieval-completion loses to Top-k alone (issue 40, item 1): the completion term's error per layer and
head against the exact contribution of the unselected middle, split into its normaliser and its numerator.

    python benchmarks/eval_completion_term.py                  # CPU, ~15 min on 2 shared cores
    python benchmarks/eval_completion_term.py --dry-run        # random tiny model, seconds

On the built-in trained checkpoint, the post-RoPE q/k/v of ``--samples`` RULER-style prompts of ``--length``
tokens are captured under full attention (``capture_qkv``); the first ``length - --queries`` tokens are the
prefill ``N``, the last ``--queries`` positions are teacher-forced decode queries (each sees its own causal
prefix, so the generated region is exact as in the method; a prompt a few tokens short of ``--length`` has its
own ``N``). For every layer, query head, budget ``β`` and
feature-map set, with ``k_c`` / ``k_t`` the Top-k that ``β·N`` token-equivalents buy with / without
completion (``budget_top_k``, cache amortised over ``--gen-len`` steps) and ``R`` the exhaustive Top-k of
the mid region ``M``:

* ``U = M \\ R``: the exact unselected middle, ``den_U = Σ_U e^{l_t - m}``, ``o_U = Σ_U e^{l_t-m} v_t / den_U``;
* the completion term ``den_C``, ``o_C`` exactly as the op computes it (fp32 stable cache, one-way clamped
  subtraction of ``R``; ``reference.subtract_retrieved``), and again from an fp64 cache (``*_fp64``);
* ``log_mass_err = log(den_C / den_U)`` (signed; the normaliser), ``share_err = |den_C/(den_E+den_C) -
  den_U/(den_E+den_U)|`` (the completion's share of the softmax denominator), ``dir_err = ||o_C - o_U|| /
  ||o_U||`` (the numerator's direction);
* output errors ``||o - o_full|| / ||o_full||``: ``topk_equal_cost`` (selection-only at ``k_t``),
  ``topk_same_k`` (selection-only at ``k_c``), ``completion`` (at ``k_c``), ``completion_exact_mass``
  (``den_U`` with ``o_C``: only the numerator's error), ``completion_exact_dir`` (``den_C`` with ``o_U``:
  only the normaliser's error).

Feature-map sets: the repository's distilled maps (``--maps``), the untrained Performer initialisation of the
same map at ``F`` and at ``--wide-features`` (positive random features, the estimator the seed cites), and
maps distilled here on the CPU on a cached pool of teacher windows (``distill_loss``): the repository's maps
trained ``--distill-steps`` further, and fresh ones with ``--wide-features`` features for ``--wide-distill-steps``; and
any ``--extra-maps NAME=DIR`` (e.g. maps ``macattn distill-completion`` trained longer or wider on the GPU). Output:
``results/eval_completion_term.json`` (per layer x head x budget x map set) and ``results/eval_completion_term.png``.
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"

_METRICS = ("log_mass_err", "abs_log_mass_err", "share_err", "dir_err", "topk_equal_cost", "topk_same_k",
            "completion", "completion_exact_mass", "completion_exact_dir", "completion_fp64", "mid_share")


def _cache64(lpk_mid: torch.Tensor, v_mid: torch.Tensor):
    """fp64 stable cache of ``lpk_mid [H, M, F]``, ``v_mid [H, M, d]``: ``(A [H, F, d], b [H, F], shift [H, F])``."""
    lp = lpk_mid.double()
    shift = lp.amax(-2)
    w = torch.exp(lp - shift[:, None])
    return w.transpose(-1, -2) @ v_mid.double(), w.sum(-2), shift


def _completion(lpq, lpk_sel, v_sel, cache, m):
    """``(den_C [H, G], num_C [H, G, d])`` relative to the max ``m [H, G]``: ``lpq [H, G, F]``, the retrieved
    rows ``lpk_sel [H, G, k, F]`` / ``v_sel [H, G, k, d]``, ``cache = (A [H, F, d], b [H, F], shift [H, F])``."""
    from macattn.methods.completion.reference import subtract_retrieved

    a, b, sh = (x[:, None] for x in cache)
    a2, b2 = subtract_retrieved(a, b, sh, lpk_sel, v_sel)                      # [H, G, F, d], [H, G, F]
    la = lpq.double() + sh.double() + torch.log(b2)
    w = torch.exp(la - m[..., None])
    vbar = torch.where(b2[..., None] > 0, a2 / b2.clamp_min(1e-300)[..., None], torch.zeros_like(a2))
    return w.sum(-1), torch.einsum("hgf,hgfd->hgd", w, vbar)


@torch.no_grad()
def layer_errors(q, k, v, n_prefill: int, maps, layer: int, *, n_sink: int, n_tail: int, k_comp: int,
                 k_topk: int) -> dict:
    """Per query head, the metrics of the module docstring averaged over the decode queries.

    q ``[Hq, G, d]`` (queries at positions ``n_prefill .. n_prefill + G - 1``), k / v ``[Hkv, T, d]`` with
    ``T = n_prefill + G``. Returns ``{metric: [Hq] list}``."""
    from macattn.methods.completion.reference import build_completion_cache, partition

    Hq, G, d = q.shape
    grp = Hq // k.shape[0]
    scale = maps.spec.attn_scale
    p = partition(n_prefill, n_prefill, n_sink=n_sink, n_tail=n_tail)
    ms, me = p.mid_start, p.mid_end
    kk, vv = k.double().repeat_interleave(grp, 0), v.double().repeat_interleave(grp, 0)   # [Hq, T, d]
    T = kk.shape[1]
    logits = scale * torch.einsum("hgd,htd->hgt", q.double(), kk)
    causal = torch.arange(T)[None, :] <= (n_prefill + torch.arange(G))[:, None]            # [G, T]
    logits = logits.masked_fill(~causal, -math.inf)
    m = logits.amax(-1)                                                                   # [Hq, G]
    e = torch.exp(logits - m[..., None])
    o_full = torch.einsum("hgt,htd->hgd", e, vv) / e.sum(-1, keepdim=True)
    lpk = maps.log_phi_k(layer, k.transpose(0, 1)).transpose(0, 1)                        # [Hkv, T, F]
    lpq = maps.log_phi_q(layer, q.transpose(0, 1)).transpose(0, 1)                        # [Hq, G, F]
    lpk_mid = lpk[:, ms:me].repeat_interleave(grp, 0)                                     # [Hq, M, F]
    cache32 = [x.repeat_interleave(grp, 0) for x in build_completion_cache(lpk[:, ms:me], v[:, ms:me])]
    cache64 = [x.repeat_interleave(grp, 0) for x in _cache64(lpk[:, ms:me], v[:, ms:me])]

    def exact_set(kk_: int):
        idx = logits[..., ms:me].topk(kk_, dim=-1).indices                                # [Hq, G, k]
        sel = torch.zeros(Hq, G, me - ms, dtype=torch.bool).scatter_(-1, idx, True)
        keep = torch.ones(Hq, G, T, dtype=torch.bool)
        keep[..., ms:me] = sel
        return idx, keep

    def rel(o):
        return ((o - o_full).norm(dim=-1) / o_full.norm(dim=-1).clamp_min(1e-30)).mean(-1)

    def sel_only(keep):
        w = e * keep
        return torch.einsum("hgt,htd->hgd", w, vv) / w.sum(-1, keepdim=True)

    idx, keep = exact_set(k_comp)
    wE, wU = e * keep, e * (~keep & causal)
    den_E, num_E = wE.sum(-1), torch.einsum("hgt,htd->hgd", wE, vv)
    den_U, num_U = wU.sum(-1), torch.einsum("hgt,htd->hgd", wU, vv)
    o_U = num_U / den_U.clamp_min(1e-300)[..., None]
    hh = torch.arange(Hq)[:, None, None]
    lpk_sel, v_sel = lpk_mid[hh, idx], vv[hh, ms + idx]
    den_C, num_C = _completion(lpq, lpk_sel, v_sel, cache32, m)
    den_C64, num_C64 = _completion(lpq, lpk_sel, v_sel, cache64, m)
    o_C = num_C / den_C.clamp_min(1e-300)[..., None]
    log_mass = torch.log(den_C.clamp_min(1e-300) / den_U.clamp_min(1e-300))
    out = {
        "log_mass_err": log_mass.mean(-1), "abs_log_mass_err": log_mass.abs().mean(-1),
        "share_err": (den_C / (den_E + den_C) - den_U / (den_E + den_U)).abs().mean(-1),
        "dir_err": ((o_C - o_U).norm(dim=-1) / o_U.norm(dim=-1).clamp_min(1e-30)).mean(-1),
        "mid_share": (den_U / (den_E + den_U)).mean(-1),
        "topk_equal_cost": rel(sel_only(exact_set(k_topk)[1])), "topk_same_k": rel(sel_only(keep)),
        "completion": rel((num_E + num_C) / (den_E + den_C)[..., None]),
        "completion_fp64": rel((num_E + num_C64) / (den_E + den_C64)[..., None]),
        "completion_exact_mass": rel((num_E + den_U[..., None] * o_C) / (den_E + den_U)[..., None]),
        "completion_exact_dir": rel((num_E + den_C[..., None] * o_U) / (den_E + den_C)[..., None]),
    }
    return {key: [float(x) for x in val] for key, val in out.items()}


def distill_on_pool(maps, pool: list, *, steps: int, lr: float, mid: tuple[int, int], n_queries: int,
                    seed: int) -> list[float]:
    """Train ``maps`` in place for ``steps`` AdamW steps of ``distill_loss`` (``macattn distill-completion``'s
    objective), each on one window of the cached teacher ``pool`` (``[(q, k) per layer]`` of ``capture_qkv``),
    drawn with ``seed``. Returns the loss per step."""
    from macattn.apps.distill_completion import distill_loss, teacher_student_logits

    opt = torch.optim.AdamW(maps.parameters(), lr=lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(seed)
    maps.train()
    losses = []
    for _ in range(steps):
        layers = pool[int(torch.randint(len(pool), (1,), generator=g))]
        total = 0.0
        for layer, (q, k) in enumerate(layers):
            z, zs = teacher_student_logits(maps, layer, q, k, mid, n_queries)
            total = total + distill_loss(z, zs)[0] / len(layers)
        opt.zero_grad(set_to_none=True)
        total.backward()
        opt.step()
        losses.append(float(total.detach()))
    return losses


def plot(result: dict, path: Path) -> Path:
    """Per layer (mean over heads) at each budget: output errors of Top-k alone and completion per map set
    (top), completion's |log mass error| and direction error (bottom)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    budgets = result["budgets"]
    fig, axes = plt.subplots(2, len(budgets), figsize=(5.2 * len(budgets), 7.5), squeeze=False)
    mean = lambda rows: [sum(r) / len(r) for r in rows]   # noqa: E731  [L][Hq] -> [L]
    for j, beta in enumerate(budgets):
        cell = result["per_budget"][str(beta)]
        ax, ax2 = axes[0][j], axes[1][j]
        first = next(iter(cell["maps"].values()))
        xs = range(len(first["topk_equal_cost"]))
        ax.plot(xs, mean(first["topk_equal_cost"]), "k-o", lw=2, label=f"Top-k alone, k={cell['k_topk']}")
        ax.plot(xs, mean(first["topk_same_k"]), "k:", label="Top-k alone at completion's k (first map set)")
        for i, (name, st) in enumerate(cell["maps"].items()):
            ax.plot(xs, mean(st["completion"]), marker="s", color=f"C{i}", label=f"completion, {name}")
            ax2.plot(xs, mean(st["abs_log_mass_err"]), marker="s", color=f"C{i}", label=f"|log mass| {name}")
            ax2.plot(xs, mean(st["dir_err"]), ls="--", marker="^", color=f"C{i}", label=f"direction {name}")
        ax.set_yscale("log")
        ax.set_title(f"budget {beta:g}: output rel. error vs full (mean over heads)", fontsize=9)
        ax2.set_yscale("log")
        ax2.set_title("completion term: |log(den_C/den_U)| (solid), ||o_C-o_U||/||o_U|| (dashed)", fontsize=8)
        for a in (ax, ax2):
            a.set_xlabel("layer")
            a.grid(alpha=0.3)
            a.legend(fontsize=6)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    from macattn.evaluation.harness import load_eval_model
    from macattn.evaluation.samples import EvalSettings, make_samples
    from macattn.methods.completion.feature_maps import load_feature_maps, maps_for_model
    from macattn.methods.completion.reference import budget_top_k
    from macattn.models.attention import capture_qkv

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budgets", type=float, nargs="+", default=[0.01, 0.02, 0.05], help="shares of N")
    ap.add_argument("--maps", default=str(RESULTS / "completion_maps_tiny"))
    ap.add_argument("--length", type=int, default=4096, help="prompt length (prefill + queries)")
    ap.add_argument("--samples", type=int, default=4, help="prompts (one per RULER-style task, cycling)")
    ap.add_argument("--queries", type=int, default=32, help="teacher-forced decode queries per prompt")
    ap.add_argument("--gen-len", type=int, default=32, help="steps the completion cache is amortised over")
    ap.add_argument("--n-sink", type=int, default=4)
    ap.add_argument("--n-tail", type=int, default=16)
    ap.add_argument("--wide-features", type=int, default=128, help="F of the wider map sets")
    ap.add_argument("--distill-steps", type=int, default=400, help="CPU steps continuing the repo's maps (0: none)")
    ap.add_argument("--wide-distill-steps", type=int, default=100, help="CPU steps of the fresh wide maps (0: none)")
    ap.add_argument("--distill-windows", type=int, default=6, help="teacher windows cached for it")
    ap.add_argument("--distill-lr", type=float, default=1e-3)
    ap.add_argument("--extra-maps", nargs="+", default=[], metavar="NAME=DIR",
                    help="more distilled map sets to measure (macattn distill-completion's --out folders)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(RESULTS / "eval_completion_term.json"))
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args(argv)
    t0 = time.time()
    torch.set_flush_denormal(True)    # the untrained wide maps' tiny features are denormal: 10x slower without
    if args.dry_run:
        model, encode, hay, bos, desc = load_eval_model("random")
        args.length, args.samples, args.queries, args.distill_windows = 256, 1, 4, 1
        args.distill_steps, args.wide_distill_steps = 2, 2
        args.budgets, args.wide_features = [0.2], 16
        base = maps_for_model(model, feature_dim=8, hidden=16, seed=args.seed)
    else:
        model, encode, hay, bos, desc = load_eval_model("builtin")
        base = load_feature_maps(args.maps)
    spec = base.spec
    N = args.length - args.queries
    tasks = EvalSettings().tasks
    settings = EvalSettings(lengths=(args.length,), tasks=tasks, n=-(-args.samples // len(tasks)), seed=args.seed)
    samples = make_samples(settings, encode, hay, bos)[:args.samples]
    print(f"capturing {len(samples)} prompts of {args.length} tokens", flush=True)
    captured = [[(q[0].float(), k[0].float(), v[0].float())
                 for q, k, v in capture_qkv(model, torch.tensor([s.ids]))] for s in samples]   # <= length tokens

    map_sets = {f"repo (F={spec.feature_dim})": base,
                f"performer init (F={spec.feature_dim})": maps_for_model(model, feature_dim=spec.feature_dim,
                                                                       hidden=spec.hidden, seed=args.seed),
                f"performer init (F={args.wide_features})": maps_for_model(model, feature_dim=args.wide_features,
                                                                         hidden=spec.hidden, seed=args.seed)}
    for item in args.extra_maps:
        name, sep, folder = item.rpartition("=")
        if not sep or not name:
            ap.error(f"--extra-maps takes NAME=DIR, got {item!r}")
        map_sets[name] = load_feature_maps(folder)
    training = {}
    if args.distill_steps or args.wide_distill_steps:
        from macattn.apps.trainer_common import random_windows, step_generator

        corpus = torch.tensor(list(hay), dtype=torch.int64)
        n_q = 16
        mid = (args.n_sink, args.length - n_q - args.n_tail)
        # teacher windows drawn past the evaluation seed's stream (another generator seed)
        wins = random_windows(corpus, args.distill_windows, args.length, step_generator(args.seed + 1, 0))
        pool = [[(q.float(), k.float()) for q, k, _ in capture_qkv(model, w[None])] for w in wins]
        print(f"distilling on {len(pool)} cached windows", flush=True)
        longer = copy.deepcopy(base)
        wide = maps_for_model(model, feature_dim=args.wide_features, hidden=spec.hidden, seed=args.seed)
        for name, mp, steps in ((f"repo + {args.distill_steps} CPU steps (F={spec.feature_dim})", longer,
                                 args.distill_steps),
                                (f"distilled {args.wide_distill_steps} CPU steps (F={args.wide_features})", wide,
                                 args.wide_distill_steps)):
            if not steps:
                continue
            ts = time.time()
            losses = distill_on_pool(mp, pool, steps=steps, lr=args.distill_lr, mid=mid, n_queries=n_q,
                                     seed=args.seed)
            training[name] = dict(loss_first=losses[0], loss_last=losses[-1],
                                  loss_last10=sum(losses[-10:]) / len(losses[-10:]), seconds=time.time() - ts)
            print(f"  {name}: loss {losses[0]:.3f} -> {training[name]['loss_last10']:.3f}", flush=True)
            map_sets[name] = mp.eval()

    d = spec.head_dim
    result = dict(benchmark="eval_completion_term", model=desc, settings=vars(args), torch=torch.__version__,
                  maps_meta={n: dict(feature_dim=m.spec.feature_dim, hidden=m.spec.hidden) for n, m in map_sets.items()},
                  training=training, budgets=args.budgets, per_budget={})
    for beta in args.budgets:
        anchors = args.n_sink + args.n_tail + args.gen_len // 2
        k_of = lambda f, comp: budget_top_k(beta * N, anchors=anchors, feature_dim=f, head_dim=d,  # noqa: E731
                                            gen_len=args.gen_len, completion=comp, mid_len=N)
        k_topk = k_of(spec.feature_dim, False)
        cell = dict(k_topk=k_topk, k_comp={}, maps={})
        for name, mp in map_sets.items():
            kc = cell["k_comp"][name] = k_of(mp.spec.feature_dim, True)
            if kc is None or k_topk is None:
                continue
            acc = {m: [[0.0] * spec.num_q_heads for _ in range(spec.num_layers)] for m in _METRICS}
            for layers in captured:
                n_pre = layers[0][1].shape[1] - args.queries      # the sample's own prompt length minus queries
                for li, (q, k, v) in enumerate(layers):
                    r = layer_errors(q[:, n_pre:], k, v, n_pre, mp, li, n_sink=args.n_sink, n_tail=args.n_tail, k_comp=kc,
                                     k_topk=k_topk)
                    for m_ in _METRICS:
                        for h in range(spec.num_q_heads):
                            acc[m_][li][h] += r[m_][h] / len(captured)
            acc["summary"] = {m_: sum(map(sum, acc[m_])) / (spec.num_layers * spec.num_q_heads) for m_ in _METRICS}
            acc["heads_completion_better"] = sum(acc["completion"][li][h] < acc["topk_equal_cost"][li][h]
                                                 for li in range(spec.num_layers) for h in range(spec.num_q_heads))
            cell["maps"][name] = acc
            s = acc["summary"]
            print(f"b={beta:g} {name:<44} k={kc:>4}  comp {s['completion']:.3f}  topk(k={k_topk}) "
                  f"{s['topk_equal_cost']:.3f}  exact-mass {s['completion_exact_mass']:.3f}  exact-dir "
                  f"{s['completion_exact_dir']:.3f}  |logmass| {s['abs_log_mass_err']:.2f}  dir {s['dir_err']:.2f}  "
                  f"heads better {acc['heads_completion_better']}", flush=True)
        result["per_budget"][str(beta)] = cell
    result["seconds"] = time.time() - t0
    if not args.dry_run:
        out = Path(args.out)
        out.write_text(json.dumps(result, indent=1) + "\n")
        png = plot(result, out.with_suffix(".png"))
        print(f"wrote {out}, {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
