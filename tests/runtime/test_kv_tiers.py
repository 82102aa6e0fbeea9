"""KV tiers of offloaded requests (``macattn.runtime.kv_tiers``): page bounds = brute force, fetch =
the requested pages, the hot-page LRU, capacity errors, slot release / reuse, and reuse from disk
with tampering rejected."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from macattn.runtime.chunk_store import ChunkKVStore, ChunkStoreIntegrityError
from macattn.methods.completion.reference import page_bounds
from macattn.runtime.kv_tiers import KVTierConfig, KVTiers, prefix_store
from macattn.runtime.slots import SlotStates

L, H, D = 2, 2, 8


def _kv(T, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(L, H, T, D, generator=g).to(torch.bfloat16),
            torch.randn(L, H, T, D, generator=g).to(torch.bfloat16))


def _tiers(**kw):
    cfg = KVTierConfig(**{"page_size": 4, "hot_pages": 3, **kw})
    return KVTiers(cfg, num_slots=3, num_layers=L, num_kv_heads=H, head_dim=D)


@pytest.mark.parametrize("T,page", [(1, 4), (7, 4), (8, 4), (13, 5), (16, 1)])
def test_page_bounds_equal_brute_force(T, page):
    k = torch.randn(3, T, 6, dtype=torch.float64)
    lo, hi = page_bounds(k, page, torch.float32)
    P = -(-T // page)
    assert lo.shape == hi.shape == (3, P, 6) and lo.dtype == torch.float32
    for p in range(P):
        chunk = k[:, p * page:(p + 1) * page].float()
        assert torch.equal(lo[:, p], chunk.amin(1)) and torch.equal(hi[:, p], chunk.amax(1))


def test_fetch_returns_the_requested_pages_and_keeps_an_lru():
    tiers = _tiers()
    k, v = _kv(13, 0)                                     # 4 pages, the last holds one token
    req = tiers.admit(1, k, v)
    assert req.k_pages.shape == (L, H, 4, 4, D) and req.lo.shape == (L, H, 4, D)
    assert torch.equal(req.k_pages[1, 0, 3, 1:], torch.zeros(3, D, dtype=torch.bfloat16))   # zero padding
    lo, hi = page_bounds(k, 4, torch.float32)
    assert torch.equal(req.lo, lo) and torch.equal(req.hi, hi)

    def want(x, layer, pages):
        return torch.stack([torch.stack([x[layer, h].view(-1, D)[torch.arange(4 * p, 4 * p + 4).clamp(max=12)]
                                         * (torch.arange(4 * p, 4 * p + 4) < 13).to(x.dtype)[:, None]
                                         for p in pages[h].tolist()]) for h in range(H)])

    pages = torch.tensor([[0], [3]])
    got_k, got_v = tiers.fetch(1, 1, pages)
    assert torch.equal(got_k, want(k, 1, pages)) and torch.equal(got_v, want(v, 1, pages))
    assert (req.hits, req.misses) == (0, 2) and req.bytes_fetched == 2 * 2 * 4 * D * 2
    tiers.fetch(1, 1, torch.tensor([[0], [2]]))          # (1,0,0) hot; (1,1,2) fills the third row
    assert (req.hits, req.misses) == (1, 3)
    tiers.fetch(1, 0, torch.tensor([[1], [1]]))          # two new units evict the two least recent
    assert list(req.lru) == [(1, 1, 2), (0, 0, 1), (0, 1, 1)]
    got_k, _ = tiers.fetch(1, 1, torch.tensor([[0], [3]]))   # both were evicted: fetched again, still exact
    assert torch.equal(got_k, want(k, 1, torch.tensor([[0], [3]])))
    assert (req.hits, req.misses) == (1, 7)
    before = list(req.lru)
    big = torch.tensor([[0, 1, 2], [0, 1, 2]])            # more units than the cache: straight copies
    got_k, got_v = tiers.fetch(1, 0, big)
    assert torch.equal(got_k, want(k, 0, big)) and torch.equal(got_v, want(v, 0, big))
    assert list(req.lru) == before and req.misses == 13
    empty = tiers.fetch(1, 0, torch.zeros(H, 0, dtype=torch.int64))
    assert empty[0].shape == (H, 0, 4, D)


def test_bad_arguments_name_the_parameter():
    tiers = _tiers()
    k, v = _kv(9, 1)
    with pytest.raises(ValueError, match=r"k must be \[num_layers=2, num_kv_heads=2, T >= 1, head_dim=8\]"):
        tiers.admit(0, k[:1], v[:1])
    with pytest.raises(ValueError, match="v must have k's shape"):
        tiers.admit(0, k, v[:, :, :4])
    with pytest.raises(ValueError, match=r"slot must be an int in \[0, 2\], got 3"):
        tiers.admit(3, k, v)
    tiers.admit(0, k, v)
    with pytest.raises(ValueError, match="already holds"):
        tiers.admit(0, k, v)
    with pytest.raises(ValueError, match=r"pages must be in \[0, 2\] \(9 tokens\), got \[0, 3\]"):
        tiers.fetch(0, 0, torch.tensor([[0], [3]]))
    with pytest.raises(ValueError, match=r"pages must be \[num_kv_heads=2, n\]"):
        tiers.fetch(0, 0, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match=r"layer must be an int in \[0, 1\]"):
        tiers.fetch(0, 2, torch.tensor([[0], [1]]))
    with pytest.raises(KeyError, match="slot 1 holds no admitted request"):
        tiers.fetch(1, 0, torch.tensor([[0], [1]]))
    with pytest.raises(ValueError, match="page_size must be an int >= 1"):
        KVTierConfig(page_size=0)


def test_capacity_is_checked_before_anything_is_allocated():
    k, v = _kv(8, 2)
    one = 2 * L * H * 2 * 4 * D * 2                      # two pages of 4 tokens, k and v, bf16
    tiers = _tiers(host_budget_bytes=one + one // 2)
    tiers.admit(0, k, v)
    with pytest.raises(ValueError, match=rf"host_budget_bytes={one + one // 2} is too small.*{one} are in use"):
        tiers.admit(1, k, v)
    assert set(tiers.requests) == {0} and tiers.host_bytes == one
    small = _tiers(device_budget_bytes=100)
    with pytest.raises(ValueError, match="device_budget_bytes=100 is too small: 8 tokens need"):
        small.admit(0, k, v)
    assert not small.requests


def test_release_and_slot_reuse_leave_nothing_behind():
    tiers = _tiers()
    slots = SlotStates(3)
    slots.register("kv_tiers", tiers)
    s = slots.acquire()
    k, v = _kv(10, 3)
    tiers.admit(s, k, v)
    tiers.fetch(s, 0, torch.tensor([[1], [2]]))
    slots.release(s)
    assert s not in tiers.requests and tiers.host_bytes == 0
    again = slots.acquire()
    assert again == s
    with pytest.raises(KeyError):
        tiers.fetch(again, 0, torch.tensor([[0], [0]]))
    k2, v2 = _kv(5, 4)
    req = tiers.admit(again, k2, v2)
    assert (req.hits, req.misses, len(req.lru)) == (0, 0, 0)
    assert torch.equal(tiers.fetch(again, 1, torch.tensor([[1], [0]]))[0][0, 0, 0], k2[1, 0, 4])


def test_persist_and_reuse_from_disk_with_integrity(tmp_path):
    tiers = _tiers()
    k, v = _kv(11, 5)
    ids = list(range(100, 111))
    tiers.admit(0, k, v)
    store = prefix_store(tmp_path, model_id="tiny-llama@abc")
    tiers.persist(0, store, ids)
    tiers.reset(0)
    req = tiers.admit_from_store(2, store, ids)
    assert torch.equal(req.k_pages, tiers.admit(1, k, v).k_pages) and torch.equal(req.v_pages, tiers.requests[1].v_pages)
    assert tiers.admit_from_store(0, store, ids[:-1]) is None            # another prefix: not there
    a3 = ChunkKVStore(tmp_path, model_id="tiny-llama@abc")             # A3's layout: never the prefix's entry
    assert a3.get(ids, torch.bfloat16) is None
    other = prefix_store(tmp_path, model_id="other-model")
    assert other.get(ids, torch.bfloat16) is None
    path = store.entries()[0]
    tensors = load_file(path)
    tensors["k"][0, 0, 0, 0] += 1                                        # tampered bytes, metadata kept
    from safetensors import safe_open
    with safe_open(path, "pt") as f:
        meta = f.metadata()
    save_file(tensors, path, metadata=meta)
    tiers.reset(2)
    with pytest.raises(ChunkStoreIntegrityError, match="payload sha256 mismatch"):
        tiers.admit_from_store(2, store, ids)
    assert 2 not in tiers.requests
    with pytest.raises(ValueError, match="token_ids must be the request's 11 prefill tokens"):
        tiers.persist(1, store, ids[:3])
