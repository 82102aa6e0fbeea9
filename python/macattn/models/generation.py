"""Plain generation loops over a transformers model (gpt-fast style: one prefill, then one token
per step through the model's own KV cache), and the repetitive test prompt of the random-weight
built-in models."""
from __future__ import annotations

import time

import torch
from tqdm.auto import tqdm

__all__ = ["repetitive_prompt", "greedy_decode"]


def repetitive_prompt(length: int, vocab_size: int, *, period: int = 512, mutation: float = 0.05,
                      seed: int = 0) -> torch.Tensor:
    """``[1, length]`` int64: a random passage of ``period`` tokens repeated, with a fraction
    ``mutation`` of tokens replaced per repetition, so queries recur as in real long contexts."""
    if length < 1:
        raise ValueError(f"length must be >= 1, got {length}")
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(0, vocab_size, (period,), generator=g)
    reps = -(-length // period)
    ids = base.repeat(reps)
    flip = torch.rand(ids.shape, generator=g) < mutation
    ids[flip] = torch.randint(0, vocab_size, (int(flip.sum()),), generator=g)
    return ids[:length].unsqueeze(0)


@torch.no_grad()
def greedy_decode(model, prompt: torch.Tensor, steps: int, *, forced: list[int] | None = None,
                  desc: str = "decode") -> tuple[list[int], float]:
    """Prefill ``prompt [1, L]`` then decode ``steps`` tokens greedily.

    With ``forced``, token ``i`` fed to step ``i+1`` is ``forced[i]`` (teacher forcing),
    while the returned list is still the model's own argmax per step. Returns the tokens
    and decode seconds (prefill excluded).
    """
    out = model(input_ids=prompt, use_cache=True)
    cache = out.past_key_values
    tokens = [int(out.logits[0, -1].argmax())]
    t0 = time.perf_counter()
    for i in tqdm(range(steps - 1), desc=desc, leave=False):
        nxt = forced[i] if forced is not None else tokens[-1]
        out = model(input_ids=torch.tensor([[nxt]]), past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        tokens.append(int(out.logits[0, -1].argmax()))
    return tokens, time.perf_counter() - t0
