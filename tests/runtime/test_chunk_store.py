"""ChunkKVStore: round trip, keys, integrity rejection, atomic concurrent access, LRU eviction."""
import json
import multiprocessing as mp
import os
import threading
import time

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from _tiny import tiny_model
from macattn.runtime.chunk_store import (LAYOUT, PREFIX_LAYOUT, ChunkKVStore, ChunkStoreIntegrityError,
                                         model_fingerprint, precompute_chunk_kv, prefix_store)


def _kv(T, seed=0, layers=2, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(layers, T, 2, 8, generator=g).to(dtype), torch.randn(layers, T, 2, 8, generator=g).to(dtype)


def test_round_trip_and_keys(tmp_path):
    store = ChunkKVStore(tmp_path, model_id="m", tokenizer_id="t")
    ids = torch.arange(5)
    k, v = _kv(5)
    assert store.get(ids, torch.float32) is None
    key = store.put(ids, k, v)
    got = store.get(ids, torch.float32)
    assert torch.equal(got[0], k) and torch.equal(got[1], v)
    with safe_open(str(store.path(key)), framework="pt") as f:
        meta = f.metadata()
    assert meta["model_id"] == "m" and json.loads(meta["k_shape"]) == [2, 5, 2, 8] and meta["num_layers"] == "2"
    # the key depends on model, tokenizer, dtype and every token
    assert store.key(ids, torch.bfloat16) != key
    assert store.key(torch.tensor([0, 1, 2, 3, 5]), torch.float32) != key
    assert ChunkKVStore(tmp_path, model_id="m2", tokenizer_id="t").key(ids, torch.float32) != key
    assert ChunkKVStore(tmp_path, model_id="m", tokenizer_id="t2").get(ids, torch.float32) is None
    bf = store.put(ids, k.bfloat16(), v.bfloat16())
    assert bf != key and store.get(ids, torch.bfloat16)[0].dtype == torch.bfloat16


def test_prefix_store_keeps_its_own_layout(tmp_path):
    """The completion method's prompt prefixes (keys after RoPE) never answer an A3 chunk lookup of the
    same tokens, nor another model's."""
    ids = list(range(100, 111))
    k, v = _kv(11, seed=5, dtype=torch.bfloat16)
    store = prefix_store(tmp_path, model_id="tiny-llama@abc")
    assert store.layout == PREFIX_LAYOUT != LAYOUT
    store.put(ids, k, v)
    got = store.get(ids, torch.bfloat16)
    assert torch.equal(got[0], k) and torch.equal(got[1], v)
    assert store.get(ids[:-1], torch.bfloat16) is None                            # another prefix
    assert ChunkKVStore(tmp_path, model_id="tiny-llama@abc").get(ids, torch.bfloat16) is None   # A3's layout
    assert prefix_store(tmp_path, model_id="other-model").get(ids, torch.bfloat16) is None


@pytest.mark.parametrize("tamper", ["payload", "metadata_model", "shape", "ids", "truncate"])
def test_tampered_entry_rejected(tmp_path, tamper):
    store = ChunkKVStore(tmp_path, model_id="m")
    ids = torch.arange(6)
    k, v = _kv(6)
    path = store.path(store.put(ids, k, v))
    with safe_open(str(path), framework="pt") as f:
        meta, t = f.metadata(), {n: f.get_tensor(n) for n in f.keys()}
    if tamper == "payload":
        t["k"][0, 0, 0, 0] += 1e-3
    elif tamper == "metadata_model":
        meta["model_id"] = "other"
    elif tamper == "shape":
        t["k"] = t["k"][:, :5].contiguous()
    elif tamper == "ids":
        t["token_ids"] = t["token_ids"].flip(0).contiguous()
    if tamper == "truncate":
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    else:
        save_file(t, str(path), metadata=meta)
    with pytest.warns(RuntimeWarning, match="(rejected|unreadable).*quarantined"):
        assert store.get(ids, torch.float32) is None          # a miss: the caller recomputes the entry
    assert store.quarantined == 1 and not path.exists()
    assert len(list((tmp_path / ".quarantine").iterdir())) == 1
    assert store.get(ids, torch.float32) is None and store.quarantined == 1   # gone, not failing again
    assert issubclass(ChunkStoreIntegrityError, ValueError)


def test_entries_that_are_not_files_or_too_large_are_quarantined_unread(tmp_path):
    """A FIFO or a huge (sparse) file under an entry's name is never opened for reading (issue 41)."""
    store = ChunkKVStore(tmp_path, model_id="m", max_bytes=1 << 20)
    ids = torch.arange(6)
    os.mkfifo(store.path(store.key(ids, torch.float32)))
    with pytest.warns(RuntimeWarning, match="not a regular file"):
        assert store.get(ids, torch.float32) is None
    big = store.path(store.key(torch.arange(7), torch.float32))
    with open(big, "wb") as f:
        f.truncate(1 << 30)                                   # 1 GiB, sparse
    with pytest.warns(RuntimeWarning, match="over the store's max_bytes"):
        assert store.get(torch.arange(7), torch.float32) is None
    assert store.quarantined == 2


def test_a_failed_write_is_dropped_with_a_warning(tmp_path, monkeypatch):
    import macattn.runtime.chunk_store as cs

    store = ChunkKVStore(tmp_path, model_id="m")

    def full_disk(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(cs, "save_file", full_disk)
    k, v = _kv(6)
    with pytest.warns(RuntimeWarning, match="not written.*No space left"):
        store.put(torch.arange(6), k, v)
    assert store.write_failures == 1 and not store.entries() and not list(tmp_path.glob(".*.tmp"))


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="model_id"):
        ChunkKVStore(tmp_path, model_id="")
    with pytest.raises(ValueError, match="max_bytes"):
        ChunkKVStore(tmp_path, model_id="m", max_bytes=0)
    store = ChunkKVStore(tmp_path, model_id="m")
    with pytest.raises(ValueError, match="token_ids"):
        store.put(torch.zeros(0, dtype=torch.int64), *_kv(0))
    with pytest.raises(ValueError, match="k must be"):
        store.put(torch.arange(4), *_kv(5))


def test_lru_eviction_by_bytes(tmp_path):
    probe = ChunkKVStore(tmp_path / "probe", model_id="m")
    probe.put(torch.arange(8), *_kv(8))
    size = probe.total_bytes
    store = ChunkKVStore(tmp_path / "s", model_id="m", max_bytes=int(size * 2.5))
    a, b, c = (torch.arange(8) + 100 * i for i in range(3))
    for i, ids in enumerate((a, b)):
        store.put(ids, *_kv(8, seed=i))
        os.utime(store.path(store.key(ids, torch.float32)), ns=(i * 10**9, i * 10**9))   # a older than b
    assert store.get(a, torch.float32) is not None          # hit refreshes a: b is now least recent
    store.put(c, *_kv(8, seed=2))
    assert store.get(b, torch.float32) is None
    assert store.get(a, torch.float32) is not None and store.get(c, torch.float32) is not None
    assert store.total_bytes <= store.max_bytes


def _writer(directory, rounds):
    store = ChunkKVStore(directory, model_id="m")
    for r in range(rounds):
        store.put(torch.arange(64), *_kv(64, seed=r % 2))


def test_concurrent_readers_never_see_partial_files(tmp_path):
    """A process rewrites one entry (alternating payloads) while threads read it: every read
    is either a miss or one of the two whole payloads, never an integrity error."""
    store = ChunkKVStore(tmp_path, model_id="m")
    payloads = [_kv(64, seed=s) for s in (0, 1)]
    proc = mp.get_context("fork").Process(target=_writer, args=(str(tmp_path), 200))
    errors, reads = [], []

    def reader():
        end = time.monotonic() + 60
        while proc.is_alive() and time.monotonic() < end:
            try:
                got = store.get(torch.arange(64), torch.float32)
            except Exception as exc:   # noqa: BLE001
                errors.append(exc)
                return
            if got is not None:
                assert any(torch.equal(got[0], k) and torch.equal(got[1], v) for k, v in payloads)
                reads.append(1)

    proc.start()
    threads = [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    proc.join()
    assert proc.exitcode == 0 and not errors and reads
    assert store.get(torch.arange(64), torch.float32) is not None
    assert not list(tmp_path.glob("*.tmp"))


def test_precompute_matches_model_and_fingerprint(tmp_path):
    model = tiny_model("qwen2")
    ids = torch.randint(0, 256, (9,), generator=torch.Generator().manual_seed(3))
    k, v = precompute_chunk_kv(model, ids)
    assert k.shape == (2, 9, 2, 16) and v.shape == k.shape and k.dtype == torch.float64
    # layer 0 pre-RoPE keys are k_proj(input_layernorm(embedding))
    attn, ln = model.model.layers[0].self_attn, model.model.layers[0].input_layernorm
    with torch.no_grad():
        ref = attn.k_proj(ln(model.model.embed_tokens(ids))).view(9, 2, 16)
    torch.testing.assert_close(k[0], ref, rtol=0, atol=1e-12)
    store = ChunkKVStore(tmp_path, model_id=model_fingerprint(model))
    k2, _ = store.get_or_compute(model, ids)
    assert store.misses == 1 and torch.equal(store.get_or_compute(model, ids)[0], k2) and store.hits == 1
    assert model_fingerprint(model) != model_fingerprint(tiny_model("qwen2", seed=2))
