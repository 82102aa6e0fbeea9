"""The TensorRT-LLM PyTorch-backend module: its pure parts run against our engine's data, its guard.

TensorRT-LLM is not installed here: the subclasses of upstream types (``backend.load()``) are never defined
in these tests. The metadata objects below are plain namespaces carrying the attribute names the pure code
reads (``seq_lens``, ``num_contexts``, ``request_ids``, ``kv_cache_params.num_cached_tokens_per_seq``,
``kv_cache_manager.get_batch_cache_indices`` / ``tokens_per_block``) — data, not an imitation of TensorRT-LLM.
"""
import sys
import types
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from macattn.builder.trtllm_pytorch import backend
from macattn.builder.trtllm_pytorch.plan_inputs import (BatchView, RopeSpec, context_spans, gather_contiguous_kv,
                                                        mac_step_inputs, paged_kv_views, rope_rotate)
from macattn.builder.trtllm_pytorch.ring_slots import RingSlotTable, SlotFreeList
from macattn.methods.mac.config import MacConfig
from macattn.methods.mac.reference import mac_decode_step_reference
from macattn.methods.mac.seeding import seed_rings_
from macattn.methods.mac.state import MacState
from macattn.plugins.trt_compat import TensorRTVersionError
from macattn.runtime.kv_cache import PagedKVCache

HQ, HKV, D, TPB, NBLOCKS = 4, 2, 16, 4, 24


def _metadata(seq_lens, num_contexts, rids, cached, blocks):
    mgr = SimpleNamespace(tokens_per_block=TPB, get_batch_cache_indices=lambda ids: [blocks[r] for r in ids])
    return SimpleNamespace(seq_lens=torch.tensor(seq_lens, dtype=torch.int32), num_contexts=num_contexts,
                           request_ids=list(rids), kv_cache_params=SimpleNamespace(num_cached_tokens_per_seq=cached),
                           kv_cache_manager=mgr)


def _engine_batch(gen):
    """Our engine's paged pool (``PagedKVCache``, one layer) holding two decoding requests of lengths
    ``m + 1`` (blocks scattered) and a context request; returns everything a step needs."""
    cache = PagedKVCache(num_layers=1, num_blocks=NBLOCKS, block_size=TPB, num_kv_heads=HKV, head_dim=D,
                         dtype=torch.float32, device="cpu")
    perm = torch.randperm(NBLOCKS, generator=gen).tolist()
    blocks = {7: perm[0:2], 42: perm[2:7], 3: perm[7:11]}        # request id -> its blocks
    m = {42: 17, 3: 12}                                           # generation requests' positions
    truth = {}
    for rid, mm in m.items():
        k = torch.randn(HKV, mm + 1, D, generator=gen)
        v = torch.randn(HKV, mm + 1, D, generator=gen)
        for t in range(mm + 1):
            row = blocks[rid][t // TPB] * TPB + t % TPB
            cache.k[0][row], cache.v[0][row] = k[:, t], v[:, t]
        truth[rid] = (k, v)
    kp, vp = cache.pages(0)
    pool = torch.stack([kp, vp], dim=1)                           # TRT-LLM NHD [blocks, 2, tpb, Hkv, d]
    return cache, pool, blocks, m, truth


def test_step_inputs_from_metadata_fields():
    gen = torch.Generator().manual_seed(0)
    _, _, blocks, m, _ = _engine_batch(gen)
    md = _metadata([5, 1, 1], 1, [7, 42, 3], [0, m[42], m[3]], blocks)
    view = BatchView.from_metadata(md)
    slot_of = {7: 2, 42: 0, 3: 1}.__getitem__
    step = mac_step_inputs(view, slot_of)
    assert step.rows.tolist() == [5, 6]                     # packed q: 5 context tokens, then one per generation
    assert step.positions.tolist() == [17, 12] and step.slots.tolist() == [0, 1]
    assert step.kv_lens.tolist() == [18, 13] and step.kv_lens.dtype == torch.int32
    assert step.page_table.dtype == torch.int32 and step.page_table.shape == (2, 5)
    assert step.page_table[0].tolist() == blocks[42][:5] and step.page_table[1].tolist() == blocks[3][:4] + [0]
    (span,) = context_spans(view, slot_of)
    assert (span.request_id, span.slot, span.row_start, span.first_position, span.length) == (7, 2, 0, 0, 5)
    assert span.is_whole_prompt


def test_step_inputs_refuse_what_mac_cannot_decode():
    blocks = {1: [0, 1], 2: [2]}
    with pytest.raises(ValueError, match="no draft tokens"):
        mac_step_inputs(BatchView.from_metadata(_metadata([1, 2], 0, [1, 2], [3, 1], blocks)), {1: 0, 2: 1}.get)
    with pytest.raises(ValueError, match="blocks of 4 do not cover"):
        BatchView((1,), 0, (2,), (4,), ((2,),), TPB)
    with pytest.raises(ValueError, match="num_contexts must be an int in \\[0, 1\\]"):
        BatchView((1,), 2, (2,), (0,), ((2,),), TPB)
    with pytest.raises(ValueError, match="request_ids must be distinct"):
        BatchView((1, 1), 0, (2, 2), (0, 0), ((2,), (3,)), TPB)
    with pytest.raises(ValueError, match="share a ring slot"):
        mac_step_inputs(BatchView((1, 1), 0, (1, 2), (0, 0), ((0,), (1,)), TPB), lambda rid: 0)
    with pytest.raises(ValueError, match="lacks"):
        BatchView.from_metadata(SimpleNamespace(seq_lens=torch.ones(1), num_contexts=0))


def test_paged_views_of_trtllm_layouts():
    gen = torch.Generator().manual_seed(1)
    cache, pool, *_ = _engine_batch(gen)
    kp, vp = cache.pages(0)
    k, v = paged_kv_views(pool, "NHD")
    assert torch.equal(k, kp) and torch.equal(v, vp) and k.stride(-1) == 1
    hnd = pool.transpose(2, 3).contiguous()                       # [blocks, 2, Hkv, tpb, d]
    k2, v2 = paged_kv_views(hnd, "HND")
    assert torch.equal(k2, kp) and torch.equal(v2, vp) and k2.stride(-1) == 1
    with pytest.raises(ValueError, match="kv_layout"):
        paged_kv_views(pool, "NDH")
    with pytest.raises(ValueError, match="K-only"):
        paged_kv_views(pool[:, :1], "NHD")


def test_mac_step_through_trtllm_inputs_equals_engine_step():
    """Rings (``MacState``) and slots (``RingSlotTable``) as the KV-cache manager keeps them, K/V read back
    from a TRT-LLM-shaped pool built of our engine's pages: the MAC step equals the step on the engine's
    contiguous K/V, and some heads hit (so the rings were read)."""
    gen = torch.Generator().manual_seed(2)
    _, pool, blocks, m, truth = _engine_batch(gen)
    cfg = MacConfig(window=8, band=2, tau=0.3)
    p = cfg.for_layer(0)
    state = MacState.allocate(cfg, num_layers=1, num_slots=4, num_q_heads=HQ, head_dim=D, query_dtype=torch.float32)
    table = RingSlotTable(state)
    for rid in (7, 42, 3):
        table.ensure(rid)
    rids = (42, 3)
    # prefill queries whose last entries repeat: the step's query is near one of them -> hits
    for rid in rids:
        L = m[rid]
        q_pre = torch.randn(1, HQ, L, D, generator=gen)
        k, v = truth[rid]
        seed_rings_(state.layer(0), torch.tensor([table.slot(rid)]), q_pre, q_pre, k[None, :, :L], v[None, :, :L],
                    band=p.band, scale=D ** -0.5)
    q_new = torch.stack([state.layer(0)[0][table.slot(r), :, (m[r] - 3) % 8] for r in rids])   # [G, Hq, d]
    q_new = q_new + 1e-3 * torch.randn(q_new.shape, generator=gen)
    engine = MacState.allocate(cfg, num_layers=1, num_slots=4, num_q_heads=HQ, head_dim=D, query_dtype=torch.float32)
    for ours, theirs in zip(state.layer(0), engine.layer(0)):
        theirs.copy_(ours)

    md = _metadata([1, 1], 0, list(rids), [m[r] for r in rids], blocks)
    step = mac_step_inputs(BatchView.from_metadata(md), table.slot)
    k_pages, v_pages = paged_kv_views(pool, "NHD")
    k, v = gather_contiguous_kv(k_pages, v_pages, step.page_table, step.kv_lens)
    got = mac_decode_step_reference(q_new, q_new, k, v, step.positions, step.slots, *state.layer(0),
                                    band=p.band, tau=p.tau)

    T = max(m.values()) + 1
    k_true = torch.zeros(2, HKV, T, D)
    v_true = torch.zeros(2, HKV, T, D)
    for g, rid in enumerate(rids):
        k_true[g, :, :m[rid] + 1], v_true[g, :, :m[rid] + 1] = truth[rid]
    slots = torch.tensor([table.slot(r) for r in rids])
    want = mac_decode_step_reference(q_new, q_new, k_true, v_true, torch.tensor([m[r] for r in rids]), slots,
                                     *engine.layer(0), band=p.band, tau=p.tau)
    assert bool(got.hit.any()), "no head hit: the test would not read the rings"
    torch.testing.assert_close(got.out, want.out, rtol=0, atol=0)
    assert torch.equal(got.match_pos, want.match_pos)
    for a, b in zip(state.layer(0), engine.layer(0)):
        assert torch.equal(a, b)


def test_ring_slots_assign_free_reuse_over_mac_state():
    state = MacState.allocate(MacConfig(window=4, band=1), num_layers=2, num_slots=2, num_q_heads=2, head_dim=16)
    table = RingSlotTable(state)
    a = table.assign(100)
    assert table.ensure(100) == a and 100 in table and len(table) == 1
    with pytest.raises(ValueError, match="already owns ring slot"):
        table.assign(100)
    state.ring_pos[1][a, 0] = 5                      # the request writes an entry
    b = table.assign(200)
    assert b != a
    with pytest.raises(RuntimeError, match="no free MAC slot"):
        table.assign(300)
    assert table.free(100) == a and 100 not in table
    assert (state.ring_pos[1][a] == -1).all()        # released rows are empty
    assert table.assign(300) == a                    # and reused by the next request
    assert table.free(999) is None                   # a request never seen (its context never ran)
    assert table.slots([300, 200]).tolist() == [a, b]
    with pytest.raises(KeyError, match="request 7 has no ring slot"):
        table.slot(7)
    with pytest.raises(ValueError, match="request_id must be an int >= 0"):
        table.assign(-1)
    with pytest.raises(TypeError, match="SlotPool"):
        RingSlotTable(object())


def test_slot_free_list_resets_states_attached_late():
    pool = SlotFreeList(3)
    table = RingSlotTable(pool)
    s = table.assign(1)
    state = MacState.allocate(MacConfig(window=4, band=1), num_layers=1, num_slots=3, num_q_heads=2, head_dim=16)
    state.ring_pos[0].fill_(9)
    pool.attach(state)                               # the rings arrive at the first forward
    assert (state.ring_pos[0][s] == -1).all() and (state.ring_pos[0][(s + 1) % 3] == 9).all()
    state.ring_pos[0][s] = 4
    table.free(1)
    assert (state.ring_pos[0][s] == -1).all() and pool.in_use == ()
    with pytest.raises(ValueError, match="state has 2 slots"):
        pool.attach(MacState.allocate(MacConfig(window=4, band=1), num_layers=1, num_slots=2, num_q_heads=2,
                                      head_dim=16))
    with pytest.raises(ValueError, match="num_slots must be an int >= 1"):
        SlotFreeList(0)


@pytest.mark.parametrize("scaling", [None, 2.0])
def test_rope_of_the_pre_rope_query_equals_transformers(scaling):
    heads, P = 3, 64
    rope = SimpleNamespace(dim=D, theta=10000.0, scale_type="linear" if scaling else "none", scale=scaling or 1.0,
                           max_positions=P)
    spec = RopeSpec.from_rope_params(rope, D)
    cos, sin = spec.tables()
    hf = LlamaConfig(hidden_size=D * heads, num_attention_heads=heads, num_key_value_heads=heads, head_dim=D,
                     max_position_embeddings=P, rope_theta=10000.0,
                     rope_scaling=None if scaling is None else {"rope_type": "linear", "factor": scaling})
    pos = torch.tensor([0, 5, 33, 63])
    q = torch.randn(len(pos), heads, D, generator=torch.Generator().manual_seed(3))
    c, s = LlamaRotaryEmbedding(hf)(q, pos[None])
    want, _ = apply_rotary_pos_emb(q.transpose(0, 1)[None], q.transpose(0, 1)[None], c, s)
    torch.testing.assert_close(rope_rotate(q, pos, cos, sin), want[0].transpose(0, 1), atol=2e-5, rtol=1e-5)


def test_rope_spec_refuses_what_the_rotation_does_not_implement():
    base = dict(dim=D, theta=10000.0, scale_type="none", scale=1.0, max_positions=32)
    with pytest.raises(ValueError, match="full-width RoPE"):
        RopeSpec.from_rope_params(SimpleNamespace(**{**base, "dim": D // 2}), D)
    with pytest.raises(ValueError, match="'yarn' is not supported"):
        RopeSpec.from_rope_params(SimpleNamespace(**{**base, "scale_type": "RotaryScalingType.yarn"}), D)
    with pytest.raises(ValueError, match="is_neox=False"):
        RopeSpec.from_rope_params(SimpleNamespace(**base), D, is_neox=False)
    with pytest.raises(ValueError, match="theta"):
        RopeSpec(D, 1.0)


def test_guard_without_tensorrt_llm(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt_llm", None)      # import tensorrt_llm -> ImportError
    monkeypatch.setattr(backend, "_LOADED", None)
    with pytest.raises(ImportError, match=r"tensorrt_llm >= 1\.2"):
        backend.load()
    with pytest.raises(ImportError, match=r"tensorrt_llm >= 1\.2"):
        backend.install()


def test_guard_names_old_version_and_missing_names(monkeypatch):
    old = types.ModuleType("tensorrt_llm")
    old.__version__ = "1.1.0"
    monkeypatch.setitem(sys.modules, "tensorrt_llm", old)
    with pytest.raises(TensorRTVersionError, match=r"tensorrt_llm >= 1\.2.*found tensorrt_llm 1\.1\.0"):
        backend.require_trtllm_pytorch()
    bare = types.ModuleType("tensorrt_llm")
    bare.__version__ = "1.2.1"
    monkeypatch.setitem(sys.modules, "tensorrt_llm", bare)
    with pytest.raises(ImportError, match=r"lacks: tensorrt_llm\._torch\.attention_backend\.interface") as e:
        backend.require_trtllm_pytorch()
    assert "tensorrt_llm.llmapi.llm_args" in str(e.value)


def test_pure_parts_import_without_tensorrt_llm():
    import importlib.util
    assert importlib.util.find_spec("tensorrt_llm") is None     # this workplace: not installed
    assert "tensorrt_llm" not in sys.modules
    assert backend._LOADED is None
