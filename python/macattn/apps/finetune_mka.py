"""``macattn finetune-mka``: train only the new FastMKA weights of a model on a text corpus.

The frozen model runs in bf16 (or fp32); the routing weights (and gates) are fp32 masters
trained with AdamW. Checkpoints are ``<out>/step_<n>/{mka.safetensors, optim.safetensors,
meta.json}``; ``--resume`` continues from the newest one (batches are a function of
``(seed, step)``, so a resumed run sees the same data as an uninterrupted one). The report
(JSON) has held-out loss / perplexity of the unmodified model, of the patched model at step 0
(equal: the gate starts at 0) and after training.

Corpus: ``--corpus FILE`` (UTF-8 text), or by default the docstrings of a fixed list of Python
standard-library modules (no download). Tokens are UTF-8 bytes (ids 0..255), which every
built-in model's vocabulary covers; documents are split train / held-out by a hash of their
name.
"""
from __future__ import annotations

import hashlib
import inspect
import json
import math
import os
import time
from dataclasses import asdict
from pathlib import Path

import torch

from macattn.apps.configs import FinetuneConfig
from macattn.apps.trainer_common import (freeze, load_checkpoint, optimizer_step, random_windows,
                                         resume_step, run_fields, save_checkpoint, save_due, step_bar,
                                         step_generator, token_cross_entropy, versions, write_report)
from macattn.methods.mka.config import MkaConfig
from macattn.models.mka import mka_parameters, patch_mka

__all__ = ["FinetuneConfig", "stdlib_corpus", "split_corpus", "finetune", "run_command"]

STDLIB_MODULES = ("json", "collections", "itertools", "functools", "argparse", "pathlib", "textwrap", "string",
                  "re", "typing", "dataclasses", "inspect", "subprocess", "shutil", "logging", "unittest",
                  "csv", "datetime", "decimal", "fractions", "statistics", "random", "heapq", "bisect",
                  "contextlib", "abc", "enum", "copy", "pprint", "tempfile", "zipfile", "tarfile", "gzip",
                  "urllib.parse", "http.client", "email.message", "sqlite3", "threading", "queue", "asyncio",
                  "socket", "struct", "codecs", "difflib", "glob", "fnmatch", "operator", "weakref", "ast")


def stdlib_corpus() -> dict[str, str]:
    """``name -> text``: the docstrings of ``STDLIB_MODULES`` and of their public members."""
    import importlib

    docs: dict[str, str] = {}
    for modname in STDLIB_MODULES:
        mod = importlib.import_module(modname)
        parts = [inspect.getdoc(mod) or ""]
        for name in sorted(getattr(mod, "__all__", None) or dir(mod)):
            if name.startswith("_"):
                continue
            obj = getattr(mod, name, None)
            if (inspect.isfunction(obj) or inspect.isclass(obj)) and getattr(obj, "__module__", "") == mod.__name__:
                doc = inspect.getdoc(obj)
                if doc:
                    parts.append(f"{name}: {doc}")
        docs[modname] = "\n\n".join(p for p in parts if p)
    return docs


def split_corpus(docs: dict[str, str], heldout_fraction: float = 0.15) -> tuple[torch.Tensor, torch.Tensor]:
    """Byte tokens ``(train [N] int64, heldout [M] int64)``; a document goes to held-out when the
    hash of its name falls below ``heldout_fraction``."""
    train, held = [], []
    for name in sorted(docs):
        h = int(hashlib.sha256(name.encode()).hexdigest()[:8], 16) / 2 ** 32
        (held if h < heldout_fraction else train).append(docs[name].encode("utf-8") + b"\n\n")
    if not train or not held:
        raise ValueError("corpus must have at least two documents so both splits are non-empty")
    to_t = lambda bs: torch.frombuffer(bytearray(b"".join(bs)), dtype=torch.uint8).to(torch.int64)  # noqa: E731
    return to_t(train), to_t(held)


def _eval_batches(tokens: torch.Tensor, cfg: FinetuneConfig) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(cfg.seed + 7919)
    return [random_windows(tokens, cfg.batch, cfg.seq_len, gen) for _ in range(cfg.eval_batches)]


@torch.no_grad()
def heldout_loss(model, batches: list[torch.Tensor]) -> float:
    """Mean next-token cross entropy (nats) over ``batches`` (each ``[B, T]`` int64)."""
    tot, n = 0.0, 0
    for ids in batches:
        logits = model(ids).logits.float()
        tot += token_cross_entropy(logits[:, :-1], ids[:, 1:], reduction="sum").item()
        n += ids[:, 1:].numel()
    return tot / n


def _save(out: Path, step: int, params, opt: torch.optim.Optimizer, meta: dict) -> Path:
    return save_checkpoint(out, step, dict(params), "mka.safetensors", params, opt, meta)


def _load(d: Path, params, opt: torch.optim.Optimizer) -> int:
    w, step = load_checkpoint(d, "mka.safetensors", params, opt)
    with torch.no_grad():
        for n, p in params:
            p.copy_(w[n])
    return step


def finetune(model, train: torch.Tensor, heldout: torch.Tensor, cfg: FinetuneConfig, mka: MkaConfig,
             out: str | os.PathLike, *, resume: bool = False, progress: bool = True) -> dict:
    """Patch ``model`` with FastMKA, train its new weights, and return the report dict."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    dtype = torch.bfloat16 if cfg.dtype == "bf16" else torch.float32
    model = freeze(model.to(dtype))
    evals = _eval_batches(heldout, cfg)
    t0 = time.time()
    loss_unmodified = heldout_loss(model, evals)
    ctx = patch_mka(model, mka)
    params = mka_parameters(model)
    for _, p in params:
        p.requires_grad_(True)
    loss_step0 = heldout_loss(model, evals)
    opt = torch.optim.AdamW([p for _, p in params], lr=cfg.lr, weight_decay=0.0)
    step = resume_step(out, resume, lambda ck: _load(ck, params, opt))
    meta = {"finetune": asdict(cfg), "mka": asdict(mka)}
    losses = []
    bar = step_bar(step, cfg.steps, desc="finetune-mka", progress=progress)
    for s in bar:
        for f in ctx.fusions:
            f.train()
        ids = random_windows(train, cfg.batch, cfg.seq_len, step_generator(cfg.seed, s))
        logits = model(ids).logits.float()
        loss = token_cross_entropy(logits[:, :-1], ids[:, 1:])
        optimizer_step(opt, loss)
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.4f}")
        if save_due(s + 1, cfg):
            _save(out, s + 1, params, opt, meta)
    for f in ctx.fusions:
        f.eval()
    loss_after = heldout_loss(model, evals)
    lam = torch.stack([ctx.last_lambda[i].reshape(-1, 3).mean(0) for i in range(len(ctx.fusions))])
    return {
        **meta,
        "versions": versions(),
        "device": "cpu",
        "train_tokens": int(train.numel()), "heldout_tokens": int(heldout.numel()),
        "heldout_eval_tokens": int(sum(b[:, 1:].numel() for b in evals)),
        "loss_unmodified": loss_unmodified, "ppl_unmodified": math.exp(loss_unmodified),
        "loss_step0": loss_step0, "ppl_step0": math.exp(loss_step0),
        "loss_after": loss_after, "ppl_after": math.exp(loss_after),
        "train_loss_first": losses[0] if losses else None, "train_loss_last": losses[-1] if losses else None,
        "gates": [f.router.gate.item() for f in ctx.fusions],
        "mean_lambda_heldout_per_layer": lam.tolist(),
        "resumed_from_step": step, "seconds": time.time() - t0,
    }


def run_command(args) -> int:
    """``macattn finetune-mka`` with its parsed flags (``macattn.cli`` defines them); ``--model builtin`` is
    the packaged trained checkpoint (``--from`` its directory)."""
    from macattn.models.builtin import build_builtin_model
    from macattn.models.checkpoint import BUILTIN_CHECKPOINT_DIR
    from macattn.models.names import BUILTIN_MODEL

    cfg = FinetuneConfig(**run_fields(args), eval_batches=args.eval_batches, dtype=args.dtype)
    mka = MkaConfig(summary=args.summary, ema_beta=args.ema_beta, router_hidden=args.router_hidden, l3=args.l3,
                    seed=args.seed)
    if args.corpus:
        text = Path(args.corpus).read_text(encoding="utf-8")
        paras = [p for p in text.split("\n\n") if p.strip()]
        docs = {f"{i:06d}": p for i, p in enumerate(paras)}
    else:
        docs = stdlib_corpus()
    train, held = split_corpus(docs)
    from_dir = args.from_dir or (str(BUILTIN_CHECKPOINT_DIR) if args.model == BUILTIN_MODEL else None)
    if from_dir:
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained(from_dir, attn_implementation="sdpa")
    else:
        model = build_builtin_model(args.model, seed=args.seed)
    torch.manual_seed(args.seed)
    report = finetune(model, train, held, cfg, mka, args.out, resume=args.resume, progress=not args.no_progress)
    report["model"] = args.from_dir or (BUILTIN_MODEL if args.model == BUILTIN_MODEL else f"builtin-{args.model}")
    report["corpus"] = args.corpus or "python-stdlib-docstrings"
    print(json.dumps({k: report[k] for k in ("ppl_unmodified", "ppl_step0", "ppl_after", "loss_step0", "loss_after")},
                     indent=1))
    write_report(args.json, report)
    return 0
