"""``macattn tune``: per-layer MAC ``tau``, ``K``, ``r`` (and calibrated thresholds) that maximise KV skip
under an error budget or an agreement target.

Calibration prompts are RULER-style samples (``macattn.evaluation.tasks``) decoded greedily with
full attention. Every candidate ``(tau, K, r)`` of the grid (the global default included) runs on
all layers at once, teacher-forced on the full tokens, recording per layer the mean
attention-output relative error ``||o_mac - o_full|| / ||o_full||`` and the KV skip (docs/spec.md §1.5).
Each layer takes the candidate with the largest skip whose error is within its budget: a fixed
``error_budget``, or (``error_budget=None``, the default) the global default's own per-layer
error, so the tuned config never trades error for skip against the default. Inputs of later
layers move once earlier layers change, so the chosen per-layer config is re-measured and any
layer over budget steps down to its next candidate (at most ``max_rounds`` rounds; a layer still
over budget after that gets the global default back).

Finally default and tuned configs are measured on held-out prompts (another seed) and the report
says whether the tuned config has at least the default's skip at equal-or-lower mean error there.

Quality first (``--min-agreement A``, ``tune_for_agreement``): the user names the fidelity — greedy
agreement with full attention, and optionally ``--max-error`` per layer — and gets the most KV skip it
allows. Candidates run under the paper's threshold and/or the calibrated one (``--thresholds``: per-head
query scales estimated on the calibration prompts, ``macattn.evaluation.calibration``); per-layer
configs along a ladder of error levels are measured as whole models (agreement is not per layer); the
feasible ones by falling skip are checked on held-out prompts, and the first meeting the target there
is written. Every explored point is in the report and on the frontier PNG (``plot_frontier``).

The written file is a ``MacConfig`` JSON, what every surface takes: ``macattn build / generate
--per-layer``, ``LLM(..., mac=FILE)``, ``macattn serve`` (through the engine dir or ``--per-layer`` of
``macattn triton-repo``), ``MacConfig.load``.

Retrieval-completion's gate (``--completion``, ``tune_completion_gate``): at a KV-read budget ``β`` (share of
the prompt in token-equivalents per step), completion with the Top-k it buys and Top-k alone with the larger
Top-k it buys are probed on the calibration prompts under full attention; the term's mass is calibrated per layer
and query head on what that Top-k leaves (``methods.completion.mass``, the gate's ``log_mass``), and a layer keeps
the term iff its mean attention-output error is then lower with it; layers are turned off (least gain first) until
the gated model's greedy agreement on the calibration prompts reaches Top-k alone's. The gate (``CompletionGate``
JSON) is then measured against both on held-out prompts;
``CompletionConfig(gate=FILE)``, ``EngineArgs.completion_gate`` / ``--completion-gate`` and
``LLM(..., completion_gate=FILE)`` read it.
"""
from __future__ import annotations

import itertools
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from macattn.apps.configs import THRESHOLD_MODES
from macattn.core.validation import check_choice, check_float
from macattn.methods.mac.config import MacConfig
from macattn.models.generation import greedy_decode

__all__ = ["TuneSettings", "calibration_prompts", "measure", "measure_many", "measure_methods", "tune",
           "tune_for_agreement", "completion_budget_ks", "tune_completion_gate", "plot_frontier", "run_command"]

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
    min_agreement: float | None = None
    thresholds: str = "paper"
    levels: int = 8
    verify: int = 3

    def __post_init__(self):
        _floats("taus", self.taus, 0.0, 1.0)
        _ints("windows", self.windows, 1)
        _ints("bands", self.bands, 0)
        _ints("lengths", self.lengths, 64)
        if self.error_budget is not None and not (isinstance(self.error_budget, (int, float))
                                                  and math.isfinite(self.error_budget) and self.error_budget > 0):
            raise ValueError(f"error_budget must be a float > 0 or None, got {self.error_budget!r}")
        for name, lo in (("n", 1), ("gen", 2), ("max_rounds", 1), ("levels", 1), ("verify", 1)):
            _ints(name, (getattr(self, name),), lo)
        if self.min_agreement is not None:
            check_float("min_agreement", self.min_agreement, 0.0, 1.0, lo_open=True)
        check_choice("thresholds", self.thresholds, THRESHOLD_MODES)

    def candidates(self) -> list[dict]:
        """``{tau, window, band, calibrated}`` of the agreement search: the grid under each threshold rule."""
        rules = {"paper": (False,), "calibrated": (True,), "both": (False, True)}[self.thresholds]
        return [dict(tau=float(t), window=int(k), band=int(r), calibrated=c)
                for c in rules for t, k, r in itertools.product(self.taus, self.windows, self.bands)]

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


def measure_many(model, configs: list, prompts: list, *, progress: bool = False) -> list[dict]:
    """``measure`` of each of ``configs`` over ``prompts``, one prefill per prompt (``evaluation.methods.Prefill``
    replayed into every config: same tokens and statistics as separate runs)."""
    from macattn.evaluation.methods import Mac

    gen = max(len(r) for _, r in prompts)
    return measure_methods(model, [Mac(c, gen_len=gen) for c in configs], prompts, progress=progress)


def measure_methods(model, methods: list, prompts: list, *, progress: bool = False) -> list[dict]:
    """Per ``evaluation.methods.EvalMethod`` over ``prompts`` (``[(prompt, full tokens)]``, one prefill each,
    teacher-forced on the full tokens): per-layer mean relative error, KV skip and hit rate, the KV read
    fraction, greedy agreement with full attention and layer means."""
    from macattn.evaluation.methods import Prefill

    agree = [0] * len(methods)
    steps = 0
    for prompt, ref in tqdm(prompts, desc="measure", disable=not progress, leave=False):
        pre = Prefill.of(model, prompt)
        for j, m in enumerate(methods):
            toks = m.run(model, prompt, len(ref), forced=ref, prefilled=pre)
            agree[j] += sum(a == b for a, b in zip(toks, ref))
        steps += len(ref)
        del pre
    out = []
    for m, a in zip(methods, agree):
        rec = m.recorder
        L = rec.num_layers
        err = [sum(e) / len(e) if e else 0.0 for e in rec.errors]
        skip = [rec.skipped[i] / max(1, rec.steps[i]) for i in range(L)]
        out.append(dict(error=err, skip=skip, hit_rate=[rec.hits[i] / max(1, rec.steps[i]) for i in range(L)],
                        kv_read_fraction=sum(rec.read) / max(1.0, sum(rec.context)), greedy_agreement=a / steps,
                        decode_steps=steps, mean_skip=sum(skip) / L, mean_error=sum(err) / L, max_error=max(err)))
    return out


def measure(model, config: MacConfig, prompts: list) -> dict:
    """Per-layer mean relative error, KV skip, hit rate and KV read fraction of ``config`` over
    ``prompts`` (``[(prompt, full tokens)]``), plus greedy agreement (teacher-forced on the full tokens)
    and layer means."""
    return measure_many(model, [config], prompts)[0]


def tune(model, settings: TuneSettings, prompts: list, *, base: MacConfig | None = None,
         held_out: list | None = None, progress: bool = True) -> tuple[MacConfig, dict]:
    """Return ``(per-layer MacConfig, report)``; see the module docstring for the search."""
    base = base or MacConfig()
    L = model.config.num_hidden_layers
    grid = settings.grid(base)
    stats = measure_many(model, [MacConfig(**c, miss_policy=base.miss_policy) for c in grid], prompts,
                         progress=progress)
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


def _candidate_config(c: dict, base: MacConfig, scales) -> MacConfig:
    """The uniform config of search candidate ``c`` (every layer at its tau / K / r, calibrated or not)."""
    cfg = MacConfig(tau=c["tau"], window=c["window"], band=c["band"], miss_policy=base.miss_policy)
    return cfg.with_match_scales(scales) if c["calibrated"] else cfg


def _layer_override(c: dict | None, layer: int, scales) -> dict:
    if c is None:
        return dict(enabled=False)
    over = dict(tau=c["tau"], window=c["window"], band=c["band"])
    if c["calibrated"]:
        over["match_scale"] = tuple(scales[layer])
    return over


def _meets(stats: dict, settings: TuneSettings) -> bool:
    ok = stats["greedy_agreement"] >= settings.min_agreement - 1e-12
    return ok and (settings.error_budget is None or stats["max_error"] <= settings.error_budget * (1 + 1e-9))


def tune_for_agreement(model, settings: TuneSettings, prompts: list, held_out: list, *,
                       base: MacConfig | None = None, progress: bool = True) -> tuple[MacConfig, dict]:
    """Quality-first search: the per-layer config with the most KV skip whose greedy agreement with full
    attention is at least ``settings.min_agreement`` (and, with ``error_budget``, whose per-layer mean error
    stays within it) on the calibration ``prompts`` and on the ``held_out`` ones.

    1. Calibrated threshold (``thresholds`` "calibrated" / "both"): per-head query scales from ``prompts``.
    2. Every candidate (``TuneSettings.candidates``) runs on all layers at once over ``prompts``: per layer its
       error and skip, and the uniform config's agreement (a frontier point).
    3. For ``levels`` error levels (quantiles of the per-layer errors) each layer takes its largest-skip
       candidate within the level (none: MAC off in that layer); each such per-layer config is measured
       over ``prompts`` (another frontier point; agreement is a whole-model property).
    4. Feasible points by falling skip are checked on ``held_out`` (at most ``verify``); the first that meets
       the target there is returned. None meeting it: the one with the best held-out agreement, and the
       report says ``target_met: False``.
    Returns ``(config, report)``; the report holds every explored point (``frontier``) for ``plot_frontier``.
    """
    if settings.min_agreement is None:
        raise ValueError("tune_for_agreement needs settings.min_agreement (a float in (0, 1])")
    if not held_out:
        raise ValueError("held_out must hold at least one (prompt, full tokens) pair: the target is checked there")
    base = base or MacConfig()
    L = model.config.num_hidden_layers
    scales = None
    if settings.thresholds != "paper":
        from macattn.evaluation.calibration import calibrate_match_scales

        scales = calibrate_match_scales(model, [p for p, _ in prompts], per_head=True, progress=progress)
    cands = settings.candidates()
    stats = measure_many(model, [_candidate_config(c, base, scales) for c in cands], prompts, progress=progress)
    frontier = [dict(kind="uniform " + ("calibrated" if c["calibrated"] else "paper"), candidate=c,
                     config=_candidate_config(c, base, scales).to_dict(), calibration=st)
                for c, st in zip(cands, stats)]
    errs = sorted({st["error"][i] for st in stats for i in range(L)})
    qs = [errs[min(len(errs) - 1, round(k * (len(errs) - 1) / max(1, settings.levels - 1)))]
          for k in range(settings.levels)] if settings.levels > 1 else [errs[-1]]
    if settings.error_budget is not None:
        qs = sorted({min(q, settings.error_budget) for q in qs})
    level_cfgs, seen = [], set()
    for q in sorted(set(qs)):
        over = {}
        for i in range(L):
            ok = [(st["skip"][i], -st["error"][i], -j) for j, st in enumerate(stats) if st["error"][i] <= q]
            over[i] = _layer_override(cands[-max(ok)[2]] if ok else None, i, scales)
        cfg = base.with_overrides(over)
        if cfg not in seen:
            seen.add(cfg)
            level_cfgs.append((q, cfg))
    level_stats = measure_many(model, [c for _, c in level_cfgs], prompts, progress=progress)
    frontier += [dict(kind="per-layer", error_level=q, config=c.to_dict(), calibration=st)
                 for (q, c), st in zip(level_cfgs, level_stats)]
    configs = [MacConfig.from_dict(f["config"]) for f in frontier]
    order = sorted((i for i, f in enumerate(frontier) if _meets(f["calibration"], settings)),
                   key=lambda i: -frontier[i]["calibration"]["mean_skip"])
    checked = order[:settings.verify]
    held = measure_many(model, [configs[i] for i in checked], held_out, progress=progress) if checked else []
    for i, h in zip(checked, held):
        frontier[i]["held_out"] = h
    chosen = next((i for i in checked if _meets(frontier[i]["held_out"], settings)), None)
    met = chosen is not None
    if chosen is None and checked:
        chosen = max(checked, key=lambda i: frontier[i]["held_out"]["greedy_agreement"])
    if chosen is None:   # nothing feasible on the calibration prompts: MAC off everywhere (agreement 1)
        cfg = base.with_overrides({i: dict(enabled=False) for i in range(L)})
        frontier.append(dict(kind="off", config=cfg.to_dict(), calibration=measure(model, cfg, prompts),
                             held_out=measure(model, cfg, held_out)))
        chosen, configs = len(frontier) - 1, configs + [cfg]
        met = _meets(frontier[chosen]["held_out"], settings)
    report = dict(settings=asdict(settings), base=base.to_dict(), match_scales=scales, frontier=frontier,
                  chosen=chosen, target_met=met, tuned_config=configs[chosen].to_dict(),
                  calibration_prompts=len(prompts), held_out_prompts=len(held_out),
                  held_out=frontier[chosen]["held_out"])
    return configs[chosen], report


def completion_budget_ks(budget: float, prompt_len: int, *, n_sink: int, n_tail: int, gen_len: int,
                         feature_dim: int, head_dim: int) -> tuple[int, int]:
    """``(Top-k with completion, Top-k alone)`` that ``budget · prompt_len`` token-equivalents per step buy
    (``reference.budget_top_k``; anchors: sink + tail + half the generated tokens, the mean over the steps).
    ``ValueError`` when the anchors alone exceed the budget."""
    from macattn.methods.completion.reference import budget_top_k

    check_float("budget", budget, 0.0, 1.0, lo_open=True)
    kw = dict(anchors=n_sink + n_tail + gen_len // 2, feature_dim=feature_dim, head_dim=head_dim, gen_len=gen_len,
              mid_len=prompt_len)
    kc, kt = (budget_top_k(budget * prompt_len, completion=c, **kw) for c in (True, False))
    if kc is None or kt is None:
        raise ValueError(f"budget={budget} of {prompt_len} tokens does not cover the anchors (sink {n_sink}, "
                         f"tail {n_tail}, generated) and the completion cache: raise it")
    return kc, kt


def tune_completion_gate(model, prompts: list, *, maps, budget: float, n_sink: int, n_tail: int,
                         selector=None, held_out: list | None = None, calibrate_mass: bool = True,
                         agreement: bool = True, progress: bool = True):
    """Retrieval-completion's per-layer gate at ``budget`` (module docstring): ``(CompletionGate, report)``.

    prompts / held_out: ``[(prompt [1, ~N], full tokens)]`` of one nominal length (``calibration_prompts``; the
    budget's Top-k is that of the longest, ``N``); maps: the ``CompletionFeatureMaps``; selector: the Top-k
    selector (None: exhaustive). One probe run (``evaluation.methods.CompletionProbe``, full attention's
    trajectory) records per layer the term's parts at the completion Top-k and Top-k alone at the budget's Top-k
    alone, which a gated-off layer runs (the gate's ``off_top_k``); ``calibrate_mass`` fits the term's mass per
    query head on them (``mass.fit_log_mass``, the gate's ``log_mass``); a layer keeps the term iff its error
    (calibrated or not) is below Top-k alone's. ``agreement``: the gated model's greedy agreement on the calibration prompts must
    exceed Top-k alone's at the budget's Top-k (a tie is no evidence that the term helps: at 16K, gates kept on a
    calibration tie lost 1.3-1.8 % agreement on the evaluated prompts, ``benchmarks/notes/completion_fidelity.md``);
    while it does not, the kept layer of least relative gain is turned off (each try in
    ``report["agreement_trail"]``). The report holds the Top-k of each variant, the
    per-layer errors, the fitted masses, and on ``held_out`` the three variants' agreement, errors and KV read
    fractions."""
    from macattn.evaluation.methods import CompletionProbe, RetrievalCompletion
    from macattn.methods.completion.completion_on_miss import MissCompletionConfig
    from macattn.methods.completion.gate import CompletionGate
    from macattn.methods.completion.mass import fit_log_mass, layer_error, reweighed_output

    if not prompts:
        raise ValueError("prompts must hold at least one (prompt, full tokens) pair")
    N, gen = max(int(p.shape[1]) for p, _ in prompts), max(len(r) for _, r in prompts)
    spec = maps.spec
    kc, kt = completion_budget_ks(budget, N, n_sink=n_sink, n_tail=n_tail, gen_len=gen,
                                  feature_dim=spec.feature_dim, head_dim=spec.head_dim)

    def cfg(k):
        return MissCompletionConfig(n_sink=n_sink, n_tail=n_tail, top_k=k, feature_dim=spec.feature_dim)

    def variant(k, completion, gate=None):
        return RetrievalCompletion(cfg(k), maps=maps, completion=completion, gen_len=gen, selector=selector, gate=gate)

    probe = CompletionProbe(cfg(kc), maps=maps, top_k_alone=kt, selector=selector)   # what a gated-off layer runs
    measure_methods(model, [probe], prompts, progress=progress)
    errs = dict(completion=[], completion_calibrated=[], topk_alone=[])
    log_mass = []
    for layer in range(spec.num_layers):
        r = {k: torch.cat([x[k] for x in probe.records[layer]]) for k in probe.records[layer][0]}
        parts = (r["out_exact"], r["out_comp"], r["lse_exact"], r["lse_comp"])
        errs["completion"].append(layer_error(reweighed_output(*parts, 0.0), r["full"]))
        errs["topk_alone"].append(layer_error(r["alone"], r["full"]))
        if calibrate_mass:
            lm, e = fit_log_mass(*parts, r["full"])
        else:
            lm, e = torch.zeros(r["full"].shape[1], dtype=torch.float64), errs["completion"][-1]
        log_mass.append(tuple(lm.tolist()))
        errs["completion_calibrated"].append(e)
    term = errs["completion_calibrated"]
    on = [bool(c < t) for c, t in zip(term, errs["topk_alone"])]
    tuned_for = dict(budget=budget, prompt_len=N, n_sink=n_sink, n_tail=n_tail, feature_dim=spec.feature_dim,
                     top_k_completion=kc, top_k_alone=kt, top_k_gated_off=kt, calibrate_mass=calibrate_mass,
                     selector="exhaustive" if selector is None else type(selector).__name__)

    def make(layers):
        return CompletionGate(tuple(layers), gen_len=gen, log_mass=tuple(log_mass) if calibrate_mass else None,
                              off_top_k=(kc, kt), tuned_for=tuned_for)

    trail = []
    if agreement and any(on):
        alone_agree = measure_methods(model, [variant(kt, False)], prompts, progress=progress)[0]["greedy_agreement"]
        gain = {i: 1.0 - term[i] / max(errs["topk_alone"][i], 1e-30) for i in range(len(on))}
        while any(on):
            got = measure_methods(model, [variant(kc, True, make(on))], prompts,
                                  progress=progress)[0]["greedy_agreement"]
            trail.append(dict(layers=list(on), greedy_agreement=got, topk_alone_agreement=alone_agree))
            if got > alone_agree:
                break
            on[min((i for i in range(len(on)) if on[i]), key=gain.get)] = False
    gate = make(on)
    report = dict(budget=budget, prompt_len=N, gen_len=gen, top_k_completion=kc, top_k_alone=kt,
                  top_k_gated_off=kt, gate=list(gate.layers), log_mass=[list(x) for x in log_mass],
                  calibration=dict(completion=dict(error=errs["completion"]),
                                   completion_calibrated=dict(error=errs["completion_calibrated"]),
                                   topk_alone=dict(error=errs["topk_alone"])),
                  agreement_trail=trail, calibration_prompts=len(prompts))
    if held_out:
        names = ("completion", "topk_alone", "gated")
        stats = measure_methods(model, [variant(kc, True), variant(kt, False), variant(kc, True, gate)], held_out,
                                progress=progress)
        report["held_out"] = dict(zip(names, stats), prompts=len(held_out))
    return gate, report


def plot_frontier(report: dict, path: str | Path) -> Path:
    """PNG of the explored skip / agreement frontier: every point on the calibration prompts (by kind),
    the held-out checks, the target and the chosen config."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.6))
    marks = {"uniform paper": ("o", "C0"), "uniform calibrated": ("s", "C1"), "per-layer": ("^", "C2"),
             "off": ("x", "k")}
    for kind, (mk, col) in marks.items():
        pts = [f["calibration"] for f in report["frontier"] if f["kind"] == kind]
        if pts:
            ax.scatter([p["mean_skip"] for p in pts], [p["greedy_agreement"] for p in pts], marker=mk, color=col,
                       label=f"{kind} (calibration prompts)", alpha=0.8)
    held = [f["held_out"] for f in report["frontier"] if "held_out" in f]
    if held:
        ax.scatter([h["mean_skip"] for h in held], [h["greedy_agreement"] for h in held], marker="D",
                   facecolors="none", edgecolors="C3", s=60, label="held-out check")
    c = report["frontier"][report["chosen"]]["held_out"]
    ax.scatter([c["mean_skip"]], [c["greedy_agreement"]], marker="*", s=220, color="C3", label="chosen (held-out)")
    ax.axhline(report["settings"]["min_agreement"], color="gray", ls="--", lw=1, label="target agreement")
    ax.set_xlabel("KV skip (mean over layers of the skipped prefix)")
    ax.set_ylabel("greedy agreement with full attention")
    ax.set_title("macattn tune: explored skip / agreement frontier", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run_command(args) -> int:
    """``macattn tune`` with its parsed flags (``macattn.cli`` defines them)."""
    from macattn.evaluation.harness import load_eval_model, parse_csv

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.completion:
        return _run_completion(args)
    budget = args.error_budget
    settings = TuneSettings(taus=parse_csv(args.taus, float), windows=parse_csv(args.windows, int),
                            bands=parse_csv(args.bands, int),
                            error_budget=None if budget in (None, "default") else float(budget),
                            lengths=parse_csv(args.lengths, int), n=args.n, gen=args.gen, seed=args.seed,
                            min_agreement=args.min_agreement, thresholds=args.thresholds, levels=args.levels,
                            verify=args.verify)
    base = MacConfig(window=args.window, band=args.band, tau=args.tau)
    model, encode, hay, bos, hay_desc = load_eval_model(args.model, seed=args.seed, haystack=args.haystack,
                                                        device=args.device)
    prompts = calibration_prompts(model, settings, encode, hay, bos)
    held = calibration_prompts(model, settings, encode, hay, bos, held_out=True)
    if settings.min_agreement is None and args.thresholds == "calibrated":
        from macattn.evaluation.calibration import calibrated_config

        base = calibrated_config(base, model, [p for p, _ in prompts])
    if settings.min_agreement is not None:
        cfg, report = tune_for_agreement(model, settings, prompts, held, base=base)
    else:
        cfg, report = tune(model, settings, prompts, base=base, held_out=held)
    report.update(model=args.model, haystack=hay_desc, device=str(next(model.parameters()).device))
    cfg.save(args.out)
    if args.report:
        Path(args.report).parent.mkdir(parents=True, exist_ok=True)
        Path(args.report).write_text(json.dumps(report, indent=1) + "\n")
    if settings.min_agreement is not None:
        print(f"{'explored (calibration prompts)':<34}{'skip':>7}{'agree':>7}{'max err':>9}  held-out skip / agree")
        for i, f in enumerate(report["frontier"]):
            c, h = f["calibration"], f.get("held_out")
            name = f["kind"] + (f" {f['candidate']['tau']}/{f['candidate']['window']}/{f['candidate']['band']}"
                                if "candidate" in f else f" level {f['error_level']:.3g}" if "error_level" in f else "")
            tail = f"  {h['mean_skip']:.3f} / {h['greedy_agreement']:.3f}" if h else ""
            star = " <- chosen" if i == report["chosen"] else ""
            print(f"{name:<34}{c['mean_skip']:>7.3f}{c['greedy_agreement']:>7.3f}{c['max_error']:>9.2e}{tail}{star}")
        h = report["held_out"]
        print(f"target agreement >= {settings.min_agreement} on held-out prompts: "
              f"{'met' if report['target_met'] else 'NOT met'} (skip {h['mean_skip']:.3f}, "
              f"agreement {h['greedy_agreement']:.3f} over {h['decode_steps']} steps)")
        try:
            png = plot_frontier(report, args.plot or Path(args.out).with_name(Path(args.out).stem + "_frontier.png"))
            print(f"wrote {png}")
        except ImportError:
            print("matplotlib is not installed: no frontier plot")
    else:
        h = report["held_out"]
        print(f"{'held-out':<10}{'mean skip':>10}{'mean err':>10}{'max err':>10}{'agree':>8}")
        for name in ("default", "tuned"):
            e = h[name]
            print(f"{name:<10}{e['mean_skip']:>10.3f}{e['mean_error']:>10.2e}{e['max_error']:>10.2e}"
                  f"{e['greedy_agreement']:>8.3f}")
        print(f"tuned beats default (skip >=, mean error <=): {h['tuned_beats_default']}")
    print(f"wrote {args.out}" + (f", {args.report}" if args.report else "")
          + f" (use with: macattn build --per-layer {args.out}, macattn generate --per-layer {args.out}, "
            f"LLM(..., mac='{args.out}'))")
    return 0


def _run_completion(args) -> int:
    """``macattn tune --completion``: the gate at ``--budget`` for ``--feature-maps``, written to ``--out``."""
    from macattn.evaluation.harness import load_eval_model, parse_csv
    from macattn.methods.completion.feature_maps import load_feature_maps
    from macattn.methods.completion.reference import PageSummaryTopK

    if args.feature_maps is None:
        raise ValueError("--completion needs --feature-maps DIR (the distilled maps the gate is chosen for)")
    settings = TuneSettings(lengths=parse_csv(args.lengths, int), n=args.n, gen=args.gen, seed=args.seed)
    model, encode, hay, bos, hay_desc = load_eval_model(args.model, seed=args.seed, haystack=args.haystack,
                                                        device=args.device)
    prompts = calibration_prompts(model, settings, encode, hay, bos)
    held = calibration_prompts(model, settings, encode, hay, bos, held_out=True)
    selector = PageSummaryTopK(args.page_size, args.page_overfetch) if args.selector == "pages" else None
    gate, report = tune_completion_gate(model, prompts, maps=load_feature_maps(args.feature_maps),
                                        budget=args.budget, n_sink=args.n_sink, n_tail=args.n_tail,
                                        selector=selector, held_out=held,
                                        calibrate_mass=not args.no_mass_calibration,
                                        agreement=not args.no_agreement_check)
    report.update(model=args.model, haystack=hay_desc, feature_maps=args.feature_maps, selector=args.selector)
    gate.save(args.out)
    if args.report:
        Path(args.report).parent.mkdir(parents=True, exist_ok=True)
        Path(args.report).write_text(json.dumps(report, indent=1) + "\n")
    cal = report["calibration"]
    print(f"budget {args.budget}: Top-k {report['top_k_completion']} with completion, {report['top_k_alone']} alone")
    print(f"{'layer':<6}{'err completion':>15}{'calibrated':>11}{'err Top-k alone':>16}  term  mean log_mass")
    for i, on in enumerate(gate.layers):
        lm = report["log_mass"][i]
        print(f"{i:<6}{cal['completion']['error'][i]:>15.4f}{cal['completion_calibrated']['error'][i]:>11.4f}"
              f"{cal['topk_alone']['error'][i]:>16.4f}  {'on ' if on else 'off'}  {sum(lm) / len(lm):+.2f}")
    for t in report["agreement_trail"]:
        print(f"agreement check: layers on {[i for i, x in enumerate(t['layers']) if x]}: "
              f"{t['greedy_agreement']:.3f} (Top-k alone {t['topk_alone_agreement']:.3f})")
    h = report["held_out"]
    print(f"{'held-out':<12}{'agree':>8}{'mean err':>10}{'KV read':>9}")
    for name in ("topk_alone", "completion", "gated"):
        print(f"{name:<12}{h[name]['greedy_agreement']:>8.3f}{h[name]['mean_error']:>10.4f}"
              f"{h[name]['kv_read_fraction']:>9.4f}")
    print(f"wrote {args.out}" + (f", {args.report}" if args.report else "")
          + f" (use with: CompletionConfig(gate='{args.out}'), LLM(..., completion_gate='{args.out}'), "
            f"macattn serve --completion-gate {args.out})")
    return 0

