"""``macattn eval --long-gen``: long continuous generation (LongGenBench-like, the MAC paper's third benchmark).

For every RULER-style sample (``tasks``) the document — the prompt without its closing question — is
prefilled, then each method generates ``tokens`` tokens greedily and *free-running* (each token is the
method's own previous argmax, never teacher-forced); then the sample's question is appended to the
method's own text and the method answers greedily. Per method and sample:

* ``first_divergence``: the index of the first generated token that differs from full attention's
  (``None``: none in ``tokens``), and ``matching_prefix`` the same as a count;
* task accuracy at the end: the answer after ``tokens`` generated tokens equals the expected one;
* per layer, hit and skip over time: ``(hit fraction, skipped prefix)`` of the layer's heads at every
  decode step (the recorder's timeline), summarised in ``bins`` equal bins of the generated steps,
  plus the attention-output relative error against full attention on the same inputs.

Full attention is the model's own; MAC runs ``macattn.methods.mac.reference`` on the model's device
(``--device cuda`` on the H100). JSON + PNG (per-layer hit / skip over time, divergence marks).
"""
from __future__ import annotations

import json
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from typing import Callable, Sequence

import torch
from tqdm.auto import tqdm

from macattn.evaluation import tasks as T
from macattn.evaluation.methods import EvalMethod, Recorder
from macattn.evaluation.samples import EvalSettings, make_samples
from macattn.models.transformers_api import CACHE_KWARG, returned_cache

__all__ = ["LongGenSettings", "long_generate", "run_long_gen", "summarise", "merge_long_gen", "plot_long_gen"]


@dataclass(frozen=True)
class LongGenSettings:
    """lengths: sample lengths in tokens (>= 64; the document is the prompt without its question);
    tasks: subset of ``tasks.TASKS``; n: samples per task and length (>= 1); tokens: free-running tokens
    generated before the question (>= 2); bins: time bins of the hit / skip summary (>= 1); seed: sample seed."""

    lengths: tuple = (4096,)
    tasks: tuple = ("niah_single", "niah_multikey", "vt")
    n: int = 1
    tokens: int = 4096
    bins: int = 32
    seed: int = 0

    def __post_init__(self):
        T.check_lengths_and_tasks(self.lengths, self.tasks)
        for name, lo in (("n", 1), ("tokens", 2), ("bins", 1)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")


@torch.no_grad()
def long_generate(model, method: EvalMethod | None, document: torch.Tensor, tokens: int, question: Sequence[int],
                  answer_len: int, *, desc: str = "long-gen") -> dict:
    """Prefill ``document [1, L]`` (int64), generate ``tokens`` tokens free-running, feed ``question`` and
    answer ``answer_len`` tokens greedily, all with ``method`` attached (None: the model's own attention).
    Returns ``{"generated": [tokens], "answer": [answer_len], "seconds": decode time}``; the method's
    recorder (if any) holds one entry per decode step: ``tokens - 1`` generation steps (each yields the
    next token), one feeding the last generated token, ``len(question)`` question steps (the last yields
    the first answer token), then ``answer_len - 1`` answer steps."""
    if answer_len < 1 or not question:
        raise ValueError(f"question must be non-empty and answer_len >= 1, got {len(question)} and {answer_len}")
    device = next(model.parameters()).device
    ctx = method.attach(model) if method is not None else nullcontext()
    with ctx:
        out = model(input_ids=document.to(device), use_cache=True)
        cache = returned_cache(out)
        gen = [int(out.logits[0, -1].argmax())]
        t0 = time.perf_counter()

        def feed(tok: int) -> int:
            nonlocal cache
            o = model(input_ids=torch.tensor([[tok]], device=device), **{CACHE_KWARG: cache}, use_cache=True)
            cache = returned_cache(o)
            return int(o.logits[0, -1].argmax())

        for _ in tqdm(range(tokens - 1), desc=desc, leave=False):
            gen.append(feed(gen[-1]))
        pending = [gen[-1], *question]        # the last generated token, then the question
        for tok in pending[:-1]:
            feed(tok)
        answer = [feed(pending[-1])]
        while len(answer) < answer_len:
            answer.append(feed(answer[-1]))
    return dict(generated=gen, answer=answer, seconds=time.perf_counter() - t0)


def _bins(series: list, start: int, stop: int, bins: int) -> list:
    """Means of ``series[start:stop]`` in ``bins`` equal bins (fewer if there are fewer steps)."""
    xs = series[start:stop]
    if not xs:
        return []
    n = min(bins, len(xs))
    edges = [round(i * len(xs) / n) for i in range(n + 1)]
    return [sum(xs[a:b]) / (b - a) for a, b in zip(edges, edges[1:])]


def run_long_gen(model, methods: Sequence[EvalMethod], settings: LongGenSettings, *, encode: Callable,
                 haystack_ids: Sequence[int], bos: Sequence[int] = (), progress: bool = True) -> dict:
    """Long continuous generation of full attention and each of ``methods`` (module doc); JSON-able dict."""
    names = [m.name for m in methods]
    if len(set(names)) != len(names) or "full" in names:
        raise ValueError(f"method names must be distinct and not 'full', got {names}")
    ev = EvalSettings(lengths=settings.lengths, tasks=settings.tasks, n=settings.n, gen=2, seed=settings.seed)
    samples = make_samples(ev, encode, haystack_ids, bos)
    per_sample = []
    L = model.config.num_hidden_layers
    G = settings.tokens - 1          # generation decode steps per sample
    for s in tqdm(samples, desc="long-gen samples", disable=not progress):
        doc = torch.tensor([s.ids[:len(s.ids) - len(s.question)]])
        entry = dict(task=s.task, document_tokens=int(doc.shape[1]), answer=list(s.answer), methods={})
        full = long_generate(model, None, doc, settings.tokens, s.question, len(s.answer), desc="full")
        entry["methods"]["full"] = dict(correct=full["answer"] == list(s.answer), answer=full["answer"],
                                        seconds=full["seconds"])
        for m in methods:
            m.recorder = Recorder(L, keep_timeline=True)
            res = long_generate(model, m, doc, settings.tokens, s.question, len(s.answer), desc=m.name)
            rec = m.recorder
            div = next((i for i, (a, b) in enumerate(zip(res["generated"], full["generated"])) if a != b), None)
            hit_t = [[h for h, _ in rec.timeline[i]] for i in range(L)]
            skip_t = [[k for _, k in rec.timeline[i]] for i in range(L)]
            err_t = [list(rec.errors[i]) for i in range(L)]
            entry["methods"][m.name] = dict(
                correct=res["answer"] == list(s.answer), answer=res["answer"], first_divergence=div,
                matching_prefix=settings.tokens if div is None else div, seconds=res["seconds"],
                hit_over_time=[_bins(h, 0, G, settings.bins) for h in hit_t],
                skip_over_time=[_bins(k, 0, G, settings.bins) for k in skip_t],
                error_over_time=[_bins(e, 0, G, settings.bins) for e in err_t],
                hit_rate_per_layer=[sum(h[:G]) / max(1, len(h[:G])) for h in hit_t],
                skip_per_layer=[sum(k[:G]) / max(1, len(k[:G])) for k in skip_t],
                hit_rate_answer_steps=[sum(h[G:]) / max(1, len(h[G:])) for h in hit_t])
        per_sample.append(entry)
    cfg = model.config
    return dict(settings=asdict(settings), device=str(next(model.parameters()).device),
                model=dict(layers=cfg.num_hidden_layers, heads=cfg.num_attention_heads,
                           kv_heads=cfg.num_key_value_heads, params=sum(p.numel() for p in model.parameters())),
                torch=torch.__version__, summary=summarise(per_sample), samples=per_sample)


def summarise(per_sample: Sequence[dict]) -> dict:
    """Per method over the samples: accuracy at the end; for MAC methods also the first divergences, the
    mean matching prefix, the hit rate and KV skip (mean over layers, then samples) and their per-layer
    means. Every sample must hold the same methods."""
    names = list(per_sample[0]["methods"])
    if any(list(e["methods"]) != names for e in per_sample):
        raise ValueError(f"every sample must hold the same methods {names}")
    summary = {}
    for name in names:
        ms = [e["methods"][name] for e in per_sample]
        row = dict(accuracy=sum(bool(m["correct"]) for m in ms) / len(ms))
        if name != "full":
            L_ = len(ms[0]["hit_rate_per_layer"])
            row.update(first_divergence=[m["first_divergence"] for m in ms],
                       mean_matching_prefix=sum(m["matching_prefix"] for m in ms) / len(ms),
                       hit_rate=sum(sum(m["hit_rate_per_layer"]) / L_ for m in ms) / len(ms),
                       kv_skip=sum(sum(m["skip_per_layer"]) / L_ for m in ms) / len(ms),
                       hit_rate_per_layer=[sum(m["hit_rate_per_layer"][i] for m in ms) / len(ms) for i in range(L_)],
                       skip_per_layer=[sum(m["skip_per_layer"][i] for m in ms) / len(ms) for i in range(L_)])
        summary[name] = row
    return summary


def merge_long_gen(results: Sequence[dict]) -> dict:
    """One result from several ``run_long_gen`` results of one model and settings (save ``tasks``) that
    ran different methods or tasks (e.g. one process per method): samples matched by (task, length, index
    within both), methods united, the summary recomputed. Each result's divergences are against its own
    full-attention run; ``ValueError`` if two runs' full attention answered one sample differently, if a
    method name appears twice for one sample, or if settings / models differ."""
    if not results:
        raise ValueError("results must hold at least one long-gen result")
    results = [json.loads(json.dumps(r)) for r in results]       # copies, in their JSON form (lists)
    ref = results[0]
    keep = lambda r: {k: v for k, v in r["settings"].items() if k != "tasks"}  # noqa: E731
    for r in results[1:]:
        if keep(r) != keep(ref) or r["model"] != ref["model"]:
            raise ValueError("long-gen results to merge must share the model and the settings (tasks aside): "
                             f"{keep(ref)} {ref['model']} vs {keep(r)} {r['model']}")
    merged: dict[tuple, dict] = {}
    tasks: list[str] = []
    for r in results:
        seen: dict[tuple, int] = {}
        for e in r["samples"]:
            base = (e["task"], e["document_tokens"])
            key = (*base, seen.setdefault(base, 0))
            seen[base] += 1
            tasks += [e["task"]] if e["task"] not in tasks else []
            if key not in merged:
                merged[key] = {**e, "methods": dict(e["methods"])}
                continue
            have = merged[key]["methods"]
            if e["answer"] != merged[key]["answer"]:
                raise ValueError(f"sample {key} is not the same sample in every result (expected answers "
                                 f"{merged[key]['answer']} and {e['answer']}): were the seeds the same?")
            if e["methods"]["full"]["answer"] != have["full"]["answer"]:
                raise ValueError(f"sample {key}: full attention answered {have['full']['answer']} in one run "
                                 f"and {e['methods']['full']['answer']} in another")
            for name, m in e["methods"].items():
                if name != "full" and name in have:
                    raise ValueError(f"sample {key}: method {name!r} is in two results")
                have.setdefault(name, m)
    per_sample = list(merged.values())
    names = sorted({n for e in per_sample for n in e["methods"]}, key=lambda n: (n != "full", n))
    missing = [(e["task"], n) for e in per_sample for n in names if n not in e["methods"]]
    if missing:
        raise ValueError(f"every method must have run every sample; missing (task, method): {missing}")
    for e in per_sample:
        e["methods"] = {n: e["methods"][n] for n in names}
    return {**ref, "settings": {**ref["settings"], "tasks": tasks}, "summary": summarise(per_sample),
            "samples": per_sample, "merged_from": len(results)}


def plot_long_gen(result: dict, path):
    """PNG: per method (rows), per-layer hit fraction and skipped prefix over the generated tokens (first
    sample), with the first divergence from full attention marked."""
    from pathlib import Path

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s0 = result["samples"][0]
    names = [n for n in s0["methods"] if n != "full"]
    tokens = result["settings"]["tokens"]
    fig, axes = plt.subplots(len(names), 2, figsize=(12, 3.2 * len(names)), squeeze=False)
    for r, name in enumerate(names):
        m = s0["methods"][name]
        for c, key in enumerate(("hit_over_time", "skip_over_time")):
            ax = axes[r][c]
            for layer, ys in enumerate(m[key]):
                xs = [(i + 0.5) * tokens / len(ys) for i in range(len(ys))]
                ax.plot(xs, ys, label=f"layer {layer}", lw=1.2)
            if m["first_divergence"] is not None:
                ax.axvline(m["first_divergence"], color="k", ls="--", lw=1, label="first divergence")
            ax.set_ylim(-0.02, 1.02)
            ax.set_xlabel("generated token")
            ax.set_title(f"{name}: {'hit fraction' if c == 0 else 'skipped prefix'} ({s0['task']}, "
                         f"answer {'right' if m['correct'] else 'wrong'})", fontsize=8)
            ax.grid(alpha=0.3)
        axes[r][1].legend(fontsize=6, ncol=2)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
