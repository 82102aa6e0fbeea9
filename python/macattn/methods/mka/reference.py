"""Memory-keyed attention (MKA) and route-fused FastMKA (docs/spec.md §2): reference math and modules.

Per layer and token ``t`` with attention input ``x_t`` (the normed hidden state, ``[D]``) and
pre-RoPE query ``q_t = x_t W_q`` (``[Dq]``):

* ``L1_t = x_t``; ``L2_t`` = causal summary of ``x_{<=t}`` (prefix mean, or EMA
  ``s_t = beta s_{t-1} + (1 - beta) x_t`` with ``s_0 = x_0``); ``L3_t`` = hashed chunk recall
  (mean ``x`` of the earlier completed chunks whose sign-hash of mean ``q`` equals the hash of
  ``q_t``; zero when disabled or when none match).
* routing ``p_t = softmax(W2 silu(W1 q_t + b1) + b2)`` (``[3]``) and the routed weights
  ``lambda_t = (1 - a) e_1 + a p_t`` with the per-layer gate ``a = clamp(gate, 0, 1)``.
  ``gate`` starts at 0, so ``lambda`` starts exactly one-hot on L1 and the model is exactly
  the original; the gate is trained straight-through (its gradient never vanishes, unlike a
  saturated softmax, whose gradient is 0 where it is exactly one-hot).
* FastMKA: ``f_t = sum_l lambda_{t,l} L_{l,t}``; ``k_t = f_t W_k``, ``v_t = f_t W_v`` are cached
  and attention over them is ordinary causal attention.

The L2 state of one request is ``(mean [D] fp32, count int64)``: the running mean (or EMA)
of the ``count`` tokens seen so far. All reference math runs in fp32 (or fp64 if given fp64).
"""
from __future__ import annotations


import torch

from macattn.methods.mka.config import MkaConfig
import torch.nn.functional as F
from torch import nn

__all__ = ["causal_summary_reference", "router_reference", "hashed_chunk_recall_reference", "mka_fuse_reference", "route_fused_decode_reference", "MkaRouter", "MkaFusion"]

def _check_mode(mode: int, beta: float) -> None:
    if mode not in (0, 1):
        raise ValueError(f"mode must be 0 (prefix mean) or 1 (EMA), got {mode}")
    if mode == 1 and not 0.0 < beta < 1.0:
        raise ValueError(f"beta must be in (0, 1) for EMA, got {beta}")


def causal_summary_reference(x: torch.Tensor, mean0: torch.Tensor, count0: torch.Tensor, mode: int,
                             beta: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """L2 over a chunk of tokens continuing a state.

    x ``[B, T, D]``; mean0 ``[B, D]`` and count0 ``[B]`` int64 the state before the chunk.
    Returns ``(L2 [B, T, D], mean [B, D], count [B])`` in ``mean0``'s dtype (fp32/fp64),
    differentiable w.r.t. ``x``.
    """
    _check_mode(mode, beta)
    B, T, D = x.shape
    dt = mean0.dtype
    xs = x.to(dt)
    c0 = count0.to(dt).view(B, 1, 1)
    if T == 0:
        return xs, mean0, count0
    if mode == 0:
        counts = c0 + torch.arange(1, T + 1, dtype=dt, device=x.device).view(1, T, 1)
        l2 = (mean0.unsqueeze(1) * c0 + xs.cumsum(1)) / counts
    else:
        outs, s = [], mean0
        fresh = (count0 == 0).view(B, 1)
        for t in range(T):
            upd = beta * s + (1.0 - beta) * xs[:, t]
            s = torch.where(fresh, xs[:, t], upd) if t == 0 else upd
            outs.append(s)
        l2 = torch.stack(outs, 1)
    return l2, l2[:, -1], count0 + T


def router_reference(q: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor,
                     gate: torch.Tensor, *, straight_through: bool = False) -> torch.Tensor:
    """Routing weights ``lambda [..., 3]`` from ``q [..., Dq]``.

    w1 ``[R, Dq]``, b1 ``[R]``, w2 ``[3, R]``, b2 ``[3]``, gate ``[]``; computed in ``w1``'s
    dtype. ``straight_through`` passes the gate's gradient through the clamp (training).
    """
    p = torch.softmax(F.linear(F.silu(F.linear(q.to(w1.dtype), w1, b1)), w2, b2), dim=-1)
    a = gate.clamp(0.0, 1.0)
    if straight_through:
        a = gate + (a - gate).detach()
    e1 = (torch.arange(3, device=p.device) == 0).to(p.dtype)     # no host->device copy: capturable
    return (1.0 - a) * e1 + a * p


def _hash_codes(v: torch.Tensor, planes: torch.Tensor) -> torch.Tensor:
    bits = (v.to(planes.dtype) @ planes.T > 0).to(torch.int64)
    return (bits << torch.arange(planes.shape[0], device=v.device)).sum(-1)


def hashed_chunk_recall_reference(x: torch.Tensor, q: torch.Tensor, planes: torch.Tensor, chunk: int) -> torch.Tensor:
    """L3 for a whole sequence: x ``[B, T, D]``, q ``[B, T, Dq]``, planes ``[bits, Dq]``.

    Token ``t`` recalls the mean ``x`` of every chunk ``c < t // chunk`` (completed before
    ``t``'s chunk, so causal) whose hash of mean ``q`` equals ``hash(q_t)``, averaged; zero when
    none. Returns ``[B, T, D]`` in ``planes``' dtype.
    """
    B, T, D = x.shape
    dt = planes.dtype
    n = T // chunk
    if n == 0:
        return x.new_zeros(B, T, D, dtype=dt)
    xc = x[:, : n * chunk].to(dt).reshape(B, n, chunk, D).mean(2)
    qc = q[:, : n * chunk].to(dt).reshape(B, n, chunk, -1).mean(2)
    kc = _hash_codes(qc, planes)                                   # [B, n]
    kt = _hash_codes(q, planes)                                    # [B, T]
    cid = torch.arange(T, device=x.device) // chunk                # [T]
    mask = (kc.unsqueeze(1) == kt.unsqueeze(2)) & (torch.arange(n, device=x.device).view(1, 1, n) < cid.view(1, T, 1))
    w = mask.to(dt)
    return (w @ xc) / w.sum(-1, keepdim=True).clamp(min=1.0)


def mka_fuse_reference(lam: torch.Tensor, l1: torch.Tensor, l2: torch.Tensor, l3: torch.Tensor | None) -> torch.Tensor:
    """``f = lam_1 L1 + lam_2 L2 + lam_3 L3``; lam ``[..., 3]``, L* ``[..., D]``; L3 ``None`` = 0."""
    f = lam[..., 0:1] * l1.to(lam.dtype) + lam[..., 1:2] * l2.to(lam.dtype)
    if l3 is not None:
        f = f + lam[..., 2:3] * l3.to(lam.dtype)
    return f


def route_fused_decode_reference(x: torch.Tensor, q: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor,
                                 w2: torch.Tensor, b2: torch.Tensor, gate: torch.Tensor,
                                 state_mean: torch.Tensor, state_count: torch.Tensor, slots: torch.Tensor,
                                 wk: torch.Tensor, bk: torch.Tensor | None, wv: torch.Tensor, bv: torch.Tensor | None,
                                 mode: int, beta: float, *, compute_dtype: torch.dtype = torch.float32
                                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One decode step of FastMKA (L3 off): routing, L2 state update, fuse, K/V projection.

    x ``[B, D]``, q ``[B, Dq]`` (pre-RoPE query); router weights as in ``router_reference``;
    state_mean ``[S, D]`` fp32 and state_count ``[S]`` int64 (rows ``slots [B]``) are updated
    in place; wk ``[Nk, D]``, wv ``[Nv, D]``, biases ``[N]`` or None. Returns
    ``(k [B, Nk], v [B, Nv], lam [B, 3])`` in ``compute_dtype``.
    """
    _check_mode(mode, beta)
    cd = compute_dtype
    lam = router_reference(q.to(cd), w1.to(cd), b1.to(cd), w2.to(cd), b2.to(cd), gate.to(cd))
    xs = x.to(cd)
    m0 = state_mean[slots].to(cd)
    c0 = state_count[slots]
    if mode == 0:
        m1 = m0 + (xs - m0) / (c0 + 1).to(cd).unsqueeze(1)
    else:
        m1 = torch.where((c0 == 0).unsqueeze(1), xs, beta * m0 + (1.0 - beta) * xs)
    state_mean[slots] = m1.to(state_mean.dtype)
    state_count[slots] = c0 + 1
    f = mka_fuse_reference(lam, xs, m1, None)
    k = F.linear(f, wk.to(cd), None if bk is None else bk.to(cd))
    v = F.linear(f, wv.to(cd), None if bv is None else bv.to(cd))
    return k, v, lam


class MkaRouter(nn.Module):
    """The new per-layer weights: routing MLP ``Dq -> R -> 3`` (fp32), gate ``[]`` (init 0), and
    the fixed L3 hash hyperplanes ``[bits, Dq]`` (a buffer)."""

    def __init__(self, query_dim: int, config: MkaConfig, layer_idx: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(int(config.seed) * 1000003 + layer_idx)
        r = int(config.router_hidden)
        self.w1 = nn.Parameter(torch.randn(r, query_dim, generator=g) / query_dim ** 0.5)
        self.b1 = nn.Parameter(torch.zeros(r))
        self.w2 = nn.Parameter(torch.randn(3, r, generator=g) / r ** 0.5)
        self.b2 = nn.Parameter(torch.zeros(3))
        self.gate = nn.Parameter(torch.zeros(()))
        self.register_buffer("planes", torch.randn(int(config.l3_bits), query_dim, generator=g), persistent=True)

    def forward(self, q: torch.Tensor) -> torch.Tensor:
        """q ``[..., Dq]`` -> lambda ``[..., 3]`` fp32 (straight-through gate while training)."""
        return router_reference(q, self.w1, self.b1, self.w2, self.b2, self.gate, straight_through=self.training)


class MkaFusion(nn.Module):
    """Per-layer fusion ``x -> f`` over a chunk of tokens continuing a per-request L2 state.

    ``forward(x [B, T, D], q [B, T, Dq], mean0 [B, D] fp32, count0 [B] int64)`` returns
    ``(f [B, T, D] in x's dtype, lam [B, T, 3] fp32, mean [B, D], count [B])``. With
    ``lam`` one-hot on L1, ``f`` equals ``x`` bit for bit.
    """

    def __init__(self, query_dim: int, config: MkaConfig, layer_idx: int = 0):
        super().__init__()
        self.config = config
        self.router = MkaRouter(query_dim, config, layer_idx)

    def forward(self, x, q, mean0, count0):
        cfg = self.config
        lam = self.router(q)
        l2, mean, count = causal_summary_reference(x, mean0, count0, cfg.mode, cfg.ema_beta)
        l3 = None
        if cfg.l3:
            if bool((count0 > 0).any()):
                raise NotImplementedError("L3 hashed chunk recall needs the whole sequence in one call "
                                          "(no continuation from a cache)")
            l3 = hashed_chunk_recall_reference(x, q, self.router.planes.float(), int(cfg.l3_chunk))
        f = mka_fuse_reference(lam, x, l2, l3).to(x.dtype)
        return f, lam, mean.detach(), count
