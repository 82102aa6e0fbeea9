"""MacState (rings per layer and request slot) and MacDiagnostics (docs/spec.md §1.4, §1.5)."""
import math

import pytest
import torch

from macattn.methods.mac.config import MacConfig
from macattn.methods.mac.reference import mac_decode_step_reference, rectified_summaries_reference
from macattn.methods.mac.state import MacDiagnostics, MacState
from macattn.core.summaries import AttentionSummary

NEG_INF = float("-inf")


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _state(num_slots=3, window=8, band=2, tau=0.45, overrides=None, **kw):
    cfg = MacConfig(window=window, band=band, tau=tau, layer_overrides=overrides or {})
    kw = {"num_layers": 3, "num_q_heads": 4, "head_dim": 16, **kw}
    return MacState.allocate(cfg, num_slots=num_slots, **kw)


def _assert_slot_empty(state, slot):
    """Every entry of the slot empty: position -1, log-sum-exp -inf (``MacState.reset`` leaves the query / summary
    values, which no read reaches without a valid position)."""
    for layer in range(state.num_layers):
        qring, oring, lse, pos = state.layer(layer)
        assert (pos[slot] == -1).all()
        assert torch.isneginf(lse[slot]).all()


def _fill_slot_with_junk(state, slot, g):
    for layer in range(state.num_layers):
        qring, oring, lse, pos = state.layer(layer)
        qring[slot] = torch.randn(qring[slot].shape, generator=g).to(qring.dtype)
        oring[slot] = torch.randn(oring[slot].shape, generator=g).to(oring.dtype)
        lse[slot] = torch.randn(lse[slot].shape, generator=g)
        pos[slot] = torch.arange(pos.shape[1]) + 100


# ----------------------------------------------------------------------------- allocate

@pytest.mark.parametrize("query_dtype,summary_dtype", [(torch.bfloat16, torch.float32),
                                                       (torch.float32, torch.float32),
                                                       (torch.float16, torch.bfloat16)])
def test_allocate_shapes_and_dtypes_per_layer(query_dtype, summary_dtype):
    st = _state(num_slots=3, window=8, overrides={1: {"window": 4}, 2: {"window": 16, "band": 1}},
                query_dtype=query_dtype, summary_dtype=summary_dtype)
    assert st.num_layers == 3 and st.num_slots == 3
    for layer, K in enumerate([8, 4, 16]):
        qring, oring, lse, pos = st.layer(layer)
        assert qring.shape == (3, 4, K, 16) and qring.dtype == query_dtype
        assert oring.shape == (3, 4, K, 16) and oring.dtype == summary_dtype
        assert lse.shape == (3, 4, K) and lse.dtype == torch.float32
        assert pos.shape == (3, K) and pos.dtype == torch.int64
        assert (pos == -1).all() and torch.isneginf(lse).all() and not qring.any() and not oring.any()
        assert qring is st.qring[layer] and pos is st.ring_pos[layer]
    assert st.in_use.dtype == torch.bool and not st.in_use.any()
    d = st.diagnostics
    for t in (d.steps, d.hits, d.skipped, d.gap):
        assert t.shape == (3, 4) and t.dtype == torch.float64 and not t.any()


def test_default_query_dtype_is_bf16():
    st = MacState.allocate(MacConfig(window=4), num_layers=1, num_slots=1, num_q_heads=2, head_dim=8)
    assert st.qring[0].dtype == torch.bfloat16 and st.oring[0].dtype == torch.float32


@pytest.mark.parametrize("name,value", [("num_layers", 0), ("num_slots", -1), ("num_q_heads", 2.0),
                                        ("head_dim", True), ("num_slots", None)])
def test_allocate_rejects_bad_sizes(name, value):
    kw = dict(num_layers=1, num_slots=1, num_q_heads=2, head_dim=8)
    kw[name] = value
    with pytest.raises(ValueError, match=name):
        MacState.allocate(MacConfig(window=4), **kw)


# ----------------------------------------------------------------------------- acquire / release

def test_acquire_release_reset():
    g = _gen(1)
    st = _state(num_slots=3)
    slots = [st.acquire() for _ in range(3)]
    assert sorted(slots) == [0, 1, 2] and st.in_use.all()
    with pytest.raises(RuntimeError, match="no free MAC slot"):
        st.acquire()
    for s in slots:
        _fill_slot_with_junk(st, s, g)
    st.release(slots[1])
    assert not bool(st.in_use[slots[1]]) and int(st.in_use.sum()) == 2
    _assert_slot_empty(st, slots[1])                 # release resets
    # the other slots are untouched
    for s in (slots[0], slots[2]):
        assert (st.ring_pos[0][s] >= 100).all()
    # re-acquire gets the freed slot back, empty (junk written while free is wiped too)
    _fill_slot_with_junk(st, slots[1], g)
    again = st.acquire()
    assert again == slots[1] and bool(st.in_use[again])
    _assert_slot_empty(st, again)
    # explicit reset
    _fill_slot_with_junk(st, again, g)
    st.reset(again)
    _assert_slot_empty(st, again)
    assert bool(st.in_use[again])


def test_release_errors():
    st = _state(num_slots=2)
    s = st.acquire()
    free = 1 - s
    with pytest.raises(ValueError, match=f"slot {free} is not in use"):
        st.release(free)
    st.release(s)
    with pytest.raises(ValueError, match="not in use"):
        st.release(s)                                # double release
    for bad in (2, -1, 1.0, True, "0"):
        with pytest.raises(ValueError, match="slot must be an int"):
            st.release(bad)
        with pytest.raises(ValueError, match="slot must be an int"):
            st.reset(bad)
    # the failed releases did not corrupt the free list: exactly two acquisitions succeed
    assert sorted([st.acquire(), st.acquire()]) == [0, 1]
    with pytest.raises(RuntimeError):
        st.acquire()


def _decode(st, layer, slot, q, q_pre, k, v, m):
    qring, oring, lse, pos = st.layer(layer)
    p = st.config.for_layer(layer)
    return mac_decode_step_reference(q[None], q_pre[None], k[None], v[None], torch.tensor([m]),
                                     torch.tensor([slot]), qring, oring, lse, pos,
                                     band=p.band, tau=p.tau, enabled=p.enabled)


def test_no_entry_of_a_released_request_is_ever_matched():
    """Poison -> reuse -> verify: request B replays request A's queries in A's old slot."""
    g = _gen(2)
    Hq, Hkv, d, T = 4, 2, 16, 24
    st = _state(num_slots=1, window=8, band=2, tau=0.0, num_layers=1, num_q_heads=Hq, head_dim=d,
                query_dtype=torch.float32)
    k = torch.randn(Hkv, T, d, generator=g)
    v = torch.randn(Hkv, T, d, generator=g)
    qs = torch.randn(T, Hq, d, generator=g)
    q_pres = torch.randn(T, Hq, d, generator=g)
    a = st.acquire()
    for m in range(10, 20):
        _decode(st, 0, a, qs[m], q_pres[m], k, v, m)
    # sanity: with A's rings in place, replaying position 15's query at m = 20 hits (tau = 0)
    rings_a = [t.clone() for t in st.layer(0)]
    res = mac_decode_step_reference(qs[15][None], q_pres[15][None], k[None], v[None], torch.tensor([20]),
                                    torch.tensor([a]), *rings_a, band=2, tau=0.0)
    assert (res.match_pos == 15).all()
    st.release(a)
    b = st.acquire()
    assert b == a                                     # same rows reused
    # B's first step replays A's query of position 15 at m = 20: A's entries are gone
    res = _decode(st, 0, b, qs[15], q_pres[15], k, v, 20)
    assert (res.match_pos == -1).all() and torch.isinf(res.dist).all()
    # B replays A's whole history: it only ever matches positions it wrote itself
    st.release(b)
    b = st.acquire()
    for m in range(12, 20):
        res = _decode(st, 0, b, qs[m], q_pres[m], k, v, m)
        hit = res.match_pos[0][res.match_pos[0] >= 0]
        assert ((hit >= 12) & (hit < m)).all()
        if m == 12:
            assert torch.isinf(res.dist).all()


# ----------------------------------------------------------------------------- seed

@pytest.mark.parametrize("n", [20, 8, 5])
def test_seed_keeps_last_K_positions_at_pos_mod_K(n):
    g = _gen(3 + n)
    Hq, Hkv, d, K, band, L = 4, 2, 16, 8, 3, 20
    st = _state(num_slots=2, window=16, band=band, overrides={1: {"window": K}}, num_layers=2,
                num_q_heads=Hq, head_dim=d)
    slot = st.acquire()
    other = st.acquire()
    q = torch.randn(1, Hq, L, d, generator=g)
    q_pre = torch.randn(Hq, L, d, generator=g)
    k = torch.randn(1, Hkv, L, d, generator=g)
    v = torch.randn(1, Hkv, L, d, generator=g)
    qpos = torch.arange(L - n, L)
    summ = rectified_summaries_reference(q[:, :, L - n:], k, v, qpos, band=band)
    st.seed(1, slot, qpos, q_pre[:, L - n:], AttentionSummary(summ.o[0], summ.lse[0]))
    qring, oring, lse, pos = st.layer(1)
    kept = list(range(L - min(n, K), L))
    assert sorted(int(t) for t in pos[slot] if t >= 0) == kept
    for t in kept:
        c = t % K
        i = t - (L - n)
        assert int(pos[slot, c]) == t
        assert torch.equal(qring[slot, :, c], q_pre[:, t].to(torch.bfloat16))
        assert torch.equal(oring[slot, :, c], summ.o[0, :, i])
        assert torch.equal(lse[slot, :, c], summ.lse[0, :, i])
    for c in range(K):
        if int(pos[slot, c]) == -1:
            assert torch.isneginf(lse[slot, :, c]).all() and not oring[slot, :, c].any()
    _assert_slot_empty(st, other)
    # layer 0 (window 16) of the seeded slot was not touched
    assert (st.ring_pos[0][slot] == -1).all()


def test_seeded_ring_lets_the_first_decode_step_hit():
    g = _gen(4)
    Hq, Hkv, d, band, L = 2, 1, 16, 2, 12
    st = _state(num_slots=1, window=8, band=band, tau=0.0, num_layers=1, num_q_heads=Hq, head_dim=d,
                query_dtype=torch.float32)
    slot = st.acquire()
    q = torch.randn(1, Hq, L + 1, d, generator=g)
    q_pre = torch.randn(Hq, L, d, generator=g)
    k = torch.randn(1, Hkv, L + 1, d, generator=g)
    v = torch.randn(1, Hkv, L + 1, d, generator=g)
    qpos = torch.arange(L)
    summ = rectified_summaries_reference(q[:, :, :L], k[:, :, :L], v[:, :, :L], qpos, band=band)
    st.seed(0, slot, qpos, q_pre, AttentionSummary(summ.o[0], summ.lse[0]))
    res = _decode(st, 0, slot, q[0, :, L], q_pre[:, L - 3], k[0], v[0], L)
    assert (res.match_pos == L - 3).all()


# ----------------------------------------------------------------------------- diagnostics

def test_diagnostics_record_hand_example():
    diag = MacDiagnostics.zeros(2, 3)
    band = 2
    # step 1: two requests at m = 20 and m = 10
    diag.record(0, torch.tensor([[5, -1, 19], [-1, 3, 9]]), torch.tensor([20, 10]), band)
    # step 2: one request at m = 21; head 0 hits p = 1 < r (contributes 0 skipped prefix)
    diag.record(0, torch.tensor([[1, -1, -1]]), torch.tensor([21]), band)
    assert diag.steps[0].tolist() == [3, 3, 3]
    assert diag.hits[0].tolist() == [2, 1, 2]
    # skipped (p - r)_+ / m per hit: head0 3/20 + 0; head1 1/10; head2 17/20 + 7/10
    exp_skip = torch.tensor([(3 / 20 + 0) / 3, (1 / 10) / 3, (17 / 20 + 7 / 10) / 3], dtype=torch.float64)
    assert torch.allclose(diag.skipped_prefix[0], exp_skip, rtol=0, atol=1e-15)
    assert torch.allclose(diag.hit_rate[0], torch.tensor([2 / 3, 1 / 3, 2 / 3], dtype=torch.float64))
    # mean gap m - p over hits: head0 (15 + 20)/2, head1 7, head2 (1 + 1)/2
    assert diag.mean_gap[0].tolist() == [17.5, 7.0, 1.0]
    # layer 1 untouched, and its empty statistics are 0, not NaN
    assert not diag.steps[1].any()
    for t in (diag.hit_rate, diag.skipped_prefix, diag.mean_gap):
        assert not torch.isnan(t).any() and not t[1].any()
    d = diag.as_dict()
    assert set(d) == {"hit_rate", "skipped_prefix", "mean_gap", "steps"}
    assert d["steps"] == [3.0, 0.0] and d["mean_gap"][0] == [17.5, 7.0, 1.0]
    assert math.isclose(d["hit_rate"][0][1], 1 / 3)
    diag.reset()
    assert not any(t.any() for t in (diag.steps, diag.hits, diag.skipped, diag.gap))


def test_diagnostics_all_misses():
    diag = MacDiagnostics.zeros(1, 2)
    for m in range(5, 9):
        diag.record(0, torch.full((2, 2), -1), torch.tensor([m, m + 3]), 4)
    assert diag.steps[0].tolist() == [8, 8]
    assert not diag.hit_rate.any() and not diag.skipped_prefix.any() and not diag.mean_gap.any()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")])])
@pytest.mark.parametrize("kind", ["fp8", "proj16"])
def test_reset_empties_every_ring_and_the_sketch_ring_of_one_slot(kind, device):
    """``reset`` (multi-tensor launches) on junk in every ring of two slots, a sketch ring of ``kind`` (E4M3 /
    bf16) among them and a layer with MAC off: the reset slot's rows are empty, the other slot's untouched."""
    cfg = MacConfig(window=8, band=2, tau=0.45, match="two_stage", match_sketch=kind, match_candidates=2,
                    layer_overrides={1: {"enabled": False}})
    st = MacState.allocate(cfg, num_slots=3, num_layers=3, num_q_heads=4, head_dim=16, device=device)
    g = _gen(7)
    for slot in (0, 2):
        for t in (*st.qring, *st.oring, *st.ring_lse, *(s for s in st.sring if s is not None)):
            t[slot] = torch.randn(t[slot].shape, generator=g).to(device).to(t.dtype)
        for p in st.ring_pos:
            p[slot] = 5
    keep = [t[2].clone() for t in (*st.qring, *st.oring, *st.ring_lse, *st.ring_pos)]
    st.reset(0)
    _assert_slot_empty(st, 0)
    assert any(s is not None for s in st.sring)
    for a, b in zip((t[2] for t in (*st.qring, *st.oring, *st.ring_lse, *st.ring_pos)), keep):
        assert torch.equal(a, b)
