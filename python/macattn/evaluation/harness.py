"""``macattn eval``: RULER-style long-context fidelity of MAC and its alternatives vs full attention.

For every task (``tasks.TASKS``) and length, ``n`` deterministic samples are decoded greedily by
each method (``methods.py``). Metrics per method:

* task accuracy — the method's greedy argmax reproduces the answer tokens (fed the correct answer
  prefix, which equals its own free-running decode whenever it is right);
* greedy-token agreement with full attention over ``gen`` steps, teacher-forced on one shared
  input sequence (the answer, then full attention's continuation; as ``macattn generate``
  does), so every step compares identical prefixes;
* attention-output relative error per layer (same inputs, per decode step);
* hit rate and KV skip per layer (docs/spec.md §1.5 skipped prefix), and the KV read in
  token-equivalents relative to full attention (covers misses served by completion too). These
  three are for decode methods; A3 (``methods.A3Fusion``) fuses the prompt's K/V and then decodes
  with full attention, so it reports accuracy and agreement only;
* MAC paper Figs. 4-5 analogues: error vs band width ``r`` (a sweep on the first samples) and
  per-head error of hits vs reuse gap ``m - p``.

Writes ``eval.json`` and PNG plots. Presets (``--preset``): ``quick`` (4K, one sample per task,
32 steps, MAC at tau 0.45 plus its completion-on-miss variant, retrieval-completion and A3 at
rho 0.1; about 4 min on 2 idle CPU cores for the 8-layer 15.7M checkpoint: ~9 s of prefill, ring
seeding and decode per method and sample) and ``full`` (4K/8K/16K, 4 samples per task, 128 steps;
1-2 hours on 2 cores, dominated by the 16K prefills and ring seeding).
"""
from __future__ import annotations

import json
import math
import platform
import random
from dataclasses import asdict, replace
from pathlib import Path
from typing import Callable, Sequence

import torch
from tqdm.auto import tqdm

from macattn.methods.mac.config import MacConfig
from macattn.models.generation import greedy_decode
from macattn.models.names import BUILTIN_NAMES
from macattn.methods.completion.completion_on_miss import MissCompletionConfig
from macattn.evaluation import tasks as T
from macattn.methods.a3.config import A3Config
from macattn.evaluation.methods import A3Fusion, EvalMethod, Mac, Prefill, RetrievalCompletion
from macattn.evaluation.samples import PRESETS, EvalSettings, make_samples

__all__ = ["EvalSettings", "PRESETS", "make_samples", "run_eval", "band_sweep", "plot", "load_eval_model",
           "run_command", "byte_encoder", "parse_csv"]


def byte_encoder(vocab_size: int, offset: int = 3) -> Callable[[str], list]:
    """Tokenizer stand-in for models without one (the random built-in): UTF-8 bytes mod vocab."""
    if vocab_size <= offset:
        raise ValueError(f"vocab_size must be > {offset}, got {vocab_size}")
    return lambda s: [offset + b % (vocab_size - offset) for b in s.encode()]


def _mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else float("nan")


def _summarise(rec, agree: int, steps: int) -> dict:
    L = rec.num_layers
    per = lambda num, den: [num[i] / den[i] if den[i] else 0.0 for i in range(L)]  # noqa: E731
    return dict(
        greedy_agreement=agree / steps, decode_steps=steps,
        rel_error_per_layer=[_mean(e) for e in rec.errors],
        rel_error_mean=_mean(x for e in rec.errors for x in e),
        hit_rate_per_layer=per(rec.hits, rec.steps), skip_per_layer=per(rec.skipped, rec.steps),
        kv_read_fraction_per_layer=per(rec.read, rec.context),
        hit_rate=sum(rec.hits) / max(1, sum(rec.steps)), kv_skip=sum(rec.skipped) / max(1, sum(rec.steps)),
        kv_read_fraction=sum(rec.read) / max(1.0, sum(rec.context)))


def _gap_bins(hit_gap_error: list, n_bins: int = 12) -> dict:
    """Mean per-head error of hits in log-spaced reuse-gap bins: ``{"gap_lo", "gap_hi", "error", "count"}``."""
    if not hit_gap_error:
        return dict(gap_lo=[], gap_hi=[], error=[], count=[])
    gaps = torch.tensor([g for _, g, _ in hit_gap_error], dtype=torch.float64)
    errs = torch.tensor([e for _, _, e in hit_gap_error], dtype=torch.float64)
    edges = torch.logspace(0, math.log10(float(gaps.max()) + 1), n_bins + 1, dtype=torch.float64)
    idx = (torch.bucketize(gaps, edges, right=True) - 1).clamp(0, n_bins - 1)
    out = dict(gap_lo=[], gap_hi=[], error=[], count=[])
    for b in range(n_bins):
        sel = idx == b
        if bool(sel.any()):
            out["gap_lo"].append(float(edges[b]))
            out["gap_hi"].append(float(edges[b + 1]))
            out["error"].append(float(errs[sel].mean()))
            out["count"].append(int(sel.sum()))
    return out


def _reference(model, prompt: torch.Tensor, answer: list, steps: int) -> tuple[list, list]:
    """Full attention's greedy tokens ``ref`` (``steps`` of them) on the input sequence that feeds the
    correct ``answer`` first and then full attention's own continuation; returns ``(inputs, ref)``
    where ``inputs[i]`` is the token fed after step ``i``.

    Feeding the answer makes one teacher-forced decode per method give both metrics: the method is
    correct iff its argmax reproduces the answer on the answer steps (its inputs there are exactly
    the tokens a correct free-running decode would feed itself), and greedy agreement compares
    identical prefixes on every step.
    """
    head, _ = greedy_decode(model, prompt, len(answer), forced=answer, desc="full")
    tail, _ = greedy_decode(model, torch.cat([prompt, torch.tensor([answer])], dim=1), steps - len(answer),
                            desc="full")
    return list(answer) + tail, head + tail


def run_eval(model, methods: Sequence[EvalMethod], settings: EvalSettings, *, encode: Callable,
             haystack_ids: Sequence[int], bos: Sequence[int] = (), progress: bool = True,
             baseline: str | None = None) -> dict:
    """Evaluate ``methods`` against full attention on ``model``; returns the JSON-able result dict.

    baseline: the name of one of ``methods``; every method then also reports
    ``greedy_agreement_vs_baseline`` (its teacher-forced argmax against the baseline's, step by step)."""
    samples = make_samples(settings, encode, haystack_ids, bos)
    names = [m.name for m in methods]
    if len(set(names)) != len(names) or "full" in names:
        raise ValueError(f"method names must be distinct and not 'full', got {names}")
    acc = {name: {} for name in ["full", *names]}
    if baseline is not None and baseline not in names:
        raise ValueError(f"baseline must be one of the methods' names {names}, got {baseline!r}")
    stats = {m.name: dict(agree=0, steps=0, gaps=[], agree_baseline=0) for m in methods}
    for m in methods:
        m.recorder = None
    bar = tqdm(total=len(samples) * (1 + len(methods)), desc="eval", disable=not progress)
    for s in samples:
        prompt = torch.tensor([s.ids])
        key = f"{s.task}@{len(s.ids) + len(s.answer)}"
        forced, ref = _reference(model, prompt, s.answer, max(settings.gen, len(s.answer) + 1))
        acc["full"].setdefault(key, []).append(ref[:len(s.answer)] == s.answer)
        bar.update()
        tokens = {}
        pre = Prefill.of(model, prompt)    # one prefill per sample, replayed into every method
        for m in methods:
            own = tokens[m.name] = m.run(model, prompt, len(ref), forced, prefilled=pre)
            acc[m.name].setdefault(key, []).append(own[:len(s.answer)] == s.answer)
            st = stats[m.name]
            st["agree"] += sum(a == b for a, b in zip(own, ref))
            st["steps"] += len(ref)
            bar.update()
        if baseline is not None:
            for name, own in tokens.items():
                stats[name]["agree_baseline"] += sum(a == b for a, b in zip(own, tokens[baseline]))
    bar.close()
    cfg = model.config
    out = dict(settings=asdict(settings), model=dict(
        layers=cfg.num_hidden_layers, heads=cfg.num_attention_heads, kv_heads=cfg.num_key_value_heads,
        head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
        params=sum(p.numel() for p in model.parameters())),
        machine=f"{platform.machine()} CPU, {torch.get_num_threads()} threads", torch=torch.__version__,
        methods={})
    for name, per in acc.items():
        flat = [x for v in per.values() for x in v]
        entry = dict(accuracy={k: _mean(v) for k, v in per.items()}, accuracy_mean=_mean(flat))
        for task in settings.tasks:
            entry["accuracy"][task] = _mean(x for k, v in per.items() if k.startswith(task + "@") for x in v)
        if name in stats:
            rec = next(m.recorder for m in methods if m.name == name)
            agree, steps = stats[name]["agree"], stats[name]["steps"]
            if rec is None:   # a prefill method (A3): decode is full attention, no per-layer statistics
                entry.update(greedy_agreement=agree / steps, decode_steps=steps)
            else:
                entry.update(_summarise(rec, agree, steps))
                entry["error_vs_gap"] = _gap_bins(rec.hit_gap_error)
            if baseline is not None:
                entry.update(baseline=baseline, greedy_agreement_vs_baseline=stats[name]["agree_baseline"] / steps)
        out["methods"][name] = entry
    return out


def band_sweep(model, bands: Sequence[int], *, tau: float, window: int, samples: list, gen: int,
               progress: bool = True) -> dict:
    """MAC paper Fig. 4 analogue: mean attention-output relative error, KV skip and greedy agreement
    of MAC at each band ``r`` (fixed ``tau``, ``window``), teacher-forced on full attention over
    ``samples`` (``tasks.Sample`` list)."""
    refs = [greedy_decode(model, torch.tensor([s.ids]), gen, desc="full")[0] for s in samples]
    rows = []
    for r in tqdm(bands, desc="band sweep", disable=not progress):
        m = Mac(MacConfig(window=window, band=int(r), tau=tau))
        agree = steps = 0
        for s, ref in zip(samples, refs):
            toks = m.run(model, torch.tensor([s.ids]), gen, forced=ref)
            agree += sum(a == b for a, b in zip(toks, ref))
            steps += gen
        summ = _summarise(m.recorder, agree, steps)
        rows.append(dict(band=int(r), rel_error_mean=summ["rel_error_mean"], kv_skip=summ["kv_skip"],
                         hit_rate=summ["hit_rate"], greedy_agreement=summ["greedy_agreement"]))
    return dict(tau=tau, window=window, samples=len(samples), gen=gen, rows=rows)


def plot(result: dict, out_dir: str | Path, prefix: str = "eval") -> list[Path]:
    """PNGs: ``{prefix}_per_layer.png`` (hit rate, KV skip / read, error per layer per method),
    ``{prefix}_error_vs_band.png`` and ``{prefix}_error_vs_gap.png`` (paper Figs. 4-5 analogues)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    paths = []
    methods = {k: v for k, v in result["methods"].items() if "rel_error_per_layer" in v}
    fig, axes = plt.subplots(1, 4, figsize=(19, 4.2))
    for name, e in methods.items():
        xs = range(len(e["rel_error_per_layer"]))
        if any(e["hit_rate_per_layer"]):
            axes[0].plot(xs, e["hit_rate_per_layer"], marker="o", label=name)
            axes[1].plot(xs, e["skip_per_layer"], marker="o", label=name)
        axes[2].plot(xs, e["kv_read_fraction_per_layer"], marker="o", label=name)
        axes[3].semilogy(xs, [max(x, 1e-12) for x in e["rel_error_per_layer"]], marker="o", label=name)
    titles = ("MAC hit rate", "KV skip (skipped prefix, docs/spec.md §1.5)", "KV read / full (token-equivalents)",
              "attention-output relative error")
    for ax, t in zip(axes, titles):
        ax.set_xlabel("layer")
        ax.set_title(t, fontsize=10)
        ax.grid(alpha=0.3)
    axes[3].legend(fontsize=7)
    fig.tight_layout()
    paths.append(out_dir / f"{prefix}_per_layer.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    sweep = result.get("band_sweep")
    if sweep and sweep["rows"]:
        fig, ax = plt.subplots(figsize=(6, 4.2))
        rs = [r["band"] for r in sweep["rows"]]
        ax.plot(rs, [r["rel_error_mean"] for r in sweep["rows"]], marker="o", color="C0")
        ax.set_xlabel("band width r (tokens)")
        ax.set_ylabel("mean attention-output rel. error", color="C0")
        ax.set_yscale("log")
        ax2 = ax.twinx()
        ax2.plot(rs, [r["kv_skip"] for r in sweep["rows"]], marker="s", color="C1")
        ax2.set_ylabel("KV skip", color="C1")
        ax.set_title(f"MAC error vs band (tau={sweep['tau']}, K={sweep['window']})", fontsize=10)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        paths.append(out_dir / f"{prefix}_error_vs_band.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4.2))
    drawn = False
    for name, e in methods.items():
        g = e.get("error_vs_gap", {})
        if g and g["error"]:
            mids = [math.sqrt(lo * hi) for lo, hi in zip(g["gap_lo"], g["gap_hi"])]
            ax.loglog(mids, [max(x, 1e-12) for x in g["error"]], marker="o", label=name)
            drawn = True
    if drawn:
        ax.set_xlabel("reuse gap m - p (tokens)")
        ax.set_ylabel("per-head rel. error of hits")
        ax.set_title("MAC error vs reuse gap", fontsize=10)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
        fig.tight_layout()
        paths.append(out_dir / f"{prefix}_error_vs_gap.png")
        fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


# ----------------------------------------------------------------------------- model + CLI


def _pseudo_text(encode: Callable, n_words: int = 20000, seed: int = 0) -> list:
    """Fallback haystack: sentences of KJV words (only when no text shard is given or found)."""
    rng = random.Random(seed)
    words = [rng.choice(T.KEY_WORDS) for _ in range(n_words)]
    sents = [" ".join(words[i:i + 12]).capitalize() + "." for i in range(0, n_words, 12)]
    return list(encode(" " + " ".join(sents)))


def _read_haystack(path: Path, encode: Callable) -> list:
    if path.suffix == ".npy":
        import numpy as np

        return [int(x) for x in np.load(path).reshape(-1).tolist()]
    return list(encode(path.read_text()))


def load_eval_model(which: str, *, seed: int = 0, haystack: str | None = None, device: str = "cpu"):
    """``(model, encode, haystack_ids, bos, description)`` for ``which`` = ``"builtin"`` (the packaged
    checkpoint; any of ``BUILTIN_NAMES``), ``"random"`` (the random built-in LLaMA, byte-level "tokenizer") or a checkpoint dir: one
    of the built-in checkpoint's format (``tokenizer.json`` + ``heldout.txt``) or any transformers
    ``*ForCausalLM`` directory of a supported family (its ``AutoTokenizer``; without one, UTF-8 bytes mod
    the vocabulary). The model is put on ``device`` in eval mode.

    Haystack: ``haystack`` (.npy of token ids or a text file), else the checkpoint's held-out
    text (``heldout.txt``, documents it was not trained on), else KJV-word pseudo-sentences
    (recorded in the description).
    """
    ckpt = None
    if which == "random":
        from macattn.models.builtin import build_builtin_model

        model = build_builtin_model("llama", seed=seed)
        encode = byte_encoder(model.config.vocab_size)
        bos = []
    elif which in BUILTIN_NAMES or ((Path(which) / "tokenizer.json").is_file() and (Path(which) / "heldout.txt").is_file()):
        from macattn.models.checkpoint import BUILTIN_CHECKPOINT_DIR, load_builtin_checkpoint

        ckpt = BUILTIN_CHECKPOINT_DIR if which in BUILTIN_NAMES else Path(which)
        model, tok = load_builtin_checkpoint(ckpt)
        encode = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
        bos = [tok.bos_token_id]
    else:
        if not (Path(which) / "config.json").is_file():
            raise FileNotFoundError(f"--model must be one of {list(BUILTIN_NAMES)}, 'random' or a transformers "
                                    f"checkpoint directory (with config.json), got {which!r}")
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(which, attn_implementation="sdpa").eval()
        try:
            tok = AutoTokenizer.from_pretrained(which)
            encode = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
            bos = [tok.bos_token_id] if tok.bos_token_id is not None else []
        except (OSError, ValueError, TypeError):
            encode, bos = byte_encoder(model.config.vocab_size), []
        ckpt = Path(which)
    model = model.to(device)
    candidates = [Path(haystack)] if haystack else []
    if ckpt is not None:
        candidates.append(Path(ckpt) / "heldout.txt")
    for c in candidates:
        if c.is_file():
            return model, encode, _read_haystack(c, encode), bos, f"haystack: {c}"
    if haystack:
        raise FileNotFoundError(f"--haystack {haystack} does not exist")
    if which == "random" or (ckpt is not None and not (ckpt / "tokenizer.json").is_file()
                             and not (ckpt / "tokenizer_config.json").is_file()):
        g = torch.Generator().manual_seed(seed)
        hay = torch.randint(min(300, model.config.vocab_size // 2), model.config.vocab_size, (1 << 16,),
                            generator=g).tolist()
        return model, encode, hay, bos, "haystack: uniform random token ids"
    return model, encode, _pseudo_text(encode, seed=seed), bos, "haystack: KJV-word pseudo-sentences (fallback)"


def parse_csv(s: str, typ) -> tuple:
    """``"1,2,,3"`` -> ``(typ("1"), typ("2"), typ("3"))``: a comma-separated command-line value."""
    return tuple(typ(x) for x in s.split(",") if x.strip())




def _cmd_long_gen(args) -> int:
    """``macattn eval --long-gen``: ``long_gen.run_long_gen`` of MAC at each ``--taus`` (default 0.45; none
    with ``--no-uniform``), the ``--per-layer`` config and, with ``--two-stage``, the two-stage match at the
    first tau. ``--long-gen-merge A.json B.json ...``: one result (JSON + PNG) from several such runs."""
    from macattn.evaluation.long_gen import LongGenSettings, merge_long_gen, run_long_gen

    if args.long_gen_merge:
        result = merge_long_gen([json.loads(Path(f).read_text()) for f in args.long_gen_merge])
        return _write_long_gen(result, Path(args.out))
    settings = LongGenSettings(lengths=parse_csv(args.lengths, int) if args.lengths else (4096,),
                               tasks=parse_csv(args.tasks, str) if args.tasks else LongGenSettings.tasks,
                               n=args.n or 1, tokens=args.long_gen_tokens, bins=args.bins, seed=args.seed)
    taus = parse_csv(args.taus, float) if args.taus else (0.45,)
    base = MacConfig(window=args.window, band=args.band)
    methods: list[EvalMethod] = [] if args.no_uniform else [Mac(replace(base, tau=t), gen_len=settings.tokens)
                                                             for t in taus]
    if args.two_stage:
        methods.append(Mac(replace(base, tau=taus[0], match="two_stage"), gen_len=settings.tokens))
    if args.per_layer:
        methods.append(Mac(MacConfig.load(args.per_layer), gen_len=settings.tokens,
                           name=f"mac(per-layer {Path(args.per_layer).name})"))
    if not methods:
        raise SystemExit("--no-uniform leaves no method: add --two-stage or --per-layer")
    model, encode, hay, bos, hay_desc = load_eval_model(args.model, seed=args.seed, haystack=args.haystack,
                                                        device=args.device)
    result = run_long_gen(model, methods, settings, encode=encode, haystack_ids=hay, bos=bos)
    result.update(source=args.model, haystack=hay_desc, machine=f"{platform.machine()}, {args.device}, "
                                                                   f"{torch.get_num_threads()} CPU threads")
    return _write_long_gen(result, Path(args.out))


def _write_long_gen(result: dict, out: Path) -> int:
    from macattn.evaluation.long_gen import plot_long_gen

    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{'method':<46}{'acc@end':>8}{'diverges at (per sample)':>28}{'hit':>7}{'skip':>7}")
    for name, e in result["summary"].items():
        div = ",".join("-" if d is None else str(d) for d in e.get("first_divergence", [])) or "-"
        hit = f"{e['hit_rate']:.3f}" if "hit_rate" in e else "-"
        skip = f"{e['kv_skip']:.3f}" if "kv_skip" in e else "-"
        print(f"{name:<46}{e['accuracy']:>8.3f}{div:>28}{hit:>7}{skip:>7}")
    try:
        png = plot_long_gen(result, out.with_suffix(".png"))
        print(f"wrote {out}, {png}")
    except ImportError:
        print(f"wrote {out} (matplotlib is not installed: no PNG)")
    return 0


def run_command(args) -> int:
    """``macattn eval`` with its parsed flags (``macattn.cli`` defines them)."""
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.long_gen or args.long_gen_merge:
        return _cmd_long_gen(args)
    preset = PRESETS[args.preset]
    st = preset["settings"]
    settings = EvalSettings(lengths=parse_csv(args.lengths, int) if args.lengths else st.lengths,
                            tasks=parse_csv(args.tasks, str) if args.tasks else st.tasks,
                            n=args.n or st.n, gen=args.gen or st.gen, seed=args.seed)
    taus = parse_csv(args.taus, float) if args.taus else preset["taus"]
    bands = parse_csv(args.bands, int) if args.bands is not None else preset["bands"]
    model, encode, hay, bos, hay_desc = load_eval_model(args.model, seed=args.seed, haystack=args.haystack,
                                                        device=args.device)
    comp = MissCompletionConfig(n_sink=args.n_sink, n_tail=args.n_tail, top_k=args.top_k,
                                feature_dim=args.feature_dim)
    maps = None
    if args.feature_maps:
        from macattn.methods.completion.feature_maps import load_feature_maps

        maps = load_feature_maps(args.feature_maps)
    methods: list[EvalMethod] = [Mac(MacConfig(window=args.window, band=args.band, tau=t), gen_len=settings.gen)
                                 for t in taus]
    if args.completion:
        plain_cfg = MacConfig(window=args.window, band=args.band, tau=args.completion_tau)
        if args.completion_tau not in taus:
            methods.append(Mac(plain_cfg, gen_len=settings.gen))
        on_miss = Mac(replace(plain_cfg, miss_policy="completion"), completion=comp, maps=maps, gen_len=settings.gen)
        methods += [on_miss, RetrievalCompletion(comp, maps=maps, gen_len=settings.gen)]
    if args.per_layer:
        methods.append(Mac(MacConfig.load(args.per_layer), gen_len=settings.gen,
                           name=f"mac(per-layer {Path(args.per_layer).name})"))
    a3_rhos = parse_csv(args.a3_rhos, float) if args.a3_rhos is not None else preset["a3_rhos"]
    methods += [A3Fusion(A3Config(rho=r, method="a3"), chunk_tokens=args.a3_chunk, question_tokens=args.a3_question)
                for r in a3_rhos]
    result = run_eval(model, methods, settings, encode=encode, haystack_ids=hay, bos=bos)
    result["model"]["source"] = args.model
    result["haystack"] = hay_desc
    result["preset"] = args.preset
    result["completion_config"] = dict(asdict(comp), feature_maps=args.feature_maps or "untrained random features")
    if args.completion:   # MAC with completion on a miss vs plain MAC at the same (tau, K, r)
        a, b = result["methods"][Mac(plain_cfg).name], result["methods"][on_miss.name]
        result["completion_on_miss_vs_plain"] = {
            key: dict(plain=a[key], completion=b[key]) for key in
            ("accuracy_mean", "greedy_agreement", "rel_error_mean", "hit_rate", "kv_read_fraction")}
    if bands:
        sw = make_samples(settings, encode, hay, bos, seed_offset=7919)[:preset["sweep_samples"]]
        result["band_sweep"] = band_sweep(model, bands, tau=args.band_sweep_tau, window=args.window, samples=sw,
                                          gen=settings.gen)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{'method':<46}{'acc':>6}{'agree':>7}{'err':>10}{'hit':>7}{'skip':>7}{'read':>7}")
    for name, e in result["methods"].items():
        cell = lambda key, w, fmt: format(e[key], fmt).rjust(w) if key in e else "-".rjust(w)  # noqa: E731
        print(f"{name:<46}{e['accuracy_mean']:>6.3f}{cell('greedy_agreement', 7, '.3f')}"
              f"{cell('rel_error_mean', 10, '.2e')}{cell('hit_rate', 7, '.3f')}{cell('kv_skip', 7, '.3f')}"
              f"{cell('kv_read_fraction', 7, '.3f')}")
    try:
        pngs = plot(result, out.parent, prefix=out.stem)
    except ImportError:
        pngs = []
        print("matplotlib is not installed: no PNG plots")
    print("wrote " + ", ".join(str(p) for p in [out, *pngs]))
    return 0
