"""``macattn recurrence``: how often a model's pre-RoPE queries recur (MAC paper Fig. 5), without running MAC.

One full-attention forward per prompt captures every layer's pre-RoPE query (the ``q_proj``
output). For each of the prompt's last ``positions`` tokens ``m`` and each query head, the nearest
pre-RoPE query among positions ``[m - K, m - 1]`` (what a ring of capacity ``K`` holds when MAC
decodes these tokens) is an *oracle hit* at ``tau`` iff its distance is below ``sqrt(2d)(1 - tau)``
and ``p - r >= 0`` (docs/spec.md §1.1). The oracle hit rate is MAC's hit rate if it decoded these tokens
with exact upstream layers (with MAC in the loop, deeper layers' queries move a little); the skip
is docs/spec.md §1.5's ``E[(p - r)_+ / m]``. Because it needs no decode loop it sweeps thresholds and windows
over many checkpoints in seconds: it tells whether a model has the recurrence MAC relies on
before any fidelity run.

Per layer it reports, for every ``(tau, K)``: hit rate and skip; for the largest window: median
reuse gap of hits at each ``tau``, the query RMS per dimension (the isotropic null of the paper's
threshold assumes 1) and quantiles of the nearest distance in units of ``sqrt(2d)``.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import torch

from macattn.core.threshold import match_threshold
from macattn.models.attention import capture_pre_rope_queries
from macattn.models.names import BUILTIN_NAMES
from tqdm.auto import tqdm

__all__ = ["RecurrenceSettings", "nearest_in_window", "query_recurrence", "plot", "run_command"]


@dataclass(frozen=True)
class RecurrenceSettings:
    """taus: thresholds in [0, 1); windows: ring capacities K >= 1; band: r >= 0; positions: how many
    final tokens of each prompt are scored (>= 1)."""

    taus: tuple = (0.3, 0.45, 0.6, 0.75)
    windows: tuple = (256, 1024, 4096)
    band: int = 256
    positions: int = 512

    def __post_init__(self):
        if not self.taus or any(not 0.0 <= float(t) < 1.0 for t in self.taus):
            raise ValueError(f"taus must be non-empty values in [0, 1), got {self.taus}")
        if not self.windows or any(isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in self.windows):
            raise ValueError(f"windows must be non-empty ints >= 1, got {self.windows}")
        if isinstance(self.band, bool) or not isinstance(self.band, int) or self.band < 0:
            raise ValueError(f"band must be an int >= 0, got {self.band!r}")
        if isinstance(self.positions, bool) or not isinstance(self.positions, int) or self.positions < 1:
            raise ValueError(f"positions must be an int >= 1, got {self.positions!r}")


def nearest_in_window(q: torch.Tensor, first: int, windows: Sequence[int], block: int = 256
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Nearest earlier query within each window.

    q: ``[H, T, d]`` (any float dtype; distances in fp32). For every ``m`` in ``[first, T)`` and window
    ``K``: ``dist[k, h, m - first]`` is ``min_{m-K <= p < m} ||q[h, m] - q[h, p]||`` (``inf`` if ``m = 0``)
    and ``pos[k, h, m - first]`` the ``p`` attaining it (``-1`` if none). Returns ``(dist [len(windows), H,
    T - first] fp32, pos [...] int64)``. Repeats of a token have equal layer-0 queries (distance ~0 up to
    rounding), and which repeat wins is arbitrary, as in the ring: with ``K`` near the prompt length it
    may lie before ``r`` and count as a miss.
    """
    if q.dim() != 3:
        raise ValueError(f"q must be [H, T, d], got {tuple(q.shape)}")
    H, T, _ = q.shape
    if not 0 <= first < T:
        raise ValueError(f"first must lie in [0, T-1] = [0, {T - 1}], got {first}")
    q = q.float()
    kmax = max(windows)
    n = T - first
    dist = torch.full((len(windows), H, n), float("inf"), device=q.device)
    pos = torch.full((len(windows), H, n), -1, dtype=torch.int64, device=q.device)
    for m0 in range(first, T, block):
        m1 = min(T, m0 + block)
        c0 = max(0, m0 - kmax)
        if m1 - 1 <= c0:   # only m = 0 in the block: no earlier query
            continue
        d = torch.cdist(q[:, m0:m1], q[:, c0:m1 - 1])                  # [H, Bq, C]
        m = torch.arange(m0, m1, device=q.device)[:, None]
        p = torch.arange(c0, m1 - 1, device=q.device)[None, :]
        for i, K in enumerate(windows):
            ok = (p < m) & (p >= m - K)
            best, arg = d.masked_fill(~ok, float("inf")).min(dim=-1)
            found = torch.isfinite(best)
            dist[i, :, m0 - first:m1 - first] = best
            pos[i, :, m0 - first:m1 - first] = torch.where(found, arg + c0, torch.full_like(arg, -1))
    return dist, pos


def query_recurrence(model, prompts: Sequence[torch.Tensor], settings: RecurrenceSettings,
                     progress: bool = True) -> dict:
    """Oracle recurrence of ``model`` over ``prompts`` (each ``[1, T]`` int64; a prompt shorter than
    ``settings.positions`` has every position after its first scored). Returns the JSON-able dict
    ``{"settings", "per_layer": [{"hit": {tau: {K: rate}}, "skip": {...}, "median_gap": {tau: g},
    "query_rms": x, "nn_over_sqrt2d": {"q10", "q50", "q90"}}, ...], "mean": {"hit", "skip"}}``.
    """
    s = settings
    L = model.config.num_hidden_layers
    taus = [float(t) for t in s.taus]
    windows = list(s.windows)
    wide = windows.index(max(windows))   # gaps and distances are reported for the widest window
    hits = torch.zeros(L, len(taus), len(windows), dtype=torch.float64)
    skip = torch.zeros_like(hits)
    gaps: list = [[[] for _ in taus] for _ in range(L)]
    nn_ratio: list = [[] for _ in range(L)]
    rms = torch.zeros(L, dtype=torch.float64)
    count = 0
    for ids in tqdm(prompts, desc="recurrence", disable=not progress):
        if ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] < 2:
            raise ValueError(f"each prompt must be [1, T] with T >= 2, got {tuple(ids.shape)}")
        T = ids.shape[1]
        first = max(1, T - s.positions)
        qs = capture_pre_rope_queries(model, ids)
        m = torch.arange(first, T, dtype=torch.float64)
        for layer, q in enumerate(qs):
            d = q.shape[-1]
            dist, pos = nearest_in_window(q, first, windows)
            dist, pos = dist.cpu().double(), pos.cpu()
            valid = pos - s.band >= 0
            sk = ((pos - s.band).clamp(min=0).double() / m)
            for i, tau in enumerate(taus):
                hit = (dist < match_threshold(d, tau)) & valid           # [W, H, n]
                hits[layer, i] += hit.double().sum(dim=(1, 2))
                skip[layer, i] += torch.where(hit, sk, 0.0).sum(dim=(1, 2))
                gaps[layer][i].append((m - pos[wide].double())[hit[wide]])
            nn_ratio[layer].append(dist[wide][torch.isfinite(dist[wide])].flatten() / math.sqrt(2.0 * d))
            rms[layer] += float(q[:, first:].square().mean().sqrt()) * (T - first)
        count += (T - first) * qs[0].shape[0]
    heads = model.config.num_attention_heads
    n_tok = count / heads
    per_layer = []
    for layer in range(L):
        ratio = torch.cat(nn_ratio[layer]) if nn_ratio[layer] else torch.empty(0, dtype=torch.float64)
        qtl = (ratio.quantile(torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64)).tolist()
               if ratio.numel() else [float("nan")] * 3)
        per_layer.append(dict(
            hit={str(t): {str(k): float(hits[layer, i, j] / count) for j, k in enumerate(windows)}
                 for i, t in enumerate(taus)},
            skip={str(t): {str(k): float(skip[layer, i, j] / count) for j, k in enumerate(windows)}
                  for i, t in enumerate(taus)},
            median_gap={str(t): (float(torch.cat(gaps[layer][i]).median()) if sum(g.numel() for g in gaps[layer][i])
                                 else None) for i, t in enumerate(taus)},
            query_rms=float(rms[layer] / n_tok),
            nn_over_sqrt2d=dict(q10=qtl[0], q50=qtl[1], q90=qtl[2])))
    mean = dict(hit={str(t): {str(k): float(hits[:, i, j].sum() / (count * L)) for j, k in enumerate(windows)}
                     for i, t in enumerate(taus)},
                skip={str(t): {str(k): float(skip[:, i, j].sum() / (count * L)) for j, k in enumerate(windows)}
                      for i, t in enumerate(taus)})
    return dict(settings=asdict(settings), prompts=len(prompts), scored_tokens=int(n_tok), per_layer=per_layer,
                mean=mean)


def plot(results: dict, path: str | Path, *, tau: float = 0.45, window: int = 1024) -> Path:
    """PNG: per-layer oracle hit rate and skip of every model at ``(tau, window)``, and for the first
    model the threshold sweep (at ``window``) and the window sweep (at ``tau``), as the paper's Fig. 5."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(19, 4.2))
    t, k = str(float(tau)), str(int(window))
    for name, r in results.items():
        pl = r["per_layer"]
        axes[0].plot(range(len(pl)), [x["hit"][t][k] for x in pl], marker="o", label=name)
        axes[1].plot(range(len(pl)), [x["skip"][t][k] for x in pl], marker="o", label=name)
    first_name, first = next(iter(results.items()))
    pl = first["per_layer"]
    for tt in pl[0]["hit"]:
        if k in pl[0]["hit"][tt]:
            axes[2].plot(range(len(pl)), [x["hit"][tt][k] for x in pl], marker="o", label=f"tau={tt}")
    if t in pl[0]["hit"]:
        for kk in pl[0]["hit"][t]:
            axes[3].plot(range(len(pl)), [x["hit"][t][kk] for x in pl], marker="o", label=f"K={kk}")
    titles = (f"oracle hit rate (tau={tau}, K={window})", f"oracle skip (tau={tau}, K={window})",
              f"threshold sweep, K={window}: {first_name}", f"window sweep, tau={tau}: {first_name}")
    for ax, title in zip(axes, titles):
        ax.set_xlabel("layer")
        ax.set_ylim(-0.02, 1.02)
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run_command(args) -> int:
    """``macattn recurrence`` with its parsed flags (``macattn.cli`` defines them)."""
    from macattn.evaluation import harness as Hn

    settings = RecurrenceSettings(taus=Hn.parse_csv(args.taus, float), windows=Hn.parse_csv(args.windows, int),
                                  band=args.band, positions=args.positions)
    ev = Hn.EvalSettings(lengths=Hn.parse_csv(args.lengths, int), tasks=Hn.parse_csv(args.tasks, str), n=args.n,
                         seed=args.seed)
    if args.device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {args.device!r}")
    results = {}
    for which in args.model:
        model, encode, hay, bos, hay_desc = Hn.load_eval_model(which, seed=args.seed, haystack=args.haystack)
        model = model.to(args.device)
        samples = Hn.make_samples(ev, encode, hay, bos)
        prompts = [torch.tensor([s.ids + s.answer]) for s in samples]
        name = Path(which).name if which not in (*BUILTIN_NAMES, "random") else which
        results[name] = dict(query_recurrence(model, prompts, settings, progress=not args.quiet), haystack=hay_desc)
        del model
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = dict(lengths=list(ev.lengths), tasks=list(ev.tasks), n=ev.n, seed=ev.seed, device=args.device,
                torch=torch.__version__)
    out.write_text(json.dumps(dict(prompts=meta, models=results), indent=1) + "\n")
    t, k = str(float(args.plot_tau)), str(int(args.plot_window))
    print(f"oracle hit rate per layer at tau={t}, K={k} (skip in brackets)")
    for name, r in results.items():
        cells = " ".join(f"{x['hit'][t][k]:.2f}({x['skip'][t][k]:.2f})" for x in r["per_layer"]
                         if t in x["hit"] and k in x["hit"][t])
        print(f"{name:<24} {cells}")
    try:
        png = plot(results, out.with_suffix(".png"), tau=args.plot_tau, window=args.plot_window)
        print(f"wrote {out}, {png}")
    except ImportError:
        print(f"wrote {out} (matplotlib is not installed: no PNG)")
    return 0
