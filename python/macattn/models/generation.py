"""Plain generation loops over a transformers model (gpt-fast style: one prefill, then one token
per step through the model's own KV cache), and the repetitive test prompt of the random-weight
built-in models."""
from __future__ import annotations

import time

import torch
from tqdm.auto import tqdm

from macattn.models.transformers_api import CACHE_KWARG, returned_cache

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
                  desc: str = "decode", prefilled: tuple | None = None, on_step=None,
                  progress: bool | None = True) -> tuple[list[int], float]:
    """Prefill ``prompt [1, L]`` (int64, on the model's device or the CPU) then decode ``steps`` tokens greedily.

    With ``forced``, token ``i`` fed to step ``i+1`` is ``forced[i]`` (teacher forcing),
    while the returned list is still the model's own argmax per step. ``prefilled``: ``(logits [V] of
    the prompt's last position, the model's KV cache after the prompt)`` replaces the prefill (the cache is
    extended in place). ``on_step(i, token)``: called after each token ``i`` (0 = the prefill's). ``progress``:
    the per-step bar shown (True), hidden (False) or shown when stderr is a terminal (None). Returns the
    tokens and decode seconds (prefill excluded).
    """
    device = next(model.parameters()).device
    if prefilled is None:
        out = model(input_ids=prompt.to(device), use_cache=True)
        cache, last = returned_cache(out), out.logits[0, -1]
    else:
        last, cache = prefilled
    tokens = [int(last.argmax())]
    if on_step is not None:
        on_step(0, tokens[0])
    t0 = time.perf_counter()
    for i in tqdm(range(steps - 1), desc=desc, leave=False, disable=None if progress is None else not progress):
        nxt = forced[i] if forced is not None else tokens[-1]
        out = model(input_ids=torch.tensor([[nxt]], device=device), **{CACHE_KWARG: cache}, use_cache=True)
        cache = returned_cache(out)
        tokens.append(int(out.logits[0, -1].argmax()))
        if on_step is not None:
            on_step(i + 1, tokens[-1])
    return tokens, time.perf_counter() - t0
