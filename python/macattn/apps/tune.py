"""``macattn tune``: per-layer MAC ``tau``, ``K``, ``r`` that maximise KV skip under an error budget.

Calibration prompts are RULER-style samples (``macattn.evaluation.tasks``) decoded greedily with
full attention. Every candidate ``(tau, K, r)`` of the grid (the global default included) runs on
all layers at once, teacher-forced on the full tokens, recording per layer the mean
attention-output relative error ``||o_mac - o_full|| / ||o_full||`` and the KV skip (SPEC §1.5).
Each layer takes the candidate with the largest skip whose error is within its budget: a fixed
``error_budget``, or (``error_budget=None``, the default) the global default's own per-layer
error, so the tuned config never trades error for skip against the default. Inputs of later
layers move once earlier layers change, so the chosen per-layer config is re-measured and any
layer over budget steps down to its next candidate (at most ``max_rounds`` rounds; a layer still
over budget after that gets the global default back).

Finally default and tuned configs are measured on held-out prompts (another seed) and the report
says whether the tuned config has at least the default's skip at equal-or-lower mean error there.
The written file is a ``MacConfig`` JSON (``macattn build --per-layer``, ``MacConfig.load``).
"""
from __future__ import annotations

import itertools
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from macattn.methods.mac.config import MacConfig
from macattn.models.generation import greedy_decode

__all__ = ["TuneSettings", "calibration_prompts", "measure", "tune", "register"]

_HELD_OUT_OFFSET = 104729   # sample-seed offset of the held-out prompts (disjoint from calibration's)


def _floats(name, xs, lo, hi):
    if not xs:
        raise ValueError(f"{name} must be non-empty")
    for x in xs:
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not lo <= x < hi:
            raise ValueError(f"{name} must hold numbers in [{lo}, {hi}), got {x!r}")


def _ints(name, xs, lo):
    if not xs:
        raise ValueError(f"{name} must be non-empty")
    for x in xs:
        if isinstance(x, bool) or not isinstance(x, int) or x < lo:
            raise ValueError(f"{name} must hold ints >= {lo}, got {x!r}")


@dataclass(frozen=True)
class TuneSettings:
    """taus / windows / bands: the candidate grid; error_budget: per-layer bound on the mean relative
    error (> 0), or None for "the global default's own per-layer error"; lengths, n, gen, seed:
    calibration prompts (held-out prompts use another sample seed); max_rounds: verification rounds (>= 1)."""

    taus: tuple = (0.3, 0.45, 0.6, 0.75)
    windows: tuple = (512, 1024, 2048)
    bands: tuple = (64, 128, 256)
    error_budget: float | None = None
    lengths: tuple = (4096,)
    n: int = 2
    gen: int = 32
    seed: int = 0
    max_rounds: int = 4

    def __post_init__(self):
        _floats("taus", self.taus, 0.0, 1.0)
        _ints("windows", self.windows, 1)
        _ints("bands", self.bands, 0)
        _ints("lengths", self.lengths, 64)
        if self.error_budget is not None and not (isinstance(self.error_budget, (int, float))
                                                  and math.isfinite(self.error_budget) and self.error_budget > 0):
            raise ValueError(f"error_budget must be a float > 0 or None, got {self.error_budget!r}")
        for name, lo in (("n", 1), ("gen", 2), ("max_rounds", 1)):
            _ints(name, (getattr(self, name),), lo)

    def grid(self, base: MacConfig) -> list[dict]:
        """Candidates ``{tau, window, band}``, the base's global values first."""
        g = [dict(tau=float(t), window=int(k), band=int(r))
             for t, k, r in itertools.product(self.taus, self.windows, self.bands)]
        first = dict(tau=base.tau, window=base.window, band=base.band)
        return [first] + [c for c in g if c != first]


def calibration_prompts(model, settings: TuneSettings, encode, haystack_ids, bos=(), *, held_out: bool = False,
                        progress: bool = True) -> list:
    """``[(prompt [1, L] int64, full-attention greedy tokens)]``: the first ``n`` samples per length
    of ``tasks.TASKS`` order (held-out prompts draw from a disjoint sample seed)."""
    from macattn.evaluation import tasks as T
    from macattn.evaluation.harness import EvalSettings, make_samples

    out = []
    for li, length in enumerate(settings.lengths):
        tasks = T.TASKS[:settings.n]
        ev = EvalSettings(lengths=(length,), tasks=tasks, n=-(-settings.n // len(tasks)), gen=settings.gen,
                          seed=settings.seed)
        samples = make_samples(ev, encode, haystack_ids, bos, seed_offset=li + (_HELD_OUT_OFFSET if held_out else 0))
        for s in tqdm(samples[:settings.n], desc="calibration" if not held_out else "held-out",
                      disable=not progress, leave=False):
            prompt = torch.tensor([s.ids])
            out.append((prompt, greedy_decode(model, prompt, settings.gen, desc="full")[0]))
    return out


def measure(model, config: MacConfig, prompts: list) -> dict:
    """Per-layer mean relative error, KV skip, hit rate and KV read fraction of ``config`` over
    ``prompts`` (``[(prompt, full tokens)]``), plus greedy agreement and layer means."""
    from macattn.evaluation.methods import Mac

    m = Mac(config, gen_len=max(len(r) for _, r in prompts))
    agree = steps = 0
    for prompt, ref in prompts:
        with m.attach(model):
            toks, _ = greedy_decode(model, prompt, len(ref), forced=ref, desc="measure")
        agree += sum(a == b for a, b in zip(toks, ref))
        steps += len(ref)
    rec = m.recorder
    L = rec.num_layers
    err = [sum(e) / len(e) if e else 0.0 for e in rec.errors]
    skip = [rec.skipped[i] / max(1, rec.steps[i]) for i in range(L)]
    return dict(error=err, skip=skip, hit_rate=[rec.hits[i] / max(1, rec.steps[i]) for i in range(L)],
                kv_read_fraction=sum(rec.read) / max(1.0, sum(rec.context)), greedy_agreement=agree / steps,
                mean_skip=sum(skip) / L, mean_error=sum(err) / L, max_error=max(err))


def tune(model, settings: TuneSettings, prompts: list, *, base: MacConfig | None = None,
         held_out: list | None = None, progress: bool = True) -> tuple[MacConfig, dict]:
    """Return ``(per-layer MacConfig, report)``; see the module docstring for the search."""
    base = base or MacConfig()
    L = model.config.num_hidden_layers
    grid = settings.grid(base)
    stats = [measure(model, MacConfig(**c, miss_policy=base.miss_policy), prompts)
             for c in tqdm(grid, desc="tune grid", disable=not progress)]
    default = stats[0]
    budget = ([settings.error_budget] * L if settings.error_budget is not None else list(default["error"]))
    ranked = []
    for i in range(L):
        ok = [(stats[j]["skip"][i], -stats[j]["error"][i], -j) for j in range(len(grid))
              if stats[j]["error"][i] <= budget[i]]
        ranked.append([-j for *_, j in sorted(ok, reverse=True)])
    choice = [0] * L   # index into ranked[i]; past its end = the global default

    def build() -> MacConfig:
        over = {}
        for i in range(L):
            if choice[i] < len(ranked[i]):
                if grid[ranked[i][choice[i]]] != grid[0]:
                    over[i] = dict(grid[ranked[i][choice[i]]])
            elif settings.error_budget is not None:
                over[i] = dict(enabled=False)   # nothing fits a fixed budget: full attention
        return base.with_overrides(over) if over else base

    cfg = build()
    history, tuned_cal = [], None
    for _ in range(settings.max_rounds):
        tuned_cal = measure(model, cfg, prompts)
        history.append(dict(config=cfg.to_dict(), mean_skip=tuned_cal["mean_skip"], error=tuned_cal["error"]))
        over = [i for i in range(L) if tuned_cal["error"][i] > budget[i] * (1 + 1e-9) and choice[i] < len(ranked[i])]
        if not over:
            break
        for i in over:
            choice[i] += 1
        cfg, tuned_cal = build(), None
    if tuned_cal is None:
        tuned_cal = measure(model, cfg, prompts)
    report = dict(settings=asdict(settings), base=base.to_dict(), budget_per_layer=budget, grid=grid,
                  grid_stats=stats, rounds=history,
                  calibration=dict(default=default, tuned=tuned_cal), tuned_config=cfg.to_dict())
    if held_out:
        d, t = measure(model, base, held_out), measure(model, cfg, held_out)
        report["held_out"] = dict(default=d, tuned=t, prompts=len(held_out),
                                  tuned_beats_default=bool(t["mean_skip"] >= d["mean_skip"]
                                                           and t["mean_error"] <= d["mean_error"]))
    return cfg, report


def _cmd_tune(args) -> int:
    from macattn.evaluation.harness import _csv, load_eval_model

    settings = TuneSettings(taus=_csv(args.taus, float), windows=_csv(args.windows, int),
                            bands=_csv(args.bands, int),
                            error_budget=None if args.error_budget == "default" else float(args.error_budget),
                            lengths=_csv(args.lengths, int), n=args.n, gen=args.gen, seed=args.seed)
    base = MacConfig(window=args.window, band=args.band, tau=args.tau)
    model, encode, hay, bos, hay_desc = load_eval_model(args.model, seed=args.seed, haystack=args.haystack)
    prompts = calibration_prompts(model, settings, encode, hay, bos)
    held = calibration_prompts(model, settings, encode, hay, bos, held_out=True)
    cfg, report = tune(model, settings, prompts, base=base, held_out=held)
    report.update(model=args.model, haystack=hay_desc)
    cfg.save(args.out)
    if args.report:
        Path(args.report).parent.mkdir(parents=True, exist_ok=True)
        Path(args.report).write_text(json.dumps(report, indent=1) + "\n")
    h = report["held_out"]
    print(f"{'held-out':<10}{'mean skip':>10}{'mean err':>10}{'max err':>10}{'agree':>8}")
    for name in ("default", "tuned"):
        e = h[name]
        print(f"{name:<10}{e['mean_skip']:>10.3f}{e['mean_error']:>10.2e}{e['max_error']:>10.2e}"
              f"{e['greedy_agreement']:>8.3f}")
    print(f"tuned beats default (skip >=, mean error <=): {h['tuned_beats_default']}")
    print(f"wrote {args.out}" + (f", {args.report}" if args.report else "")
          + f" (use with: macattn build --per-layer {args.out})")
    return 0


def register(sub) -> None:
    """Add ``macattn tune`` to the CLI's argparse subparsers."""
    p = sub.add_parser("tune", help="choose per-layer MAC tau, K, r maximising KV skip under an error budget")
    p.add_argument("--model", default="trained", help="'trained', 'random' or a checkpoint dir")
    p.add_argument("--taus", default="0.3,0.45,0.6,0.75")
    p.add_argument("--windows", default="512,1024,2048")
    p.add_argument("--bands", default="64,128,256")
    p.add_argument("--error-budget", default="default",
                   help="per-layer mean attention-output rel. error bound, or 'default' (the default's own)")
    p.add_argument("--lengths", default="4096", help="calibration prompt lengths")
    p.add_argument("--n", type=int, default=2, help="calibration (and held-out) prompts per length")
    p.add_argument("--gen", type=int, default=32, help="teacher-forced decode steps per prompt")
    p.add_argument("--tau", type=float, default=0.45, help="global default tau (compared against)")
    p.add_argument("--window", type=int, default=1024, help="global default K")
    p.add_argument("--band", type=int, default=256, help="global default r")
    p.add_argument("--haystack", default=None, help=".npy of token ids or a text file for the haystack")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="mac_per_layer.json", help="MacConfig JSON to write")
    p.add_argument("--report", default=None, help="also write the search statistics here (JSON)")
    p.set_defaults(func=_cmd_tune)
