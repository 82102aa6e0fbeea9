"""The offloaded retrieval-completion decode on the CPU (every tier a CPU tensor, the same code as on the GPU
with the torch gather and the fp64 tail): offloaded = GPU-resident page-selector op = fp64 reference, step
after step over layers and slots; the device LRU against a plain LRU; hit / miss counts; capacity errors; reset."""
from __future__ import annotations

import random
import pytest
import torch

from macattn.methods.completion import ops  # noqa: F401  (defines the torch ops)
from macattn.methods.completion.offload import OffloadConfig, OffloadedKV, lru_update, offload_bytes
from macattn.methods.completion.reference import page_retrieval_completion_step

from offload_case import admit, make_problem, step_inputs


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


def _resident_inputs(t, step, layer):
    """The GPU-resident op's inputs for the decoding rows: full caches [B, Hkv, T, d] holding the prompt and the
    generated tokens so far, their bounds, the completion caches."""
    B = len(t["prompts"])
    lens = torch.tensor([n + step + 1 for n in t["prompts"]])
    npf = torch.tensor(list(t["prompts"]))
    comp = [torch.stack([t["comp"][layer][i][j] for i in range(B)]) for j in range(3)]
    return (t["q"][step][layer], t["k"][layer], t["v"][layer], lens, npf, t["lpq"][step][layer], t["lpk"][layer], *comp)


@pytest.mark.parametrize("hot,dtype", [(6, torch.float32), (3, torch.float32), (9, torch.bfloat16)])
def test_offloaded_decode_equals_the_resident_op_and_the_reference(hot, dtype):
    t = make_problem(hot=hot, dtype=dtype, seed=hot)
    st, slots = admit(t)
    cfg = t["cfg"]
    K = cfg.pages_for(cfg.top_k)
    for step in range(t["steps"]):
        for layer in range(t["L"]):
            q_all, lpq_all, lens, npf = step_inputs(t, st, slots, step, layer)
            pos = torch.tensor([n + step for n in t["prompts"]])
            sl = torch.tensor(slots)
            st.append(layer, sl, pos, t["k"][layer][torch.arange(len(slots)), :, pos],
                      t["v"][layer][torch.arange(len(slots)), :, pos])
            out = st.decode(layer, q_all, lpq_all, lens, npf, 0.25)[sl]
            args = _resident_inputs(t, step, layer)
            ref = page_retrieval_completion_step(*args, n_sink=cfg.n_sink, n_tail=cfg.n_tail, page_size=cfg.page_size,
                                                 budget_pages=K, scale=0.25)
            # the GPU-resident op (its CPU implementation) over the same cache, bounds from the state
            resident = torch.ops.macattn.page_retrieval_completion(*args, st.page_lo[layer][sl], st.page_hi[layer][sl],
                                                                   cfg.n_sink, cfg.n_tail, cfg.page_size, K, 0.25)
            tol = 1e-6 if dtype == torch.float32 else 1e-2
            assert _rel(out, ref) < tol and _rel(resident, ref) < tol
            full = page_retrieval_completion_step(*args, n_sink=cfg.n_sink, n_tail=cfg.n_tail,
                                                  page_size=cfg.page_size, budget_pages=4096, scale=0.25)
            assert _rel(out, full) > 1e-3          # a real selection: not the exact attention
    total = int(st.hits.sum() + st.misses.sum())
    assert total == t["steps"] * t["L"] * len(slots) * t["Hkv"] * K
    assert int(st.misses.sum()) <= total


def test_repeated_query_hits_the_cache_and_counts_it():
    t = make_problem(hot=6, steps=2, seed=4)
    t["q"][1] = t["q"][0]                                   # same queries: the same pages (bounds barely move)
    st, slots = admit(t)
    K = t["cfg"].pages_for(t["cfg"].top_k)
    for step in range(2):
        for layer in range(t["L"]):
            q_all, lpq_all, lens, npf = step_inputs(t, st, slots, step, layer)
            st.decode(layer, q_all, lpq_all, lens, npf, 0.25)
        if step == 0:
            first = st.misses.clone()
            assert int(st.hits.sum()) == 0 and int(first.sum()) == t["L"] * len(slots) * t["Hkv"] * K
    assert torch.equal(st.misses, first) and int(st.hits.sum()) == int(first.sum())
    assert st.hit_rate(slots[0]) == pytest.approx(0.5)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_lru_update_is_an_lru(seed):
    """After every step: the step's pages are resident at the slots returned, a page misses iff it was not
    resident, and the resident set is the most recently used pages (ties of one step in any order)."""
    rng = random.Random(seed)
    S, H, P, C, K = 2, 3, 20, 5, 4
    sop = torch.full((S, H, P + 1), -1, dtype=torch.int64)
    pos = torch.full((S, H, C + 1), -1, dtype=torch.int64)
    stamp = torch.full((S, H, C + 1), -1, dtype=torch.int64)
    last_use = {(s, h): {} for s in range(S) for h in range(H)}
    for now in range(1, 40):
        pages = torch.full((S, H, K), -1, dtype=torch.int64)
        for s in range(S):
            for h in range(H):
                n = rng.randint(0, K)
                pages[s, h, :n] = torch.tensor(sorted(rng.sample(range(P), n)), dtype=torch.int64)
        before = pos.clone()
        slots, miss = lru_update(sop, pos, stamp, pages, torch.tensor(now))
        for s in range(S):
            for h in range(H):
                used = last_use[(s, h)]
                resident_before = {int(p) for p in before[s, h, :C].tolist() if p >= 0}
                for j, p in enumerate(pages[s, h].tolist()):
                    if p < 0:
                        assert not miss[s, h, j]
                        continue
                    assert bool(miss[s, h, j]) == (p not in resident_before), (now, s, h, p)
                    assert int(pos[s, h, slots[s, h, j]]) == p and int(sop[s, h, p]) == int(slots[s, h, j])
                    used[p] = now
                resident = {int(p) for p in pos[s, h, :C].tolist() if p >= 0}
                assert len(resident) == min(C, len(used))
                out = set(used) - resident
                if out:
                    assert max(used[p] for p in out) <= min(used[p] for p in resident)
                for p in range(P):                              # the two tables agree
                    c = int(sop[s, h, p])
                    assert (c >= 0) == (p in resident) and (c < 0 or int(pos[s, h, c]) == p)
        assert (sop[..., P] == -1).all() and (pos[..., C] == -1).all()


def test_capacity_is_checked_up_front():
    t = make_problem()
    cfg, off = t["cfg"], t["off"]
    kw = dict(num_layers=2, num_slots=3, num_kv_heads=2, head_dim=16, feature_dim=8)
    with pytest.raises(ValueError, match="hot_pages=2"):
        OffloadedKV.allocate(cfg, OffloadConfig(hot_pages=2, max_prefill=70), **kw)
    need = offload_bytes(cfg, off, num_layers=2, num_kv_heads=2, head_dim=16, feature_dim=8, dtype=torch.float32)
    with pytest.raises(ValueError, match="host_budget_bytes"):
        OffloadedKV.allocate(cfg, OffloadConfig(hot_pages=6, max_prefill=70, host_budget_bytes=3 * need["host"] - 1),
                             **kw, dtype=torch.float32)
    with pytest.raises(ValueError, match="device_budget_bytes"):
        OffloadedKV.allocate(cfg, OffloadConfig(hot_pages=6, max_prefill=70, device_budget_bytes=need["device"] - 1),
                             **kw, dtype=torch.float32)
    with pytest.raises(ValueError, match="selector='quest'"):
        OffloadedKV.allocate(type(cfg)(top_k=20), off, **kw)
    with pytest.raises(ValueError, match="prefetch"):
        OffloadConfig(prefetch="layer")
    st = OffloadedKV.allocate(cfg, off, **kw, dtype=torch.float32)
    with pytest.raises(ValueError, match="max_prefill=70"):
        st.admit_layer(0, st.acquire(), torch.zeros(2, 71, 16), torch.zeros(2, 71, 16), torch.zeros(2, 71, 8),
                       (torch.zeros(2, 8, 16), torch.zeros(2, 8), torch.zeros(2, 8)))


def test_release_leaves_nothing_of_the_request():
    t = make_problem(seed=9)
    st, slots = admit(t)
    for layer in range(t["L"]):
        st.decode(layer, *step_inputs(t, st, slots, 0, layer), 0.25)
    for s in slots:
        st.release(s)
    assert st.num_free == st.num_slots
    for name in ("anchor_k", "page_lo", "comp_a", "cache_k", "cache_lpk"):
        assert not any(bool(x.any()) for x in getattr(st, name))
    assert not st.host_k.any() and not st.host_lpk.any()
    assert all(bool((x == -1).all()) for x in st.slot_of_page) and not st.hits.any() and not st.misses.any()
