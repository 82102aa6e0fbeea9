"""Triton MAC kernels (``macattn.plugins``) against the fp32/fp64 reference (``macattn.methods.mac.reference``).

Every test is ``@pytest.mark.gpu`` and skipped without CUDA or triton. For debugging the
kernel logic on a CPU, ``MACATTN_TRITON_INTERPRET=1`` runs the same tests through
Triton's interpreter on CPU tensors (slow: keep ``-k`` narrow).

Rules:
* inputs are fresh random draws (never zeros); outputs are NaN-poisoned before launch and
  must be fully written;
* ``out`` and ring entries: ``‖x - ref‖ / ‖ref‖ <= 1e-2`` (bf16 operands, METHOD.md) with
  the reference in fp64 on upcast inputs;
* match positions must equal the reference's, except for a head whose reference distance
  lies within 1e-3 (relative) of the threshold or of the runner-up candidate's distance:
  there fp32 summation order may legitimately flip the decision. The attention reference
  then uses the kernel's own ``match_pos`` (it is a valid decision either way).
"""
from __future__ import annotations

import os

import pytest
import torch

from triton_env import DEVICE, GPU_MARKS, INTERPRET  # noqa: E402  (first: sets the interpreter switch)
from macattn.methods.mac.reference import full_attention_reference  # noqa: E402

pytestmark = GPU_MARKS

from mac_problem import (BF16, REL_TOL, Problem, _all, _check_match, _check_step,  # noqa: E402,F401
                         _mixed_kinds, _rel)
from mac_problem import _poison as _poison_on  # noqa: E402


def _poison(*shape, dtype, device=DEVICE):
    return _poison_on(*shape, dtype=dtype, device=device)


def _plan(pr: Problem, page_size=None, **kw):
    from macattn.plugins.mac.decode_plan import MacDecodePlan
    return MacDecodePlan(batch_size=pr.B, max_context=pr.T, num_q_heads=pr.Hq, num_kv_heads=pr.Hkv, head_dim=pr.d,
                         window=pr.K, band=pr.band, tau=pr.tau, page_size=page_size, device=DEVICE, **kw)


def _poison_plan(plan) -> None:
    plan.out.fill_(float("nan"))
    plan.match_pos.fill_(-(2 ** 40))
    plan.dist.fill_(float("nan"))
    plan.part_o.fill_(float("nan"))
    plan.part_lse.fill_(float("nan"))


def _run_fused(pr: Problem, page_size=None, **kw):
    plan = _plan(pr, page_size, **kw)
    _poison_plan(plan)
    if plan.persistent:
        plan.sync.fill_(0)
    before = pr.rings()
    rings = pr.rings()
    if page_size is None:
        k, v, table = pr.k, pr.v, None
    else:
        k, v, table = pr.paged(page_size)
    out, mp, dist = plan.run(pr.q, pr.q_pre, k, v, pr.positions, pr.slots, *rings, page_table=table)
    _check_match(pr, mp, dist)
    _check_step(pr, out, mp, rings, before)
    if plan.persistent:     # the last program out leaves the barrier counters at zero for the next launch
        assert plan.sync.tolist() == [0, 0]
    return plan, mp


# ------------------------------------------------------------------------------------------
# shapes
# ------------------------------------------------------------------------------------------
if INTERPRET:
    GQA = [(4, 2, 16), (4, 4, 32), (6, 2, 16)]
    SMALL = dict(K=32, band=8)
    CTX = [40, 71, 9, 100]
else:
    GQA = [(32, 8, 128), (28, 4, 128), (8, 8, 64), (32, 8, 64)]
    SMALL = dict(K=256, band=64)
    CTX = [1500, 3001, 700, 4500]


# the step as four kernels (match -> plan -> attention -> merge) and as one persistent launch
STEPS = [pytest.param(False, id="four_kernels"), pytest.param(True, id="persistent")]


def _gen():
    return torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))


def _mixed_problem(B: int, hq: int, hkv: int, d: int, positions=None) -> Problem:
    """A fresh random ``Problem`` on ``DEVICE`` (``SMALL`` window/band, tau 0.45) of ``B`` rows at
    ``positions`` (default ``CTX[:B]``) whose heads mix hits and misses (``_mixed_kinds``)."""
    g = _gen()
    return Problem(B=B, Hq=hq, Hkv=hkv, d=d, tau=0.45, positions=CTX[:B] if positions is None else positions,
                   kinds=_mixed_kinds(B, hq, hkv, g), gen=g, **SMALL).to(DEVICE)


@pytest.mark.parametrize("persistent", STEPS)
@pytest.mark.parametrize("hq,hkv,d", GQA)
def test_fused_step_mixed_hits_contiguous(hq, hkv, d, persistent):
    _, mp = _run_fused(_mixed_problem(3, hq, hkv, d), persistent=persistent)
    assert bool((mp >= 0).any()) and bool((mp < 0).any())


@pytest.mark.parametrize("persistent", STEPS)
@pytest.mark.parametrize("page_size", [16, 32, 64])
def test_fused_step_paged(page_size, persistent):
    _run_fused(_mixed_problem(4, *GQA[0]), page_size=page_size, persistent=persistent)


@pytest.mark.parametrize("b_items", [None, 1, 3])
def test_fused_step_part_b_starts_before_plan(b_items):
    """``early_b``: the attention kernel's part-B items run while the plan still runs (PDL)."""
    _run_fused(_mixed_problem(4, *GQA[0]), page_size=16, early_b=True, b_items=b_items)


def test_fused_step_large_batch():
    """Enough KV groups to cover the SMs (B * Hkv >= 132 on the H100): the large-batch defaults."""
    B = 4 if INTERPRET else 20
    _run_fused(_mixed_problem(B, *GQA[0], positions=[CTX[i % len(CTX)] + 17 * i for i in range(B)]), page_size=16)


@pytest.mark.parametrize("persistent", STEPS)
def test_all_hit_and_wraparound(persistent):
    """m >> K: rings wrapped many times, stale slots present; every head hits."""
    g = _gen()
    hq, hkv, d = GQA[0]
    K, band = SMALL["K"], SMALL["band"]
    positions = [7 * K + 5, 3 * K + K // 2, 11 * K - 1]
    pr = Problem(B=3, Hq=hq, Hkv=hkv, d=d, K=K, band=band, tau=0.45, positions=positions,
                 kinds=_all("hit", 3, hq), gen=g).to(DEVICE)
    _, mp = _run_fused(pr, persistent=persistent)
    assert bool((mp >= 0).all())
    assert bool((mp >= pr.positions.unsqueeze(1) - K).all())


@pytest.mark.parametrize("persistent", STEPS)
def test_one_missed_head_long_context(persistent):
    """The 99 %-hit shape: one head of one group misses at a long context, so its group's part A is
    the whole ``[0, m - r]``, cut into many items across the grid and folded by its heads' merges."""
    g = _gen()
    hq, hkv, d = GQA[0]
    m = 2000 if INTERPRET else 60000
    kinds = _all("hit", 1, hq)
    kinds[0][int(torch.randint(0, hq, (1,), generator=g))] = "miss"
    pr = Problem(B=1, Hq=hq, Hkv=hkv, d=d, tau=0.45, positions=[m], kinds=kinds, gen=g, **SMALL).to(DEVICE)
    _, mp = _run_fused(pr, page_size=16, persistent=persistent)
    assert int((mp < 0).sum()) == 1


@pytest.mark.parametrize("persistent", STEPS)
def test_all_miss(persistent):
    g = _gen()
    hq, hkv, d = GQA[1]
    pr = Problem(B=2, Hq=hq, Hkv=hkv, d=d, tau=0.45, positions=CTX[:2], kinds=_all("miss", 2, hq), gen=g,
                 **SMALL).to(DEVICE)
    _, mp = _run_fused(pr, persistent=persistent)
    assert bool((mp < 0).all())


@pytest.mark.parametrize("persistent", STEPS)
def test_young_requests_m_minus_r_negative(persistent):
    """``m - r < 0``: every planted match is invalid (p < r), entries are empty (lse -inf)."""
    g = _gen()
    hq, hkv, d = GQA[0]
    band = SMALL["band"]
    positions = [band - 1, band // 2, 0, 3]
    pr = Problem(B=4, Hq=hq, Hkv=hkv, d=d, K=SMALL["K"], band=band, tau=0.45, positions=positions,
                 kinds=_all("young", 4, hq), gen=g).to(DEVICE)
    plan, mp = _run_fused(pr, persistent=persistent)
    assert bool((mp < 0).all())


@pytest.mark.parametrize("persistent", STEPS)
def test_hit_at_oldest_window_slot_shares_append_slot(persistent):
    """p = m - K is a legal match and lives in slot m mod K, the slot the append overwrites:
    the cached entry must be read before it is replaced."""
    g = _gen()
    hq, hkv, d = GQA[0]
    K, band = SMALL["K"], SMALL["band"]
    positions = [5 * K + 3, 2 * K + 1]
    gaps = [[K] * hq for _ in positions]
    pr = Problem(B=2, Hq=hq, Hkv=hkv, d=d, K=K, band=band, tau=0.45, positions=positions,
                 kinds=_all("hit", 2, hq), gaps=gaps, gen=g).to(DEVICE)
    # make sure slot m mod K holds position m - K for every head (no hole there)
    for b in range(2):
        m = int(pr.positions[b])
        pr.ring_pos[pr.slots[b], m % K] = m - K
        for h in range(hq):
            pr.q_pre[b, h] = (pr.qring[pr.slots[b], h, m % K].float() + 0.05 * torch.randn(d, device=DEVICE)).to(BF16)
    _, mp = _run_fused(pr, persistent=persistent)
    assert bool((mp == pr.positions.unsqueeze(1) - K).all())


@pytest.mark.parametrize("persistent", STEPS)
def test_mixed_lengths_batch_and_bf16_oring(persistent):
    g = _gen()
    hq, hkv, d = GQA[0]
    K, band = SMALL["K"], SMALL["band"]
    positions = [3, band + 1, K + 7, 2 * K + 3, CTX[3], CTX[1]]
    B = len(positions)
    pr = Problem(B=B, Hq=hq, Hkv=hkv, d=d, K=K, band=band, tau=0.45, positions=positions,
                 kinds=_mixed_kinds(B, hq, hkv, g), oring_dtype=BF16, gen=g).to(DEVICE)
    _run_fused(pr, page_size=16, persistent=persistent)


@pytest.mark.parametrize("hq,hkv,d", GQA[:3])
def test_ops_registered_cuda_kernels(hq, hkv, d):
    """``torch.ops.macattn.mac_match`` / ``mac_attend`` dispatch to the Triton kernels on CUDA."""
    from macattn.methods.kernels import register_kernels, registered_kernels
    assert {"macattn::mac_match", "macattn::mac_attend"} <= set(register_kernels())
    pr = _mixed_problem(3, hq, hkv, d)
    if INTERPRET:   # the ops dispatch on device type; call the registered implementations directly
        match, attend = (registered_kernels()[f"macattn::{n}"] for n in ("mac_match", "mac_attend"))
    else:
        match, attend = torch.ops.macattn.mac_match, torch.ops.macattn.mac_attend
    mp, dist = match(pr.q_pre, pr.qring, pr.ring_lse, pr.ring_pos, pr.slots, pr.positions, pr.band, pr.tau)
    _check_match(pr, mp, dist)
    before, rings = pr.rings(), pr.rings()
    out = attend(pr.q, pr.q_pre, pr.k, pr.v, pr.positions, mp, pr.slots, *rings, pr.band, pr.scale)
    _check_step(pr, out, mp, rings, before)


@pytest.mark.parametrize("page_size", [None, 16, 64])
@pytest.mark.parametrize("hq,hkv,d", GQA[:3])
def test_full_attention_path(page_size, hq, hkv, d):
    g = _gen()
    B = 4
    pr = Problem(B=B, Hq=hq, Hkv=hkv, d=d, tau=0.45, positions=CTX[:B], kinds=_all("miss", B, hq), gen=g,
                 **SMALL).to(DEVICE)
    plan = _plan(pr, page_size)
    _poison_plan(plan)
    if page_size is None:
        k, v, table = pr.k, pr.v, None
    else:
        k, v, table = pr.paged(page_size)
    out = plan.run_full(pr.q, k, v, pr.positions, page_table=table)
    assert not torch.isnan(out.float()).any()
    ref = full_attention_reference(pr.q.double(), pr.k.double(), pr.v.double(), pr.positions)
    assert _rel(out, ref) <= REL_TOL


@pytest.mark.skipif(INTERPRET, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("early_b,persistent", [(False, False), (True, False), (False, True)])
def test_cuda_graph_capture_and_replay(early_b, persistent):
    """A captured step replays correctly on new inputs copied into the captured buffers."""
    g = _gen()
    hq, hkv, d = GQA[0]
    B = 3
    T = max(CTX[:B]) + 9
    pr = Problem(B=B, Hq=hq, Hkv=hkv, d=d, tau=0.45, positions=CTX[:B], T=T, kinds=_mixed_kinds(B, hq, hkv, g),
                 gen=g, **SMALL).to(DEVICE)
    plan = _plan(pr, 16, early_b=early_b, persistent=persistent)
    k, v, table = pr.paged(16)
    static = dict(q=pr.q.clone(), q_pre=pr.q_pre.clone(), k=k.clone(), v=v.clone(), positions=pr.positions.clone(),
                  slots=pr.slots.clone(), table=table.clone())
    rings = pr.rings()
    args = lambda: (static["q"], static["q_pre"], static["k"], static["v"], static["positions"], static["slots"],  # noqa: E731
                    *rings)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        plan.run(*args(), page_table=static["table"])          # warm-up: compile outside capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan.run(*args(), page_table=static["table"], check=False)
    # fresh problem, same shapes, copied into the static buffers
    pr2 = Problem(B=B, Hq=hq, Hkv=hkv, d=d, tau=0.45, positions=[p + 1 for p in CTX[:B]], T=T,
                  kinds=_mixed_kinds(B, hq, hkv, g), gen=g, **SMALL).to(DEVICE)
    k2, v2, table2 = pr2.paged(16)
    for name, val in (("q", pr2.q), ("q_pre", pr2.q_pre), ("k", k2), ("v", v2), ("positions", pr2.positions),
                      ("slots", pr2.slots), ("table", table2)):
        static[name].copy_(val)
    before = pr2.rings()
    for dst, src in zip(rings, pr2.rings()):
        dst.copy_(src)
    _poison_plan(plan)
    graph.replay()
    torch.cuda.synchronize()
    _check_match(pr2, plan.match_pos, plan.dist)
    _check_step(pr2, plan.out, plan.match_pos, rings, before)
    assert plan.sync.tolist() == [0, 0]      # the persistent step leaves its barrier counters for the next replay


def test_plan_rejects_bad_inputs():
    g = _gen()
    hq, hkv, d = GQA[0]
    pr = Problem(B=2, Hq=hq, Hkv=hkv, d=d, tau=0.45, positions=CTX[:2], kinds=_all("miss", 2, hq), gen=g,
                 **SMALL).to(DEVICE)
    plan = _plan(pr)
    with pytest.raises(ValueError, match="page_table"):
        plan.run(pr.q, pr.q_pre, pr.k, pr.v, pr.positions, pr.slots, *pr.rings(),
                 page_table=torch.zeros(2, 4, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="q must be"):
        plan.run(pr.q[:1], pr.q_pre, pr.k, pr.v, pr.positions, pr.slots, *pr.rings())
    from macattn.plugins.mac.decode_plan import MacDecodePlan
    with pytest.raises(ValueError, match="num_q_heads"):
        MacDecodePlan(batch_size=1, max_context=16, num_q_heads=6, num_kv_heads=4, head_dim=64, window=8, band=2,
                      tau=0.5, device=DEVICE)
