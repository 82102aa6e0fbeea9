"""What the trainers share (``training/train_tiny_llama.py``, ``finetune_mka``, ``distill_completion``).

* data: ``step_generator`` and ``random_windows`` (a step's batch is a function of
  ``(seed, step)``, so a resumed run sees the same data as an uninterrupted one);
* the step: ``freeze`` (the frozen model), ``token_cross_entropy``, ``optimizer_step``;
* the step loop: ``resume_step``, ``step_bar``, ``save_due``;
* the command line: ``run_fields`` (the values of the flags every trainer command has; ``macattn.cli``
  defines the flags), ``write_report``, ``versions``;
* resumable checkpoints: ``latest_checkpoint``, ``save_checkpoint``, ``load_checkpoint``.

A checkpoint is ``<out>/step_<n>/{<weights file>, optim.safetensors, meta.json}``: the trained
weights, the optimizer state of each named parameter (keys ``"<name>::<state key>"``) and the
run's metadata with its ``step``.
"""
from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path
from typing import Callable, Iterable, Sequence

import torch

__all__ = ["RUN_FIELDS", "step_generator", "random_windows", "freeze", "token_cross_entropy",
           "optimizer_step", "resume_step", "step_bar", "save_due", "run_fields",
           "write_report", "versions", "latest_checkpoint", "save_checkpoint", "load_checkpoint"]

OPTIM_FILE = "optim.safetensors"

RUN_FIELDS = ("steps", "batch", "seq_len", "lr", "save_every", "seed")
"""The fields of a trainer's config dataclass (and of its command line) that every trainer has."""


# -- data ----------------------------------------------------------------------------------------

def step_generator(seed: int, step: int) -> torch.Generator:
    """The CPU generator that draws training step ``step``'s batch: seeded ``seed * 1_000_003 + step``."""
    return torch.Generator().manual_seed(seed * 1_000_003 + step)


def random_windows(tokens: torch.Tensor, batch: int, seq_len: int, gen: torch.Generator) -> torch.Tensor:
    """``[batch, seq_len]`` int64 windows of ``tokens`` (``[N]`` int64), their starts drawn
    uniformly from ``[0, N - seq_len)`` with ``gen`` (one ``torch.randint`` call)."""
    if tokens.numel() <= seq_len:
        raise ValueError(f"seq_len must be < corpus length {tokens.numel()}, got {seq_len}")
    start = torch.randint(0, tokens.numel() - seq_len, (batch,), generator=gen)
    return torch.stack([tokens[s:s + seq_len] for s in start.tolist()])


# -- the step ------------------------------------------------------------------------------------

def freeze(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` in eval mode with no parameter requiring a gradient (the teacher / frozen base)."""
    model = model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def token_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross entropy (nats) of ``logits [..., V]`` (float) against ``targets [...]`` (int64), the
    leading dimensions flattened; the caller aligns them (next-token: logits of ``ids[:, :-1]``
    against ``ids[:, 1:]``). ``reduction`` as in ``torch.nn.functional.cross_entropy``."""
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                             reduction=reduction)


def optimizer_step(opt: torch.optim.Optimizer, loss: torch.Tensor, *,
                   clip: Iterable[torch.nn.Parameter] | None = None, max_norm: float = 1.0) -> torch.Tensor | None:
    """One update: zero the gradients, back-propagate the scalar ``loss``, clip the gradient norm of
    ``clip`` to ``max_norm`` when given, step ``opt``. Returns the (pre-clip) total gradient norm,
    a 0-d fp32 tensor, or None without ``clip``."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    gnorm = torch.nn.utils.clip_grad_norm_(clip, max_norm) if clip is not None else None
    opt.step()
    return gnorm


# -- the step loop -------------------------------------------------------------------------------

def resume_step(out: Path, resume: bool, load: Callable[[Path], int]) -> int:
    """The step to start at: ``load(d)`` of the newest checkpoint ``d`` under ``out`` (it restores
    the weights and optimizer state and returns the checkpoint's step) when ``resume`` and one
    exists, else 0."""
    ck = latest_checkpoint(out) if resume else None
    return 0 if ck is None else load(ck)


def step_bar(start: int, steps: int, *, desc: str, progress: bool = True):
    """A ``tqdm`` progress bar over the steps ``range(start, steps)`` (hidden unless ``progress``)."""
    from tqdm import tqdm

    return tqdm(range(start, steps), initial=start, total=steps, disable=not progress, desc=desc)


def save_due(done: int, cfg) -> bool:
    """Whether a checkpoint is due after ``done`` steps: every ``cfg.save_every`` and at ``cfg.steps``."""
    return done % cfg.save_every == 0 or done == cfg.steps


# -- the command line ----------------------------------------------------------------------------

def run_fields(args: argparse.Namespace) -> dict:
    """``{field: value}`` of the ``RUN_FIELDS`` in parsed ``args`` (keywords of a trainer's config)."""
    return {name: getattr(args, name) for name in RUN_FIELDS}


def write_report(path: str | None, report: dict) -> None:
    """Write ``report`` as indented JSON to ``path`` (its folder created); nothing when ``path`` is None."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(report, indent=1))


def versions(**extra) -> dict:
    """``{"torch": ..., "python": ..., **extra}``: the versions a training report records."""
    return {"torch": torch.__version__, "python": platform.python_version(), **extra}


# -- resumable checkpoints -----------------------------------------------------------------------

def latest_checkpoint(out: Path) -> Path | None:
    """The newest complete ``step_*`` directory under ``out`` (one with its ``meta.json``), or None."""
    steps = sorted((int(p.name.split("_")[1]), p) for p in Path(out).glob("step_*") if (p / "meta.json").exists())
    return steps[-1][1] if steps else None


def save_checkpoint(out: Path, step: int, weights: dict[str, torch.Tensor], weights_file: str,
                    params: Sequence[tuple[str, torch.nn.Parameter]], opt: torch.optim.Optimizer, meta: dict) -> Path:
    """Write ``weights`` and the optimizer state of ``params`` (``[(name, parameter)]``) at ``step``."""
    from safetensors.torch import save_file

    d = Path(out) / f"step_{step:06d}"
    d.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().cpu().contiguous() for k, v in weights.items()}, str(d / weights_file))
    state = {f"{n}::{k}": torch.as_tensor(v).detach().cpu().clone().contiguous()
             for n, p in params for k, v in opt.state.get(p, {}).items()}
    save_file(state, str(d / OPTIM_FILE))
    (d / "meta.json").write_text(json.dumps({**meta, "step": step}, indent=1))
    return d


def load_checkpoint(d: Path, weights_file: str, params: Sequence[tuple[str, torch.nn.Parameter]],
                    opt: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], int]:
    """Restore the optimizer state of ``params`` from checkpoint ``d``; returns ``(weights, step)``
    (the caller puts the weights back into its modules)."""
    from safetensors.torch import load_file

    d = Path(d)
    dev = params[0][1].device if params else torch.device("cpu")
    state = load_file(str(d / OPTIM_FILE), device=str(dev))
    for n, p in params:
        st = {k.split("::", 1)[1]: v for k, v in state.items() if k.split("::", 1)[0] == n}
        if st:
            opt.state[p] = st
    return load_file(str(d / weights_file)), int(json.loads((d / "meta.json").read_text())["step"])
