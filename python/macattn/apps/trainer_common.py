"""What the trainers share (``finetune_mka``, ``distill_completion``): resumable checkpoints.

A checkpoint is ``<out>/step_<n>/{<weights file>, optim.safetensors, meta.json}``: the trained
weights, the optimizer state of each named parameter (keys ``"<name>::<state key>"``) and the
run's metadata with its ``step``.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import torch

__all__ = ["latest_checkpoint", "save_checkpoint", "load_checkpoint"]

OPTIM_FILE = "optim.safetensors"


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
