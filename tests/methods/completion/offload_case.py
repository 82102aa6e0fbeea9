"""A small offloaded-decode problem shared by the CPU tests and the GPU / interpreter tests: random prefill
K / V / log φ per layer, completion caches, and decode steps with fresh queries (plain torch, fp32/bf16)."""
from __future__ import annotations

import torch

from macattn.methods.completion.config import CompletionConfig
from macattn.methods.completion.offload import OffloadConfig, OffloadedKV
from macattn.methods.completion.reference import build_completion_cache, partition


def make_problem(*, L=2, S=3, Hq=4, Hkv=2, d=16, F=8, prompts=(70, 45), steps=3, page=8, top_k=20, n_sink=4,
                 n_tail=6, hot=6, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    T = max(prompts) + steps
    B = len(prompts)
    k = [(r(B, Hkv, T, d) * 1.5 + r(B, Hkv, T, 1)).to(dtype) for _ in range(L)]
    v = [r(B, Hkv, T, d).to(dtype) for _ in range(L)]
    lpk = [r(B, Hkv, T, F) * 0.7 for _ in range(L)]
    q = [[r(B, Hq, d).to(dtype) for _ in range(L)] for _ in range(steps)]
    lpq = [[r(B, Hq, F) * 0.7 - 1.0 for _ in range(L)] for _ in range(steps)]
    cfg = CompletionConfig(n_sink=n_sink, n_tail=n_tail, top_k=top_k, feature_dim=F, selector="quest", page_size=page)
    off = OffloadConfig(hot_pages=hot, max_generated=steps + 2, max_prefill=max(prompts), prefetch="none")
    comp = []
    for layer in range(L):
        per = []
        for i, n in enumerate(prompts):
            p = partition(n, n, n_sink=n_sink, n_tail=n_tail)
            per.append(build_completion_cache(lpk[layer][i, :, p.mid_start:p.mid_end], v[layer][i, :, p.mid_start:p.mid_end]))
        comp.append(per)
    return dict(L=L, S=S, Hq=Hq, Hkv=Hkv, d=d, F=F, prompts=prompts, steps=steps, k=k, v=v, lpk=lpk, q=q, lpq=lpq,
                cfg=cfg, off=off, comp=comp, dtype=dtype)


def admit(t, device="cpu", use_kernels=None, off=None, slots=None):
    """An ``OffloadedKV`` with the problem's prompts admitted into ``slots`` (default: the last ones)."""
    st = OffloadedKV.allocate(t["cfg"], off or t["off"], num_layers=t["L"], num_slots=t["S"], num_kv_heads=t["Hkv"],
                              head_dim=t["d"], feature_dim=t["F"], dtype=t["dtype"], device=device,
                              use_kernels=use_kernels)
    slots = slots or [st.acquire() for _ in t["prompts"]]
    for i, (s, n) in enumerate(zip(slots, t["prompts"])):
        for layer in range(t["L"]):
            st.admit_layer(layer, s, t["k"][layer][i, :, :n].to(device), t["v"][layer][i, :, :n].to(device),
                           t["lpk"][layer][i, :, :n].to(device), tuple(c.to(device) for c in t["comp"][layer][i]))
    return st, slots


def step_inputs(t, st, slots, step, layer, device="cpu"):
    """Every slot's rows of one decode step of ``layer``: ``(q_all, lpq_all, seq_lens, n_prefill)`` (rows not
    decoding: zeros, length 1, no prefill)."""
    S = st.num_slots
    q_all = torch.zeros(S, t["Hq"], t["d"], dtype=t["dtype"], device=device)
    lpq_all = torch.zeros(S, t["Hq"], t["F"], device=device)
    lens = torch.ones(S, dtype=torch.int64, device=device)
    npf = torch.zeros(S, dtype=torch.int64, device=device)
    for i, (s, n) in enumerate(zip(slots, t["prompts"])):
        q_all[s], lpq_all[s] = t["q"][step][layer][i].to(device), t["lpq"][step][layer][i].to(device)
        lens[s], npf[s] = n + step + 1, n
    return q_all, lpq_all, lens, npf
