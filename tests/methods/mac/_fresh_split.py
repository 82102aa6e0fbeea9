"""Shared by the fresh-segment split's tests (``seeding.fresh_split_attention`` inside ``MacAttention.prefill``'s
packed path): packed calls of chosen segment shapes through one MAC layer, run with the split and with it forced off
(today's path: the whole segment's causal attention, then the seeding's own pass), and plain-torch stand-ins for the
flash kernels so the CPU runs the fused seeding's logic in fp64 (``use_stand_in_kernels``).

Segment shapes are given in units of the window ``K`` and band ``b`` (``cases``), so the CPU (``K = 16``) and the
GPU (``K = 1024``) run the same edges."""
from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from macattn.core import flash_split, ragged
from macattn.core.ragged import PrefillSegment, RaggedPrefill
from macattn.methods.base import ModelDims, StepContext
from macattn.methods.mac import backend, seeding
from macattn.methods.mac.backend import MacAttention
from macattn.methods.mac.config import MacConfig

POISON_POS = -7         # ring_pos's poison (an int64 ring has no NaN)


@dataclass(frozen=True)
class Seg:
    """A chunk of ``length`` tokens at prompt positions ``start ..``; ``prompt_end``: its prompt's length where a
    later chunk follows (``PrefillSegment.prompt_end``)."""

    start: int
    length: int
    prompt_end: int | None = None


def cases(K: int, b: int) -> dict[str, tuple[list[Seg], list[bool]]]:
    """Per name: the segments of one packed call and, in order, whether each fresh segment that keeps ring positions
    takes the split (``fresh_split_attention`` returns parts): ``L = K + b`` (the shortest that splits),
    ``L = K + b - 1`` (falls back), a prompt within the window (falls back), and one call mixing a long fresh prompt,
    a continued chunk (``band_split_attention``), a fresh one one short, the first chunk of a prompt whose last ``K``
    straddle it and the next, a first chunk keeping no ring position and a one-token prompt."""
    return {
        "exact": ([Seg(0, K + b)], [True]),
        "one_short": ([Seg(0, K + b - 1)], [False]),
        "window_over_prompt": ([Seg(0, K - 3)], [False]),
        "mixed": ([Seg(0, 3 * K), Seg(2 * K, K + K // 2), Seg(0, K + b - 1), Seg(0, K + K // 2, prompt_end=2 * K),
                   Seg(0, K // 2, prompt_end=5 * K), Seg(0, 1)], [True, False, True, False]),
    }


@dataclass
class Packed:
    """One packed call's operands as the runtime lays them out: ``query / q_pre [1, Hq, N, d]`` and ``key / value
    [1, Hkv, N, d]`` token-major views (``[1, N, H, d]`` transposed), continued segments' history in scattered rows of
    ``k_pool / v_pool [rows, Hkv, d]``."""

    plan: RaggedPrefill
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    q_pre: torch.Tensor


def packed_call(segs: list[Seg], *, Hq: int, Hkv: int, d: int, dtype: torch.dtype, device, seed: int) -> Packed:
    """Random operands (N(0, 1), fixed ``seed``) for the segments ``segs``, slots ``0 .. len(segs) - 1``."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(device, dtype)

    N, rows = sum(s.length for s in segs), sum(s.start for s in segs) + 8
    k_pool, v_pool = rand(rows, Hkv, d), rand(rows, Hkv, d)
    perm = torch.randperm(rows, generator=g).to(device)
    segments, off, r = [], 0, 0
    for i, s in enumerate(segs):
        history = perm[r: r + s.start] if s.start else None
        segments.append(PrefillSegment(off, s.length, s.start, slot=i, history=history, prompt_end=s.prompt_end))
        off, r = off + s.length, r + s.start
    tm = [rand(1, N, h, d).transpose(1, 2) for h in (Hq, Hkv, Hkv, Hq)]
    return Packed(RaggedPrefill(segments, [k_pool], [v_pool]), *tm)


def run_layer(p: Packed, *, window: int, band: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``MacAttention.prefill`` of one layer over ``p`` with rings poisoned first (NaN, ``POISON_POS``): the output
    ``[1, N, Hq, d]`` and the rings ``(qring, oring, ring_lse, ring_pos)`` after it."""
    _, Hq, _, d = p.query.shape
    dims = ModelDims(num_layers=1, num_q_heads=Hq, num_kv_heads=p.key.shape[1], head_dim=d, hidden_size=Hq * d,
                     dtype=p.query.dtype, device=p.query.device)
    mac = MacAttention(MacConfig(window=window, band=band, tau=0.5), dims, num_slots=len(p.plan.segments))
    rings = mac.state.layer(0)
    for t in rings:
        t.fill_(POISON_POS if t.dtype == torch.int64 else float("nan"))
    step = StepContext(slots=torch.tensor(p.plan.slots), prefill=p.plan)
    out = mac.prefill(None, 0, p.query, p.key, p.value, p.q_pre, None, d ** -0.5, step, None)
    return out, [t.clone() for t in rings]


def run_both(monkeypatch, p: Packed, *, window: int, band: int):
    """``run_layer`` one segment at a time with the split (returns ``(out, rings, taken)``: ``taken`` whether each
    call of ``fresh_split_attention`` split) and with it forced off (``(out, rings)``)."""
    real, taken = backend.fresh_split_attention, []

    def spy(*args, **kw):
        got = real(*args, **kw)
        taken.append(got is not None)
        return got

    with monkeypatch.context() as m:      # one segment at a time: a call of fresh segments seeded at once
        m.setattr(ragged, "varlen_applies", lambda query: False)       # never calls the split (test_packed_seeding)
        m.setattr(backend, "fresh_split_attention", spy)
        new = run_layer(p, window=window, band=band)
        m.setattr(backend, "fresh_split_attention", lambda *args, **kw: None)
        old = run_layer(p, window=window, band=band)
    return (*new, taken), old


def packed_cases(K: int, b: int) -> dict[str, list[Seg]]:
    """Packed calls of fresh segments only (``seeding.packed_seeding_applies``), in units of the window ``K`` and band
    ``b``: one prompt of ``K + b - 1`` (the longest that takes it), prompts within the window, one of one token and
    of ``b`` (no far keys), a first chunk keeping no ring position, one keeping some (its row written whole), and
    every one of them in one call."""
    every = [Seg(0, K + b - 1), Seg(0, K - 3), Seg(0, 1), Seg(0, b), Seg(0, K), Seg(0, b // 2, prompt_end=3 * K),
             Seg(0, K, prompt_end=K + b // 2), Seg(0, b + 1)]
    return {"longest": [Seg(0, K + b - 1)], "within_window": [Seg(0, K - 3), Seg(0, K // 2)],
            "no_far_keys": [Seg(0, 1), Seg(0, b)], "first_chunks": every[5:7], "every": every}


def run_packed_and_loop(monkeypatch, p: Packed, *, window: int, band: int, force: bool = False):
    """``run_layer`` through the packed seeding (``seed_packed_``; ``force``: on the CPU too, with
    ``flash_varlen_reference``) and with it off (one segment at a time): ``((out, rings, calls), (out, rings))``,
    ``calls`` the packed seeding's call count."""
    real, calls = seeding.seed_packed_, []

    def spy(*args, **kw):
        calls.append(1)
        return real(*args, **kw)

    with monkeypatch.context() as m:
        m.setattr(backend, "seed_packed_", spy)
        if force:
            m.setattr(ragged, "varlen_applies", lambda query: True)
        new = run_layer(p, window=window, band=band)
    with monkeypatch.context() as m:
        m.setattr(ragged, "varlen_applies", lambda query: False)
        old = run_layer(p, window=window, band=band)
    return (*new, len(calls)), old


def row_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest relative error of one token's row (``[1, N, Hq, d]``: over its heads and dims) of ``a`` against
    ``b``, so an error confined to a few rows is not averaged away."""
    assert a.shape == b.shape, (a.shape, b.shape)
    a, b = a.double().flatten(2), b.double().flatten(2)
    return float(((a - b).norm(dim=-1) / b.norm(dim=-1)).max())


def assert_same_rings(new: list[torch.Tensor], old: list[torch.Tensor], p: Packed) -> None:
    """Bit for bit (the split's far part is the seeding's own ``tail_summaries`` call), poison where both left it;
    every row of a fresh segment that keeps ring positions written whole (no poison left)."""
    for a, b in zip(new, old):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    q, o, lse, pos = new
    for i, seg in enumerate(p.plan.segments):
        if seg.start == 0 and seg.last_positions(q.shape[2]) > 0:
            assert not q[i].isnan().any() and not o[i].isnan().any() and not lse[i].isnan().any()
            assert (pos[i] != POISON_POS).all()


def fresh_tails(p: Packed, window: int) -> list[slice]:
    """The rows of the call that each fresh, seeding segment's ring keeps (its last ``min(window, L)``)."""
    return [slice(s.offset + s.length - min(window, s.length), s.offset + s.length) for s in p.plan.segments
            if s.start == 0 and s.last_positions(window) > 0]


# deliberate off-by-ones of ``fresh_split_attention`` (its source, one edit each), which the checks must catch
MUTATIONS = {
    "tail one position early": ("query[:, :, L - n:]", "query[:, :, L - n - 1: L - 1]"),
    "head sees one key more": ("key[:, :, :h], value[:, :, :h]", "key[:, :, :h + 1], value[:, :, :h + 1]"),
    "far part one key short": ("band=band, scale=scale)", "band=band + 1, scale=scale)"),
    "head one query longer": ("h = L - n\n", "h = L - n + 1\n"),
}


def mutant(name: str):
    """``fresh_split_attention`` with ``MUTATIONS[name]`` applied (refused where the source no longer has the text)."""
    old, new = MUTATIONS[name]
    src = inspect.getsource(seeding.fresh_split_attention)
    assert src.count(old) == 1, f"fresh_split_attention no longer contains {old!r}"
    scope = dict(vars(seeding))
    exec(compile(src.replace(old, new), seeding.__file__, "exec"), scope)
    return scope["fresh_split_attention"]


def _dense(q, k, v, causal: bool, scale: float, window_left: int | None = None):
    """Flash's contract in plain torch on ``[B, H, n, d]`` over ``[B, Hkv, K, d]``: bottom-right causal, at most
    ``window_left`` keys before a query's own; ``(out [B, H, n, d], lse [B, H, n])`` in the operands' dtype."""
    n, K = q.shape[2], k.shape[2]
    g = q.shape[1] // k.shape[1]
    logits = (q @ k.repeat_interleave(g, 1).transpose(-1, -2)) * scale
    i, j = torch.arange(n).view(n, 1) + (K - n), torch.arange(K).view(1, K)
    seen = (j <= i) if causal else torch.ones(n, K, dtype=torch.bool)
    if window_left is not None:
        seen = seen & (j >= i - window_left)
    logits = logits.masked_fill(~seen, float("-inf"))
    return torch.softmax(logits, -1) @ v.repeat_interleave(g, 1), torch.logsumexp(logits, -1)


def _flash_forward(q, k, v, causal, scale, window_left=None):
    """``core.flash_split.flash_forward``'s contract (``[B, S, H, d]`` operands, out token-major)."""
    out, lse = _dense(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal, scale, window_left)
    return out.transpose(1, 2), lse


def _sdpa_flash(q, k, v, dropout_p, is_causal, return_debug_mask, scale):
    return _dense(q, k, v, is_causal, scale)


def use_stand_in_kernels(monkeypatch) -> None:
    """The fused seeding and band split on the CPU in fp64: flash's calls replaced by ``_dense``, GQA native, key
    splits from 8 keys up (so the split-over-keys merge runs at these sizes)."""
    monkeypatch.setattr(seeding, "fused_seeding_applies", lambda query: True)
    monkeypatch.setattr(seeding, "_native_gqa", lambda *args: True)
    monkeypatch.setattr(seeding, "flash_forward", _flash_forward)
    monkeypatch.setattr(flash_split, "flash_forward", _flash_forward)
    monkeypatch.setattr(flash_split, "_sm_count", lambda device: 132)
    monkeypatch.setattr(flash_split, "MIN_SPLIT_KEYS", 8)
    monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_flash_attention", _sdpa_flash)
