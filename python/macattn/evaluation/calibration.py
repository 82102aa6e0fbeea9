"""The calibrated match threshold: estimate each layer's (and head's) pre-RoPE query scale on calibration
prompts (``macattn.core.threshold``: one ``tau`` is then one null false-positive rate everywhere).

One full-attention forward per prompt captures every layer's pre-RoPE query (the ``q_proj`` output, what
MAC's ring stores). Per layer and query head the scale is ``s_h = sqrt(E ||q - mean_h||^2 / d)`` over all
calibration tokens pooled (the first ``skip_first`` tokens of each prompt left out: BOS and the opening
tokens are outliers no decode step matches); per layer (``per_head=False``) ``s = sqrt(mean_h s_h^2)``.
"""
from __future__ import annotations

from typing import Sequence

import torch
from tqdm.auto import tqdm

from macattn.methods.mac.config import MacConfig
from macattn.models.attention import capture_pre_rope_queries

__all__ = ["calibrate_match_scales", "calibrated_config"]


@torch.no_grad()
def calibrate_match_scales(model, prompts: Sequence[torch.Tensor], *, per_head: bool = True, skip_first: int = 16,
                           progress: bool = False) -> list[list[float]]:
    """Per layer, the query scale of each query head (``per_head``) or one for the layer.

    model: a bound-or-not transformers ``*ForCausalLM`` of a supported family; prompts: ``[1, T]`` int64
    token ids (``T > skip_first + 1``). Returns ``[L][Hq]`` (or ``[L][1]``) floats > 0, as
    ``MacConfig.with_match_scales`` takes them.
    """
    if not prompts:
        raise ValueError("prompts must hold at least one [1, T] prompt")
    if isinstance(skip_first, bool) or not isinstance(skip_first, int) or skip_first < 0:
        raise ValueError(f"skip_first must be an int >= 0, got {skip_first!r}")
    n = s1 = s2 = None
    for ids in tqdm(prompts, desc="calibrate", disable=not progress, leave=False):
        if ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] < skip_first + 2:
            raise ValueError(f"each prompt must be [1, T] with T >= skip_first + 2 = {skip_first + 2}, "
                             f"got {tuple(ids.shape)}")
        qs = [q[:, skip_first:].double() for q in capture_pre_rope_queries(model, ids)]   # [Hq, T', d] per layer
        if n is None:
            n, s1, s2 = 0, [torch.zeros_like(q[:, 0]) for q in qs], [torch.zeros(q.shape[0], dtype=torch.float64,
                                                                                 device=q.device) for q in qs]
        n += qs[0].shape[1]
        for layer, q in enumerate(qs):
            s1[layer] += q.sum(1)                       # [Hq, d]
            s2[layer] += q.square().sum((1, 2))         # [Hq]
    out = []
    for a, b in zip(s1, s2):
        d = a.shape[-1]
        var = (b - a.square().sum(-1) / n) / (n * d)    # E||q - mean||^2 / d per head (pooled over prompts)
        var = var.clamp(min=1e-12)
        out.append(var.sqrt().tolist() if per_head else [float(var.mean().sqrt())])
    return out


def calibrated_config(base: MacConfig, model, prompts: Sequence[torch.Tensor], *, per_head: bool = True,
                      skip_first: int = 16) -> MacConfig:
    """``base`` with every layer's ``match_scale`` estimated on ``prompts`` (``calibrate_match_scales``)."""
    return base.with_match_scales(calibrate_match_scales(model, prompts, per_head=per_head, skip_first=skip_first))
