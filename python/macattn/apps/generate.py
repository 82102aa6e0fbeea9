"""The main job: decode a long prompt with full attention and with MAC, compare.

Default model: the built-in trained checkpoint (``builtin``, ``macattn.models.checkpoint``) on a
needle-in-a-haystack prompt over held-out text; ``llama``/``qwen2``/``mistral`` are random-weight built-in models on a
repetitive token prompt (no language, but every architecture).

gpt-fast style plain loop: one prefill, then one token per step through the model's KV
cache. The MAC run is teacher-forced on the full-attention tokens, so greedy agreement is
measured per step on identical prefixes, and every decode step also records the relative
error of each layer's attention output against full attention on the same inputs.

Progress: one bar over the phases (``PHASES``: the load, then each run's prefill and generation) on
stderr, with each generation's per-token bar under it.
"""
from __future__ import annotations

import json
import platform
import random
from dataclasses import asdict, dataclass

import torch
from tqdm.auto import tqdm

from macattn.methods.mac.config import MacConfig
from macattn.models.builtin import BUILTIN, build_builtin_model
from macattn.models.generation import greedy_decode, repetitive_prompt
from macattn.models.names import BUILTIN_MODEL, BUILTIN_NAMES
from macattn.models.transformers_api import no_transformers_progress

__all__ = ["GenerateReport", "PHASES", "RUNS", "run_generate"]

RUNS = ("full attention", "MAC", "MAC error vs full")   # the three decodes of one prompt
PHASES = ("load", *(f"{phase} ({run})" for run in RUNS for phase in ("prefill", "generate")))


@dataclass
class GenerateReport:
    model: str
    context: int
    new_tokens: int
    mac: dict
    hit_rate: float
    skipped_prefix: float
    mean_gap: float
    greedy_agreement: float
    hit_rate_per_layer: list
    skipped_prefix_per_layer: list
    attn_rel_error_per_layer: list
    tokens_per_s_full: float
    tokens_per_s_mac: float
    torch_version: str
    machine: str
    needle: dict | None = None  # trained model: expected answer and the full-attention continuation

    def table(self) -> str:
        rows = [("model", self.model), ("context / new tokens", f"{self.context} / {self.new_tokens}"),
                ("MAC (window, band, tau)", f"{self.mac['window']}, {self.mac['band']}, {self.mac['tau']}"
                 + (f"; matches from position {self.mac['min_context']}" if self.mac.get("min_context") else "")),
                ("hit rate", f"{self.hit_rate:.3f}"), ("skipped-prefix fraction", f"{self.skipped_prefix:.3f}"),
                ("mean reuse gap m-p", f"{self.mean_gap:.1f}"),
                ("greedy-token agreement", f"{self.greedy_agreement:.3f}"),
                ("tokens/s full | MAC (CPU reference)", f"{self.tokens_per_s_full:.1f} | {self.tokens_per_s_mac:.1f}")]
        if self.needle:
            rows.insert(2, ("needle answer expected | decoded", f"{self.needle['expected']!r} | "
                                                                f"{self.needle['decoded']!r}"))
        lines = [f"{k:<38}{v}" for k, v in rows]
        lines.append(f"{'layer':<8}{'hit rate':>10}{'skip':>10}{'rel err vs full':>18}")
        for i, (h, s, e) in enumerate(zip(self.hit_rate_per_layer, self.skipped_prefix_per_layer,
                                          self.attn_rel_error_per_layer)):
            lines.append(f"{i:<8}{h:>10.3f}{s:>10.3f}{e:>18.2e}")
        return "\n".join(lines)


def _trained_setup(context: int, seed: int):
    """(model, prompt [1, context], description, needle info) for the packaged trained checkpoint:
    a single-needle retrieval prompt whose haystack is held-out text."""
    from macattn.models.checkpoint import heldout_text, load_builtin_checkpoint
    from macattn.evaluation.tasks import haystack_from, make_sample

    model, tok = load_builtin_checkpoint()
    # the held-out text is longer than the model's context: it is a haystack to cut from, not one input
    haystack = haystack_from(tok.encode(heldout_text(), verbose=False))
    sample = make_sample("niah_single", context, random.Random(seed), tok.encode, haystack, bos=[tok.bos_token_id])
    c = model.config
    desc = (f"{BUILTIN_MODEL}, the trained checkpoint ({c.num_hidden_layers} layers, {c.num_attention_heads}/"
            f"{c.num_key_value_heads} heads, d={c.head_dim}; needle prompt over held-out text)")
    return model, sample.ids, desc, dict(tokenizer=tok, expected=tok.decode(sample.answer))


def run_generate(*, family: str = BUILTIN_MODEL, context: int = 4096, new_tokens: int = 64,
                 mac: MacConfig | None = None, seed: int = 0, json_path: str | None = None,
                 progress: bool | None = None) -> GenerateReport:
    """The main job on ``family``: the packaged trained checkpoint (any of ``BUILTIN_NAMES``) or a random-weight
    built-in family (module doc). ``progress``: the phase bars shown (True), hidden (False) or shown when
    stderr is a terminal (None)."""
    from macattn.models.attention import patch_model, unpatch_model

    if context < 2:
        raise ValueError(f"context must be >= 2, got {context}")
    if new_tokens < 2:
        raise ValueError(f"new_tokens must be >= 2, got {new_tokens}")
    mac = mac or MacConfig()
    needle = None
    bar = tqdm(total=len(PHASES), desc="macattn generate", bar_format="{desc}: {n}/{total} phases |{bar}| {elapsed}{postfix}",
               disable=None if progress is None else not progress)
    bar.set_postfix_str(PHASES[0])
    with no_transformers_progress():
        if family in BUILTIN_NAMES:
            model, ids, desc, needle = _trained_setup(context, seed)
            if context > model.config.max_position_embeddings - new_tokens:
                raise ValueError(f"context must be <= {model.config.max_position_embeddings - new_tokens} for "
                                 f"{BUILTIN_MODEL}, got {context}")
            prompt = torch.tensor([ids])
        else:
            model = build_builtin_model(family, seed=seed, max_position_embeddings=max(
                BUILTIN["max_position_embeddings"], context + new_tokens))
            prompt = repetitive_prompt(context, model.config.vocab_size, seed=seed)
            desc = (f"built-in {family} ({BUILTIN['num_hidden_layers']} layers, {BUILTIN['num_attention_heads']}/"
                    f"{BUILTIN['num_key_value_heads']} heads, d={BUILTIN['head_dim']}, random weights, seed {seed})")
    bar.update()

    def decode(run: str, **kw) -> tuple[list[int], float]:
        """One of ``RUNS``: its prefill and its generation, two phases of the bar."""
        def on_step(i: int, _token: int) -> None:
            if i == 0:                      # the prefill's token: generation starts
                bar.update()
                bar.set_postfix_str(f"generate ({run})")

        bar.set_postfix_str(f"prefill ({run})")
        out = greedy_decode(model, prompt, new_tokens, desc=run, on_step=on_step, progress=progress, **kw)
        bar.update()
        return out

    full_tokens, full_s = decode(RUNS[0])
    ctx = patch_model(model, mac, num_slots=1)
    mac_tokens, mac_s = decode(RUNS[1], forced=full_tokens)
    diag = ctx.state.diagnostics
    ctx.record_error = True
    diag.reset()
    decode(RUNS[2], forced=full_tokens)
    unpatch_model(model)
    bar.close()

    steps = diag.steps.sum()
    if needle is not None:
        tok = needle.pop("tokenizer")
        needle["decoded"] = tok.decode(full_tokens[:8])
        needle["retrieved"] = needle["decoded"].startswith(needle["expected"])
    report = GenerateReport(
        model=desc, needle=needle,
        context=prompt.shape[1], new_tokens=new_tokens, mac=mac.to_dict(),
        hit_rate=float(diag.hits.sum() / steps), skipped_prefix=float(diag.skipped.sum() / steps),
        mean_gap=float(diag.gap.sum() / diag.hits.sum().clamp(min=1)),
        greedy_agreement=sum(a == b for a, b in zip(full_tokens, mac_tokens)) / new_tokens,
        hit_rate_per_layer=diag.hit_rate.mean(1).tolist(),
        skipped_prefix_per_layer=diag.skipped_prefix.mean(1).tolist(),
        attn_rel_error_per_layer=[sum(v) / len(v) for _, v in sorted(ctx.layer_errors.items())],
        tokens_per_s_full=(new_tokens - 1) / full_s, tokens_per_s_mac=(new_tokens - 1) / mac_s,
        torch_version=torch.__version__, machine=f"{platform.machine()} CPU, {torch.get_num_threads()} threads",
    )
    if json_path:
        with open(json_path, "w") as f:
            json.dump(asdict(report), f, indent=2)
    return report
