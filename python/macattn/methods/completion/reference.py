"""Top-k retrieval with fixed-size linear-attention completion: the plain-torch reference (docs/spec.md §3).

One decode step for query head ``h`` (KV head ``g = h // (Hq // Hkv)``) of a request whose
prefill had ``N`` tokens and whose cache now holds ``L >= N`` tokens:

* partition of the prefill segment (``partition``): sink ``[0, s0)`` with ``s0 = min(n_sink, N)``,
  mid ``M = [s0, m1)`` with ``m1 = max(s0, N - n_tail)``, tail ``[m1, N)``; generated ``[N, L)``.
  ``M`` is empty when ``N <= n_sink + n_tail`` and the step is then exact attention over ``[0, L)``;
  when ``top_k >= |M|`` the completion term is skipped too (``R = M``; the fp32 cache would
  otherwise leave a rounding residual ``b' ~ 1e-7 b``), so the step is exact attention;
* logits ``l_t = scale * q·k_t`` (``scale`` defaults to ``1/sqrt(d)``);
* ``R`` = the ``k_eff = min(top_k, |M|)`` mid tokens chosen by a ``Selector`` (exhaustive Top-k
  by ``l_t`` per *query* head, or the page-summary selector); exact set ``E = sink ∪ tail ∪ R ∪
  generated``;
* completion of ``M \\ R`` from the prefill-time stable cache (``build_completion_cache``):
  per feature ``f`` a shift ``c_f = max_{t∈M} log φ_k(k_t)_f``, ``b_f = Σ_{t∈M} w_{t,f}``,
  ``A_f = Σ_{t∈M} w_{t,f} v_t`` with ``w_{t,f} = exp(log φ_k(k_t)_f - c_f) <= 1``;
  one-way subtraction of ``R`` with the same shift, clamped (``subtract_retrieved``):
  ``b'_f = max(b_f - Σ_{t∈R} w_{t,f}, 0)``, ``A'_f = A_f - Σ_{t∈R} w_{t,f} v_t`` and ``A'_f = 0``
  where ``b'_f = 0``;
* one normalisation in the log domain with ``a_f = log φ_q(q)_f + c_f`` and a common max
  ``m = max(max_{t∈E} l_t, max_{f: b'_f>0} a_f + log b'_f)``:
  ``den = Σ_{t∈E} e^{l_t-m} + Σ_f e^{a_f + log b'_f - m}``,
  ``num = Σ_{t∈E} e^{l_t-m} v_t + Σ_f e^{a_f + log b'_f - m} A'_f / b'_f``, ``out = num / den``.
  (``e^{a_f-m} b'_f`` is evaluated as ``e^{a_f + log b'_f - m}`` so a huge ``a_f`` with a tiny
  ``b'_f`` cannot overflow.)

Baselines behind the same step function (``hybrid_decode_step``): selection-only (no completion,
softmax renormalised over ``E``) and sink+tail (``top_k = 0``, no completion); ``full`` is exact
attention over ``[0, L)``. ``retrieval_completion_step`` is the op contract of
``macattn::retrieval_completion`` (exhaustive Top-k) that the Triton kernels are tested against.
Everything here computes in fp64 and is written for clarity, not speed.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from macattn.methods.completion.config import SELECTORS
from macattn.methods.completion.gate import CompletionGate

from macattn.core.validation import check_int

__all__ = ["Partition", "partition", "Selector", "ExhaustiveTopK", "PageSummaryTopK", "make_selector", "page_bounds",
           "page_upper_bounds", "select_pages_reference", "build_completion_cache", "build_completion_cache_batched", "subtract_retrieved", "hybrid_decode_step", "mid_pages",
           "page_retrieval_completion_step", "select_mid_pages_reference",
           "decode_retrieved_reference", "retrieval_completion_step", "selection_only_step", "sink_tail_step", "full_attention_step", "token_equivalents", "budget_top_k",
           "equal_cost_top_k", "layer_top_k"]

@dataclass(frozen=True)
class Partition:
    """Index ranges of one request: sink ``[0, mid_start)``, mid ``[mid_start, mid_end)``,
    tail ``[mid_end, n_prefill)``, generated ``[n_prefill, seq_len)``."""

    mid_start: int
    mid_end: int
    n_prefill: int
    seq_len: int

    @property
    def mid_len(self) -> int:
        return self.mid_end - self.mid_start


def partition(n_prefill: int, seq_len: int, *, n_sink: int, n_tail: int) -> Partition:
    """Sink / mid / tail / generated ranges for a request (see ``Partition``)."""
    check_int("n_sink", n_sink, 0)
    check_int("n_tail", n_tail, 0)
    check_int("n_prefill", n_prefill, 0)
    check_int("seq_len", seq_len, n_prefill)
    s0 = min(n_sink, n_prefill)
    return Partition(s0, max(s0, n_prefill - n_tail), n_prefill, seq_len)


# ----------------------------------------------------------------------------- selectors


@runtime_checkable
class Selector(Protocol):
    """Chooses the retrieved mid tokens of one request and KV group.

    ``select(q [H, d], k_mid [M, d], k, scale) -> idx [H, k]`` int64 indices into the mid region
    (distinct per row), ``0 <= k <= M``; ``H`` is the number of query heads sharing the keys.
    """

    def select(self, q: torch.Tensor, k_mid: torch.Tensor, k: int, scale: float) -> torch.Tensor: ...


class ExhaustiveTopK:
    """Exact Top-k of ``scale * q·k_t`` over the whole mid region (ties in any order)."""

    def select(self, q: torch.Tensor, k_mid: torch.Tensor, k: int, scale: float) -> torch.Tensor:
        if k == 0:
            return torch.zeros(q.shape[0], 0, dtype=torch.int64, device=q.device)
        logits = scale * (q.double() @ k_mid.double().T)
        return logits.topk(k, dim=-1).indices


def page_bounds(k: torch.Tensor, page_size: int, dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-page, per-channel ``(min, max)`` of keys ``k [..., T, d]``: each ``[..., P, d]`` in ``dtype``,
    ``P = ceil(T / page_size)``, the last page's over its real tokens (Quest's page summary)."""
    check_int("page_size", page_size, 1)
    *lead, T, d = k.shape
    P = -(-T // page_size)
    pad = P * page_size - T
    kd = k.to(dtype)
    lo = torch.cat([kd, kd.new_full((*lead, pad, d), math.inf)], -2).view(*lead, P, page_size, d).amin(-2)
    hi = torch.cat([kd, kd.new_full((*lead, pad, d), -math.inf)], -2).view(*lead, P, page_size, d).amax(-2)
    return lo, hi


def page_upper_bounds(q: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """``Σ_j max(q_j lo_j, q_j hi_j)`` >= ``q·k`` for every key of a page: ``q [..., H, d]``, ``lo / hi
    [..., P, d]`` -> ``[..., H, P]`` fp64."""
    qd = q.double()[..., :, None, :]
    return torch.maximum(qd * lo.double()[..., None, :, :], qd * hi.double()[..., None, :, :]).sum(-1)


def select_pages_reference(q: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, n_pages: torch.Tensor,
                           budget: int) -> torch.Tensor:
    """The page selector of the offloaded decode, per KV head: ``q [B, Hq, d]`` (the step's queries),
    ``lo / hi [B, Hkv, P, d]`` page bounds, ``n_pages [B]`` valid pages per request, ``budget`` pages
    per KV head -> ``[B, Hkv, budget]`` int64 page indices, ascending, ``-1`` past the valid pages.

    A page's score for a KV head is the largest upper bound over the query heads sharing it (a page
    any of them may need); the ``budget`` best pages are kept, ties to the lower page index."""
    check_int("budget", budget, 0)
    B, Hq, _ = q.shape
    Hkv, P = lo.shape[1], lo.shape[2]
    score = page_upper_bounds(q.view(B, Hkv, Hq // Hkv, -1), lo, hi).amax(2)        # [B, Hkv, P]
    valid = (torch.arange(P, device=q.device)[None, None, :] < n_pages.view(B, 1, 1).to(q.device)).expand(B, Hkv, P)
    score = score.masked_fill(~valid, -math.inf)
    order = torch.sort(score, dim=-1, descending=True, stable=True).indices[..., :budget]
    keep = torch.gather(valid, 2, order)
    pages = torch.sort(torch.where(keep, order, P), dim=-1).values                 # invalid ones last
    pages = torch.where(pages < P, pages, -1)
    return torch.cat([pages, pages.new_full((B, Hkv, budget - pages.shape[-1]), -1)], -1)


class PageSummaryTopK:
    """Quest-style approximate selector.

    The mid region is cut into pages of ``page_size`` tokens; each page is summarised by the
    per-channel min and max of its keys (computed once at prefill in a real system). For a
    query, ``Σ_j max(q_j·min_j, q_j·max_j)`` upper-bounds ``q·k`` over the page; the
    ``ceil(k / page_size) * overfetch`` pages with the largest bound are kept and the exact
    Top-k is taken over their tokens. With enough pages kept this equals ``ExhaustiveTopK``.
    """

    def __init__(self, page_size: int = 16, overfetch: int = 2) -> None:
        check_int("page_size", page_size, 1)
        check_int("overfetch", overfetch, 1)
        self.page_size, self.overfetch = page_size, overfetch

    @staticmethod
    def page_bounds(k_mid: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-page channel ``(min, max)``, each ``[P, d]`` fp64 (last page may be partial)."""
        return page_bounds(k_mid, page_size)

    def select(self, q: torch.Tensor, k_mid: torch.Tensor, k: int, scale: float) -> torch.Tensor:
        h, m = q.shape[0], k_mid.shape[0]
        if k == 0:
            return torch.zeros(h, 0, dtype=torch.int64, device=q.device)
        lo, hi = self.page_bounds(k_mid, self.page_size)
        qd = q.double()
        bound = page_upper_bounds(qd, lo, hi)                                    # [H, P]
        n_keep = min(lo.shape[0], -(-k // self.page_size) * self.overfetch)
        pages = bound.topk(n_keep, dim=-1).indices  # [H, n_keep]
        tok = (pages[:, :, None] * self.page_size + torch.arange(self.page_size, device=q.device)).reshape(h, -1)
        valid = tok < m
        logits = scale * (qd[:, None, :] * k_mid.double()[tok.clamp(max=m - 1)]).sum(-1)
        logits = logits.masked_fill(~valid, -math.inf)
        if int(valid.sum(-1).min()) < k:  # too few candidate tokens: fall back to exhaustive
            return ExhaustiveTopK().select(q, k_mid, k, scale)
        pick = logits.topk(k, dim=-1).indices
        return tok.gather(1, pick)


def make_selector(name: str, *, page_size: int = 16, overfetch: int = 2) -> Selector:
    """``"exact"`` → ``ExhaustiveTopK``; ``"pages"`` → ``PageSummaryTopK``."""
    if name == "exact":
        return ExhaustiveTopK()
    if name == "pages":
        return PageSummaryTopK(page_size, overfetch)
    raise ValueError(f"selector must be one of {SELECTORS[:2]} (token selectors), got {name!r}")


# ----------------------------------------------------------------------------- completion cache


def build_completion_cache(log_phi_k_mid: torch.Tensor, v_mid: torch.Tensor):
    """Stable completion cache of a mid region.

    log_phi_k_mid ``[..., M, F]`` (log φ_k of the mid keys), v_mid ``[..., M, d]`` with the
    same leading dims (e.g. ``[Hkv]`` or ``[B, Hkv]``). Returns fp32 ``(A [..., F, d],
    b [..., F], shift [..., F])`` with ``shift_f = max_t log φ_k[t, f]`` (0 where that is
    not finite, e.g. ``M = 0``), ``b_f = Σ_t exp(log φ_k[t, f] - shift_f)`` and
    ``A_f = Σ_t exp(log φ_k[t, f] - shift_f) v_t``. Empty ``M`` gives ``A = b = 0``.
    """
    if log_phi_k_mid.dim() < 2 or v_mid.dim() != log_phi_k_mid.dim():
        raise ValueError(f"log_phi_k_mid [..., M, F] and v_mid [..., M, d] must have the same rank >= 2, "
                         f"got {tuple(log_phi_k_mid.shape)} and {tuple(v_mid.shape)}")
    if log_phi_k_mid.shape[:-1] != v_mid.shape[:-1]:
        raise ValueError(f"log_phi_k_mid and v_mid must agree on [..., M], got {tuple(log_phi_k_mid.shape)} "
                         f"and {tuple(v_mid.shape)}")
    lp = log_phi_k_mid.double()
    if lp.shape[-2] == 0:
        shift = lp.new_zeros(lp.shape[:-2] + lp.shape[-1:])
    else:
        shift = lp.amax(-2)
        shift = torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift))
    w = torch.exp(lp - shift.unsqueeze(-2))  # [..., M, F], all <= 1
    b = w.sum(-2)
    a = w.transpose(-1, -2) @ v_mid.double()
    return a.float(), b.float(), shift.float()


def build_completion_cache_batched(log_phi_k: torch.Tensor, v_cache: torch.Tensor, n_prefill: torch.Tensor, *,
                                   n_sink: int, n_tail: int):
    """Completion caches of a batch with per-row mid regions.

    log_phi_k ``[B, Hkv, T, F]``, v_cache ``[B, Hkv, T, d]``, n_prefill ``[B]`` int. Returns fp32
    ``A [B, Hkv, F, d]``, ``b [B, Hkv, F]``, ``shift [B, Hkv, F]`` (rows with an empty mid: zeros).
    """
    bsz, hkv, t, f = log_phi_k.shape
    d = v_cache.shape[-1]
    a = torch.zeros(bsz, hkv, f, d, dtype=torch.float32, device=v_cache.device)
    b = torch.zeros(bsz, hkv, f, dtype=torch.float32, device=v_cache.device)
    sh = torch.zeros(bsz, hkv, f, dtype=torch.float32, device=v_cache.device)
    for i in range(bsz):
        n = int(n_prefill[i])
        p = partition(n, n, n_sink=n_sink, n_tail=n_tail)
        a[i], b[i], sh[i] = build_completion_cache(log_phi_k[i, :, p.mid_start:p.mid_end],
                                                   v_cache[i, :, p.mid_start:p.mid_end])
    return a, b, sh


def subtract_retrieved(comp_a: torch.Tensor, comp_b: torch.Tensor, comp_shift: torch.Tensor,
                       log_phi_k_sel: torch.Tensor, v_sel: torch.Tensor):
    """One-way clamped subtraction of retrieved tokens from a completion cache (fp64).

    comp_a ``[..., F, d]``, comp_b / comp_shift ``[..., F]``, log_phi_k_sel ``[..., k, F]``,
    v_sel ``[..., k, d]``. Returns ``(A' [..., F, d], b' [..., F])`` with ``b' >= 0`` and
    ``A'_f = 0`` wherever ``b'_f = 0``.
    """
    w = torch.exp(log_phi_k_sel.double() - comp_shift.double().unsqueeze(-2))  # [..., k, F]
    b2 = (comp_b.double() - w.sum(-2)).clamp_min(0.0)
    a2 = comp_a.double() - w.transpose(-1, -2) @ v_sel.double()
    a2 = torch.where((b2 > 0).unsqueeze(-1), a2, torch.zeros_like(a2))
    return a2, b2


# ----------------------------------------------------------------------------- decode step


def _check_step_inputs(q, k_cache, v_cache, seq_lens, n_prefill):
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"q must be [B, Hq, d] and k_cache / v_cache [B, Hkv, T, d] (same shape), got "
                         f"{tuple(q.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    bsz, hq, d = q.shape
    if k_cache.shape[0] != bsz or k_cache.shape[3] != d:
        raise ValueError(f"k_cache must be [B={bsz}, Hkv, T, d={d}], got {tuple(k_cache.shape)}")
    hkv, t = k_cache.shape[1], k_cache.shape[2]
    if hkv < 1 or hq % hkv:
        raise ValueError(f"Hq={hq} must be a positive multiple of Hkv={hkv}")
    for name, x in (("seq_lens", seq_lens), ("n_prefill", n_prefill)):
        if x.shape != (bsz,) or x.dtype.is_floating_point or x.dtype == torch.bool:
            raise TypeError(f"{name} must be an integer tensor [B={bsz}], got {x.dtype} {tuple(x.shape)}")
    sl, npf = seq_lens.tolist(), n_prefill.tolist()
    for i in range(bsz):
        if not 1 <= sl[i] <= t:
            raise ValueError(f"seq_lens[{i}] must be in [1, T={t}], got {sl[i]}")
        if not 0 <= npf[i] <= sl[i]:
            raise ValueError(f"n_prefill[{i}] must be in [0, seq_lens[{i}]={sl[i]}], got {npf[i]}")
    return bsz, hq, hkv, d, sl, npf


def mid_pages(p: Partition, page_size: int) -> tuple[int, int]:
    """``(first, count)``: the pages of ``page_size`` tokens on absolute positions that overlap the mid of
    ``p`` (``first = n_sink // page_size`` whenever the mid is non-empty, as ``s0 = n_sink`` then; count 0
    for an empty mid). Every one of them holds mid tokens; the page selector chooses among them."""
    check_int("page_size", page_size, 1)
    if p.mid_len == 0:
        return 0, 0
    first = p.mid_start // page_size
    return first, -(-p.mid_end // page_size) - first


def hybrid_decode_step(q, k_cache, v_cache, seq_lens, n_prefill, *, n_sink: int, n_tail: int, top_k: int,
                       scale: float | None = None, selector: Selector | None = None, completion=None,
                       page_size: int = 0, pages: torch.Tensor | None = None, return_parts: bool = False):
    """One decode step of the whole family (reference, fp64), see the module docstring.

    q ``[B, Hq, d]``, k_cache / v_cache ``[B, Hkv, T, d]``, seq_lens / n_prefill ``[B]`` int.
    completion: ``None`` (selection-only: softmax renormalised over the exact set; with
    ``top_k = 0`` this is sink+tail) or ``(log_phi_q [B, Hq, F], log_phi_k [B, Hkv, T, F],
    comp_A [B, Hkv, F, d], comp_b [B, Hkv, F], comp_shift [B, Hkv, F])``.
    page_size > 0: the page selector, no token refinement — ``top_k`` counts pages per KV head, chosen by
    ``select_pages_reference`` from Quest bounds of the row's prefill keys among the pages overlapping the
    mid (``mid_pages``), and every mid token of a chosen page is retrieved (``selector`` unused);
    ``pages [B, Hkv, top_k]`` (absolute page indices, -1 = none) replays a given selection instead.
    The completion term applies iff the retrieved set misses a mid token.
    Returns ``out [B, Hq, d]`` in q's dtype; with ``return_parts`` also a dict of fp64
    ``[B, Hq]`` tensors: ``lse_exact`` (log Σ_E e^{l_t}), ``lse_comp`` (log of the completion
    denominator, -inf when none) and ``k_eff`` (retrieved tokens, int64), and of fp64 ``[B, Hq, d]`` tensors
    ``out_exact`` (softmax over the exact set alone) and ``out_comp`` (the completion's ``num / den``, 0 when
    none): ``out`` is their mix with weights ``e^lse_exact`` and ``e^lse_comp`` (``mass.reweighed_output``).
    """
    check_int("top_k", top_k, 0)
    check_int("page_size", page_size, 0)
    bsz, hq, hkv, d, sl, npf = _check_step_inputs(q, k_cache, v_cache, seq_lens, n_prefill)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    selector = ExhaustiveTopK() if selector is None else selector
    grp = hq // hkv
    if pages is not None and (not page_size or tuple(pages.shape) != (bsz, hkv, top_k)):
        raise ValueError(f"pages must be [B={bsz}, Hkv={hkv}, top_k={top_k}] with page_size > 0, got "
                         f"{tuple(pages.shape)} (page_size={page_size})")
    if completion is not None:
        log_phi_q, log_phi_k, comp_a, comp_b, comp_shift = completion
        f = log_phi_q.shape[-1]
        t = k_cache.shape[2]
        for name, x, shape in (("log_phi_q", log_phi_q, (bsz, hq, f)), ("log_phi_k", log_phi_k, (bsz, hkv, t, f)),
                               ("comp_A", comp_a, (bsz, hkv, f, d)), ("comp_b", comp_b, (bsz, hkv, f)),
                               ("comp_shift", comp_shift, (bsz, hkv, f))):
            if tuple(x.shape) != shape:
                raise ValueError(f"{name} must have shape {list(shape)}, got {list(x.shape)}")
    out = torch.empty(bsz, hq, d, dtype=torch.float64, device=q.device)
    parts = {k: torch.full((bsz, hq), -math.inf, dtype=torch.float64) for k in ("lse_exact", "lse_comp")}
    parts["k_eff"] = torch.zeros(bsz, hq, dtype=torch.int64)
    for name in ("out_exact", "out_comp"):
        parts[name] = torch.zeros(bsz, hq, d, dtype=torch.float64)
    heads = torch.arange(hq, device=q.device)
    for i in range(bsz):
        p = partition(npf[i], sl[i], n_sink=n_sink, n_tail=n_tail)
        L = p.seq_len
        kk = k_cache[i, :, :L].double().repeat_interleave(grp, 0)  # [Hq, L, d]
        vv = v_cache[i, :, :L].double().repeat_interleave(grp, 0)
        qd = q[i].double()
        logits = scale * torch.einsum("hd,htd->ht", qd, kk)  # [Hq, L]
        # R as a mask over the mid [Hq, M]
        sel = torch.zeros(hq, p.mid_len, dtype=torch.bool, device=q.device)
        if page_size:
            chosen = pages[i] if pages is not None else _mid_page_choice(q[i], k_cache[i, :, :L], p.n_prefill,
                                                                        n_sink, n_tail, page_size, top_k)
            for g in range(hkv):
                for pg in chosen[g].tolist():
                    if pg >= 0:
                        lo_t, hi_t = max(pg * page_size, p.mid_start), min((pg + 1) * page_size, p.mid_end)
                        sel[g * grp:(g + 1) * grp, max(lo_t - p.mid_start, 0):max(hi_t - p.mid_start, 0)] = True
        else:
            k_eff = min(top_k, p.mid_len)
            if k_eff:
                idx = torch.cat([selector.select(qd[g * grp:(g + 1) * grp], k_cache[i, g, p.mid_start:p.mid_end],
                                                 k_eff, scale) for g in range(hkv)])
                sel[heads[:, None], idx] = True
        parts["k_eff"][i] = sel.sum(-1).cpu()
        exact = torch.ones(hq, L, dtype=torch.bool, device=q.device)
        exact[:, p.mid_start:p.mid_end] = sel
        le = logits.masked_fill(~exact, -math.inf)
        comp_i = None
        if completion is not None and not bool(sel.all()):  # R = M: nothing left to complete, exact
            gi = torch.arange(hq, device=q.device) // grp
            lpk_sel = log_phi_k[i][gi, p.mid_start:p.mid_end].double().masked_fill(~sel[..., None], -math.inf)
            comp_i = (log_phi_q[i], lpk_sel, vv[:, p.mid_start:p.mid_end], comp_a[i][gi], comp_b[i][gi],
                      comp_shift[i][gi])
        out[i], parts["lse_exact"][i], parts["lse_comp"][i], parts["out_exact"][i], parts["out_comp"][i] = \
            _merge_one_normalisation(le, vv, comp_i)
    out = out.to(q.dtype)
    return (out, parts) if return_parts else out


def _merge_one_normalisation(le: torch.Tensor, vv: torch.Tensor, completion=None):
    """docs/spec.md §3's one normalisation for the ``H`` query heads of one row (fp64): exact logits ``le [H, n]``
    (``-inf`` off the exact set) over values ``vv [H, n, d]``; ``completion`` None or ``(log_phi_q [H, F],
    lpk_sel [H, k, F] (-inf rows: not retrieved), v_sel [H, k, d], comp_A [H, F, d], comp_b [H, F],
    comp_shift [H, F])``: the cache minus the retrieved tokens (``subtract_retrieved``). Returns
    ``(out [H, d], lse_exact [H], lse_comp [H], out_exact [H, d], out_comp [H, d])`` (the last two: each part's
    own normalised value, 0 where its denominator is 0; the log-sum-exps and these on the CPU)."""
    m = le.amax(-1)
    if completion is not None:
        lpq, lpk_sel, v_sel, comp_a, comp_b, comp_shift = completion
        a2, b2 = subtract_retrieved(comp_a, comp_b, comp_shift, lpk_sel, v_sel)
        la = lpq.double() + comp_shift.double() + torch.log(b2)  # -inf where b' = 0
        m = torch.maximum(m, la.amax(-1))
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # nothing to attend: out = 0
        wc = torch.exp(la - m[:, None])  # [H, F]
        den_c = wc.sum(-1)
        num_c = torch.einsum("hf,hfd->hd", wc, torch.where(b2[..., None] > 0, a2 / b2.clamp_min(1e-300)[..., None],
                                                            torch.zeros_like(a2)))
    else:
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        den_c = le.new_zeros(le.shape[0])
        num_c = vv.new_zeros(vv.shape[0], vv.shape[2])
    we = torch.exp(le - m[:, None])
    den_e = we.sum(-1)
    den = (den_e + den_c)[:, None]
    num_e = torch.einsum("ht,htd->hd", we, vv)
    out = torch.where(den > 0, (num_e + num_c) / den.clamp_min(1e-300), 0.0)
    o_e = torch.where(den_e[:, None] > 0, num_e / den_e.clamp_min(1e-300)[:, None], 0.0)
    o_c = torch.where(den_c[:, None] > 0, num_c / den_c.clamp_min(1e-300)[:, None], 0.0)
    return out, (torch.log(den_e) + m).cpu(), (torch.log(den_c) + m).cpu(), o_e.cpu(), o_c.cpu()


def decode_retrieved_reference(q, k, v, seq_lens, n_prefill, log_phi_q, comp_A, comp_b, comp_shift, idx, *,
                               retrieved, n_sink: int, n_tail: int, top_k: int, scale: float | None = None,
                               page_size: int = 0, rows: torch.Tensor | None = None,
                               anchors_compact: bool = False) -> torch.Tensor:
    """fp64 reference of ``macattn.plugins.retrieval_completion.op.decode_retrieved_triton`` (the tail every
    selector shares), same arguments: anchors in ``k / v [B, Hkv, T, d]`` at their positions or in item order
    (``anchors_compact``), retrieved positions ``idx [B, Hq or Hkv, K]`` (those outside the row's mid
    skipped), read from ``retrieved = (kr, vr, log_phi_k)`` at those positions or at ``rows``; the completion
    applies iff ``top_k`` tokens (``page_size = 0``) / pages miss some of the mid (``mid_pages``).
    ``out [B, Hq, d]`` in q's dtype."""
    B, Hq, d = q.shape
    Hkv = k.shape[1]
    grp = Hq // Hkv
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    kr, vr, lpk = retrieved
    rows = idx if rows is None else rows
    per_kv = idx.shape[1] == Hkv and grp > 1
    out = torch.empty(B, Hq, d, dtype=torch.float64)
    for i in range(B):
        p = partition(int(n_prefill[i]), int(seq_lens[i]), n_sink=n_sink, n_tail=n_tail)
        n_anchor = p.mid_start + p.seq_len - p.mid_end
        arow = (torch.arange(n_anchor) if anchors_compact else
                torch.cat([torch.arange(p.mid_start), torch.arange(p.mid_end, p.seq_len)]))
        ka = k[i, :, arow].double().repeat_interleave(grp, 0)        # [Hq, n_anchor, d]
        va = v[i, :, arow].double().repeat_interleave(grp, 0)
        pos = idx[i].repeat_interleave(grp, 0) if per_kv else idx[i]  # [Hq, K]
        rr = rows[i].repeat_interleave(grp, 0) if per_kv else rows[i]
        ok = (pos >= p.mid_start) & (pos < p.mid_end)
        gi = torch.arange(Hq) // grp
        rsafe = torch.where(ok, rr, 0)
        kk = kr[i][gi[:, None], rsafe].double()                       # [Hq, K, d]
        vk = vr[i][gi[:, None], rsafe].double()
        qd = q[i].double()
        le = torch.cat([scale * torch.einsum("hd,htd->ht", qd, ka),
                        (scale * torch.einsum("hd,htd->ht", qd, kk)).masked_fill(~ok, -math.inf)], 1)
        vv = torch.cat([va, vk], 1)
        if page_size:
            use = top_k < mid_pages(p, page_size)[1]
        else:
            use = top_k < p.mid_len
        comp_i = None
        if use:
            lpk_sel = lpk[i][gi[:, None], rsafe].double().masked_fill(~ok[..., None], -math.inf)
            comp_i = (log_phi_q[i], lpk_sel, vk, comp_A[i][gi], comp_b[i][gi], comp_shift[i][gi])
        out[i] = _merge_one_normalisation(le, vv, comp_i)[0]
    return out.to(q.dtype)


def _mid_page_choice(q_i: torch.Tensor, k_row: torch.Tensor, n_prefill: int, n_sink: int, n_tail: int,
                     page_size: int, budget: int) -> torch.Tensor:
    """The page selector of one row: ``q_i [Hq, d]``, ``k_row [Hkv, L, d]`` (the keys in its cache, whose
    bounds the state keeps) -> ``[Hkv, budget]`` absolute page indices (``select_mid_pages_reference``)."""
    lo, hi = page_bounds(k_row, page_size)
    return select_mid_pages_reference(q_i[None], lo[None], hi[None], torch.tensor([n_prefill]), n_sink=n_sink,
                                      n_tail=n_tail, page_size=page_size, budget=budget)[0]


def select_mid_pages_reference(q: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, n_prefill: torch.Tensor, *,
                               n_sink: int, n_tail: int, page_size: int, budget: int) -> torch.Tensor:
    """``select_pages_reference`` over each row's ``mid_pages``: ``q [B, Hq, d]``, ``lo / hi [B, Hkv, P, d]``
    bounds of absolute pages, ``n_prefill [B]`` -> ``[B, Hkv, budget]`` int64 absolute page indices,
    ascending, -1 past the selectable ones (the contract of ``macattn.plugins.retrieval_completion.op.
    select_mid_pages``)."""
    B, Hkv, P = lo.shape[0], lo.shape[1], lo.shape[2]
    first = n_sink // page_size
    counts = [mid_pages(partition(int(n), int(n), n_sink=n_sink, n_tail=n_tail), page_size)[1]
              for n in n_prefill.tolist()]
    if first >= P or budget == 0:
        return torch.full((B, Hkv, budget), -1, dtype=torch.int64)
    chosen = select_pages_reference(q, lo[:, :, first:], hi[:, :, first:], torch.tensor(counts), budget).cpu()
    return torch.where(chosen >= 0, chosen + first, chosen)


def page_retrieval_completion_step(q, k_cache, v_cache, seq_lens, n_prefill, log_phi_q, log_phi_k, comp_A, comp_b,
                                   comp_shift, *, n_sink: int, n_tail: int, page_size: int, budget_pages: int,
                                   scale: float | None = None, pages: torch.Tensor | None = None) -> torch.Tensor:
    """The page-selector decode step (the GPU-resident and offloaded ops' reference): inputs as
    ``retrieval_completion_step``; ``budget_pages`` pages of ``page_size`` tokens per KV head chosen by Quest
    bounds among the pages overlapping the mid, all their mid tokens retrieved (no token refinement);
    ``pages`` replays a selection ``[B, Hkv, budget_pages]``. ``out [B, Hq, d]`` in q's dtype."""
    check_int("page_size", page_size, 1)
    return hybrid_decode_step(q, k_cache, v_cache, seq_lens, n_prefill, n_sink=n_sink, n_tail=n_tail,
                              top_k=budget_pages, scale=scale, page_size=page_size, pages=pages,
                              completion=(log_phi_q, log_phi_k, comp_A, comp_b, comp_shift))


def retrieval_completion_step(q, k_cache, v_cache, seq_lens, n_prefill, log_phi_q, log_phi_k, comp_A, comp_b,
                              comp_shift, *, n_sink: int, n_tail: int, top_k: int,
                              scale: float | None = None) -> torch.Tensor:
    """Batched decode step of ``macattn::retrieval_completion`` (exhaustive Top-k), reference.

    q ``[B, Hq, d]`` post-RoPE; k_cache / v_cache ``[B, Hkv, T, d]`` (post-RoPE keys); seq_lens
    ``[B]`` int (tokens in cache incl. generated, ``<= T``); n_prefill ``[B]`` int (prefill length
    ``N``); log_phi_q ``[B, Hq, F]`` fp32 (log φ_q(q)); log_phi_k ``[B, Hkv, T, F]`` (log φ_k of each
    cached key; only mid rows are read); comp_A ``[B, Hkv, F, d]`` fp32, comp_b ``[B, Hkv, F]`` fp32,
    comp_shift ``[B, Hkv, F]`` fp32 (stable completion cache over the mid region, see
    ``build_completion_cache``). Returns out ``[B, Hq, d]`` in q's dtype. Semantics: module docstring.
    """
    return hybrid_decode_step(q, k_cache, v_cache, seq_lens, n_prefill, n_sink=n_sink, n_tail=n_tail, top_k=top_k,
                              scale=scale, completion=(log_phi_q, log_phi_k, comp_A, comp_b, comp_shift))


def selection_only_step(q, k_cache, v_cache, seq_lens, n_prefill, *, n_sink: int, n_tail: int, top_k: int,
                        scale: float | None = None, selector: Selector | None = None) -> torch.Tensor:
    """Baseline: softmax renormalised over sink ∪ tail ∪ Top-k(mid) ∪ generated (no completion)."""
    return hybrid_decode_step(q, k_cache, v_cache, seq_lens, n_prefill, n_sink=n_sink, n_tail=n_tail, top_k=top_k,
                              scale=scale, selector=selector)


def sink_tail_step(q, k_cache, v_cache, seq_lens, n_prefill, *, n_sink: int, n_tail: int,
                   scale: float | None = None) -> torch.Tensor:
    """Baseline: softmax over sink ∪ tail ∪ generated only (StreamingLLM-style)."""
    return hybrid_decode_step(q, k_cache, v_cache, seq_lens, n_prefill, n_sink=n_sink, n_tail=n_tail, top_k=0,
                              scale=scale)


def full_attention_step(q, k_cache, v_cache, seq_lens, *, scale: float | None = None) -> torch.Tensor:
    """Exact decode attention over ``[0, seq_lens[i])`` (fp64 reference), ``[B, Hq, d]`` in q's dtype."""
    n = torch.zeros_like(seq_lens)
    return hybrid_decode_step(q, k_cache, v_cache, seq_lens, n, n_sink=0, n_tail=0, top_k=0, scale=scale)


# ----------------------------------------------------------------------------- budget


def token_equivalents(*, exact_tokens: int, feature_dim: int, head_dim: int, gen_len: int | None = 1,
                      retrieved: int = 0, completion: bool = True) -> dict:
    """Per-step KV reads of one KV head in token-equivalents (1 = one token's K and V, ``2d`` elements).

    ``exact_tokens``: tokens read exactly this step (sink + tail + retrieved + generated).
    With completion: the stable cache ``A [F, d], b [F], shift [F]`` is ``F·d + 2F`` elements,
    i.e. ``(F·d + 2F) / (2d)`` token-equivalents, fetched once per request and amortised over
    ``gen_len`` decode steps (``gen_len = 1`` is the paper's conservative worst case); plus
    ``retrieved · F / (2d)`` per step for reading the retrieved tokens' ``log φ_k`` rows needed by
    the subtraction (the paper does not charge these; we do — they could instead be recomputed
    from the keys with φ_k). Returns a dict with the parts and ``total``.
    """
    check_int("exact_tokens", exact_tokens, 0)
    check_int("feature_dim", feature_dim, 1)
    check_int("head_dim", head_dim, 1)
    check_int("retrieved", retrieved, 0)
    if gen_len is not None:
        check_int("gen_len", gen_len, 1)
    cache = (feature_dim * head_dim + 2 * feature_dim) / (2 * head_dim) if completion else 0.0
    amort = cache / (1 if gen_len is None else gen_len)
    feat = retrieved * feature_dim / (2 * head_dim) if completion else 0.0
    return {"exact": float(exact_tokens), "cache_once": cache, "cache_amortised": amort, "feature_reads": feat,
            "total": exact_tokens + amort + feat}


def budget_top_k(budget_tokens: float, *, anchors: int, feature_dim: int, head_dim: int, gen_len: int = 1,
                 completion: bool, mid_len: int) -> int | None:
    """Largest retrieved count ``k`` whose per-step token-equivalents fit ``budget_tokens``.

    anchors: always-exact tokens (sink + tail + generated). Selection-only spends
    ``anchors + k``; completion ``anchors + k + cache/gen_len + k·F/(2d)``. Returns ``None`` when
    even ``k = 0`` does not fit (the paper's "–" entry), else ``min(k, mid_len)``.
    """
    fixed = token_equivalents(exact_tokens=anchors, feature_dim=feature_dim, head_dim=head_dim, gen_len=gen_len,
                              completion=completion)["total"]
    per_tok = 1.0 + (feature_dim / (2 * head_dim) if completion else 0.0)
    room = budget_tokens - fixed
    if room < 0:
        return None
    return min(mid_len, int(math.floor(room / per_tok + 1e-9)))


def equal_cost_top_k(k: int, *, feature_dim: int, head_dim: int, gen_len: int) -> int:
    """Top-k alone at the token-equivalents of completion with Top-k ``k`` (``token_equivalents``: ``k``
    tokens, the cache amortised over ``gen_len`` steps and ``k`` rows of ``log φ_k``), rounded down."""
    check_int("k", k, 0)
    te = token_equivalents(exact_tokens=k, feature_dim=feature_dim, head_dim=head_dim, gen_len=gen_len, retrieved=k)
    return int(math.floor(te["total"] + 1e-9))


def layer_top_k(gate: CompletionGate | None, layer: int, k: int, *, feature_dim: int,
                head_dim: int) -> tuple[int, bool]:
    """``(Top-k, completion term on)`` of ``layer`` under ``gate`` (``CompletionConfig.gate``) for a request whose
    Top-k is ``k`` (``top_k`` or ``k_for``): ``(k, True)`` without a gate or where it is on; where it is off,
    Top-k alone within the same token-equivalents and False: the gate's ``off_top_k`` Top-k alone where ``k`` is
    the Top-k it was tuned at (that budget's own Top-k alone), else ``equal_cost_top_k`` with the gate's
    ``gen_len`` (``feature_dim`` of the maps, ``head_dim`` of the model)."""
    check_int("layer", layer, 0)
    if gate is None:
        return k, True
    if layer >= gate.num_layers:
        raise ValueError(f"layer must be < the gate's {gate.num_layers} layers, got {layer}")
    if gate.layers[layer]:
        return k, True
    if gate.off_top_k is not None and gate.off_top_k[0] == k:
        return gate.off_top_k[1], False
    return equal_cost_top_k(k, feature_dim=feature_dim, head_dim=head_dim, gen_len=gate.gen_len), False
