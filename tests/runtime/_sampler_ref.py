"""A plain-torch, one-request-at-a-time reference of the sampler (``macattn.runtime.sampling``): the
bans, the logit bias and the penalties written per token from the request's own prompt and output
history, then the greedy argmax or the draw (temperature, min-p, top-k, top-p, the Gumbel-max draw over
the same counter-based uniforms). The batched sampler must give the same token for every row."""
from __future__ import annotations

from collections import Counter

import torch

from macattn.runtime.sampling import SamplingConfig, _uniforms


def _f32(v: float, dtype: torch.dtype) -> torch.Tensor:
    """A parameter as the sampler holds it: fp32, then the logits' working dtype."""
    return torch.tensor(v, dtype=torch.float32).to(dtype)


def reference_logits(logits: torch.Tensor, p: SamplingConfig, prompt: list[int], output: list[int]) -> torch.Tensor:
    """One request's processed logits ``[V]`` (in the logits' dtype promoted to fp32 at least)."""
    dt = torch.promote_types(logits.dtype, torch.float32)
    x = logits.to(dt).clone()
    if len(output) < p.min_tokens:
        for t in ([p.end_id] if p.end_id is not None else []) + list(p.stop_token_ids):
            x[t] = float("-inf")
    for t, b in p.logit_bias:
        x[t] = x[t] + _f32(b, dt)
    rp = _f32(p.repetition_penalty, dt)
    for t in set(prompt) | set(output):
        x[t] = x[t] / rp if x[t] > 0 else x[t] * rp
    fp, pp = _f32(p.frequency_penalty, dt), _f32(p.presence_penalty, dt)
    for t, c in Counter(output).items():
        x[t] = x[t] - fp * c - pp
    return x


def reference_token(logits: torch.Tensor, p: SamplingConfig, seed: int, position: int, prompt: list[int],
                    output: list[int]) -> int:
    """The token one request draws at ``position`` from its raw ``logits [V]``."""
    x = reference_logits(logits, p, prompt, output)
    if p.greedy:
        return int(x.argmax())
    V = x.shape[0]
    y = x.float() / torch.tensor(p.temperature, dtype=torch.float32)
    probs = torch.softmax(y[None], -1)[0]
    y = torch.where(probs < torch.tensor(p.min_p, dtype=torch.float32) * probs.max(), float("-inf"), y)
    ordered = y.sort(descending=True).values
    k = p.top_k if p.top_k > 0 else V
    kept = ordered.clone()
    kept[k:] = float("-inf")
    n_keep = k
    if 0 < p.top_p < 1:
        q = torch.softmax(kept[None], -1)[0]
        before = q.cumsum(0) - q
        n_keep = int(((before < torch.tensor(p.top_p, dtype=torch.float32)) & (torch.arange(V) < k)).sum())
    threshold = ordered[n_keep - 1]
    u = _uniforms(torch.tensor([seed]), torch.tensor([position]), V)[0]
    gumbel = -torch.log(-torch.log(u))
    return int((torch.where(y < threshold, float("-inf"), y) + gumbel).argmax())
