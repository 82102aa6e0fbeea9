"""Automatic prefix caching (``RuntimeConfig.enable_prefix_caching``; ``runtime/block_manager.py``): a request whose
prompt starts with full KV blocks an earlier request prefilled takes them and prefills only the rest.

The outputs with the cache equal those without it token for token (MAC on and off, full attention; llama, qwen2,
mistral; one request after another, under in-flight batching, with forks, after eviction from a pool too small
for the cache); MAC's ring after a hit equals its ring after a fresh prefill bit for bit (a hit leaves the
ring's window ``K`` to compute); the block manager's hash chain, reference counts and LRU eviction; methods
that cannot rebuild their state from cached blocks are refused by name; the counters and the request's
``num_cached_tokens``."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from macattn.runtime.block_manager import BlockManager
from macattn.runtime.config import RuntimeConfig
from macattn.runtime.engine import LLMEngine
from macattn.runtime.engine_args import EngineArgs
from macattn.runtime.prefix_cache import block_hashes, cache_salt
from macattn.runtime.sampling import SamplingConfig
from macattn.runtime.sequence import Sequence

from _tiny import MAC, prompts, tiny_model

BS = 16
DOC = prompts(1, seed=5, lo=70, hi=70)[0]                  # 4 full blocks + 6 tokens
QUESTIONS = prompts(4, seed=6, lo=3, hi=24)                # 5, 8, 8, 13 tokens: shorter than MAC's window (16)
LONG_QUESTION = prompts(1, seed=7, lo=30, hi=30)[0]        # longer than it


def _engine(family: str = "llama", case: str = "mac", *, cache: bool | None = True, budget: int | None = None,
            slots: int = 2, num_blocks: int | None = None, max_seq_len: int = 128) -> LLMEngine:
    rc = RuntimeConfig(max_batch_size=slots, max_seq_len=max_seq_len, block_size=BS, num_blocks=num_blocks,
                       max_num_batched_tokens=budget, enable_prefix_caching=cache)
    model = tiny_model(family, seed=2)
    if case == "full":
        return LLMEngine(model, None, rc, method="full")
    mac = {"mac": MAC, "mac_off": replace(MAC, enabled=False),
           "mac_below": replace(MAC, min_context=100),     # every prompt here is shorter: no ring is seeded
           "mac_engaged": replace(MAC, min_context=70)}[case]
    return LLMEngine(model, mac, rc)


def _turns(eng: LLMEngine, ps: list[torch.Tensor], new_tokens: int = 6) -> tuple[list, list]:
    """Each prompt run to completion before the next is submitted: ``(outputs, logits per request)``."""
    outs, logits = [], []
    for p in ps:
        rid = eng.add_request(p, max_new_tokens=new_tokens)
        rows = []
        while eng.has_unfinished():
            rows += [o.logits for o in eng.step() if o.request_id == rid and o.logits is not None]
        outs.append(eng.pop_finished(rid).output)
        logits.append(torch.stack(rows))
    return outs, logits


def _multi_turn() -> list[torch.Tensor]:
    """A document then questions about it, one prompt repeated whole, an unrelated prompt between."""
    ps = [torch.cat([DOC, q]) for q in QUESTIONS]
    return [ps[0], ps[1], prompts(1, seed=8, lo=40, hi=40)[0], ps[2], ps[1], ps[3]]


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("case", ["mac", "mac_off", "mac_below", "full"])
def test_outputs_with_the_cache_equal_outputs_without(family, case):
    ps = _multi_turn()
    plain_out, plain_logits = _turns(_engine(family, case, cache=False), ps)
    eng = _engine(family, case)
    out, logits = _turns(eng, ps)
    assert out == plain_out
    for a, b in zip(logits, plain_logits):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert eng.prefix_cache_hits >= 4 * 3 * BS               # the later turns over the document hit


@pytest.mark.parametrize("case", ["mac", "full"])
def test_outputs_equal_under_in_flight_batching(case):
    """Requests join while others decode and prompts are chunked (budget 9): the first request's document
    blocks are committed chunk by chunk, later ones start from them mid-run; the same schedule without the cache
    gives the same tokens."""
    ps = [torch.cat([DOC, q]) for q in QUESTIONS]

    def run(cache):
        eng = _engine(case=case, cache=cache, budget=9, slots=3)
        ids, logits = [eng.add_request(ps[0], max_new_tokens=12)], {}
        step = 0
        while eng.has_unfinished():
            if step in (9, 11, 16):                      # after the document is committed, during decodes
                ids.append(eng.add_request(ps[len(ids)], max_new_tokens=5))
            for o in eng.step():
                if o.logits is not None:
                    logits.setdefault(o.request_id, []).append(o.logits)
            step += 1
        seqs = [eng.pop_finished(i) for i in ids]
        return [s.output for s in seqs], [torch.stack(logits[i]) for i in ids], [s.metrics for s in seqs]

    plain_out, plain_logits, _ = run(False)
    out, logits, metrics = run(True)
    assert len(out) == 4 and out == plain_out
    for a, b in zip(logits, plain_logits):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    # the prompts are 70 + (5, 8, 8, 13) tokens; MAC computes at least its window (16), full attention 1
    assert [m["num_cached_tokens"] for m in metrics] == ([0, 48, 48, 64] if case == "mac" else [0, 64, 64, 64])


def _ring_after_prefill(eng: LLMEngine, prompt: torch.Tensor) -> tuple[list, int]:
    """MAC's ring rows (every layer: q, o, lse, pos) of ``prompt``'s request right after its prefill, and the
    request's cached tokens."""
    rid = eng.add_request(prompt, max_new_tokens=4)
    seq = eng.requests[rid]
    while not seq.output:
        eng.step()
    st = eng.mac_state
    rows = [t[layer][seq.slot].clone() for t in (st.qring, st.oring, st.ring_lse, st.ring_pos)
            for layer in range(st.num_layers)]
    eng.run_to_completion()
    return rows, seq.num_cached_tokens


@pytest.mark.parametrize("long", [False, True])          # 5 tokens (< K: the hit is cut back) and 30
@pytest.mark.parametrize("budget", [None, 5])
def test_the_ring_after_a_hit_equals_the_ring_after_a_fresh_prefill(long, budget):
    """Bit for bit when the rest of the prompt is one chunk (the CPU's whole-prompt default); in chunks of 5 within
    1e-12 (chunked prefill itself is not bitwise the whole-prompt one: ``test_chunked_prefill.py``)."""
    prompt = torch.cat([DOC, LONG_QUESTION if long else QUESTIONS[0]])
    fresh, none_cached = _ring_after_prefill(_engine(cache=False), prompt)
    eng = _engine(budget=budget)
    eng.add_request(torch.cat([DOC, QUESTIONS[1]]), max_new_tokens=2)    # another question fills the cache
    eng.run_to_completion()
    hit, cached = _ring_after_prefill(eng, prompt)
    assert none_cached == 0 and cached == min(len(DOC), len(prompt) - MAC.window) // BS * BS == (64 if long else 48)
    for a, b in zip(hit, fresh):
        if budget is None:
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_a_hit_leaves_the_method_state_to_compute():
    """MAC: at least its window K = 16 tokens computed; MAC off (no layer reads its ring), MAC on a prompt shorter
    than its ``min_context`` (no ring seeded) and full attention: at least one (the first token's logits). A prompt
    asked again whole is served from its blocks up to that limit."""
    p = torch.cat([DOC, QUESTIONS[1]])                       # 78 tokens
    for case, expect in (("mac", 48), ("mac_engaged", 48), ("mac_off", 64), ("mac_below", 64), ("full", 64)):
        eng = _engine(case=case)
        _turns(eng, [p, p])
        assert (eng.prefix_cache_queries, eng.prefix_cache_hits) == (2 * len(p), expect)
    exact = DOC[:64]                                          # a prompt of exactly 4 blocks, asked twice
    eng = _engine(case="full")
    _turns(eng, [exact, exact])
    assert eng.prefix_cache_hits == 48                        # its last block is computed for the logits


def test_a_pool_too_small_for_the_cache_evicts_without_a_wrong_token():
    """One slot, 8 blocks: the document's requests take 6 or 7; an unrelated prompt of 6 blocks in between takes the
    4 plain free ones and evicts 2 cached ones, least recently freed first (the document's tail), so the next
    question finds a shorter prefix; every output equals the run without the cache."""
    doc_q = [torch.cat([DOC, q]) for q in QUESTIONS]
    ps = [doc_q[0], doc_q[1], prompts(1, seed=8, lo=76, hi=76)[0], doc_q[2], doc_q[1], doc_q[3]]
    kw = dict(slots=1, num_blocks=8, max_seq_len=112)
    plain_out, plain_logits = _turns(_engine(cache=False, **kw), ps, new_tokens=20)
    eng = _engine(**kw)
    out, logits = _turns(eng, ps, new_tokens=20)
    assert out == plain_out
    for x, y in zip(logits, plain_logits):
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)
    blocks = eng.executor.blocks
    # doc+q0: a miss, 4 blocks cached; doc+q1: 3 (MAC's window cut); the unrelated prompt evicts the document's
    # blocks 3 and 2; doc+q2 finds 2 and evicts the unrelated prompt's tail; doc+q1 again 3; doc+q3 4
    assert eng.prefix_cache_hits == 48 + 32 + 48 + 64
    assert blocks.num_free == blocks.num_blocks and not blocks.holders
    assert len(blocks.cached) == 5 and set(blocks.cached.values()) | set(blocks.free_blocks) == set(range(8))
    assert set(blocks.cached.values()) == set(blocks.evictable) == set(blocks.block_key)


def test_a_request_larger_than_the_pool_is_refused():
    eng = _engine(slots=1, num_blocks=4, max_seq_len=112)
    with pytest.raises(ValueError, match="need 6 KV blocks, the pool has 4"):
        eng.add_request(torch.cat([DOC, QUESTIONS[0]]), max_new_tokens=8)


def test_forks_start_from_a_cached_prefix():
    p = torch.cat([DOC, QUESTIONS[2]])
    sp = SamplingConfig(max_new_tokens=6, temperature=1.2, top_k=30, random_seed=77)

    def run(cache):
        eng = _engine(cache=cache, slots=3, budget=9)
        _turns(eng, [torch.cat([DOC, QUESTIONS[0]])])
        ids = eng.add_request(p, sp, n=3)
        eng.run_to_completion()
        blocks = eng.executor.blocks
        assert blocks.num_free == blocks.num_blocks and not blocks.holders
        return [eng.pop_finished(i).output for i in ids]

    assert run(True) == run(False)


def test_a_request_with_prompt_logprobs_prefills_its_whole_prompt_and_fills_the_cache():
    eng = _engine(case="full")
    first = eng.add_request(torch.cat([DOC, QUESTIONS[0]]), max_new_tokens=2, prompt_logprobs=1)
    eng.run_to_completion()
    again = eng.add_request(torch.cat([DOC, QUESTIONS[1]]), max_new_tokens=2, prompt_logprobs=1)
    eng.run_to_completion()
    after = eng.add_request(torch.cat([DOC, QUESTIONS[2]]), max_new_tokens=2)
    eng.run_to_completion()
    got = [eng.pop_finished(i) for i in (first, again, after)]
    assert [s.num_cached_tokens for s in got] == [0, 0, 64]
    assert [s.metrics["num_cached_tokens"] for s in got] == [0, 0, 64]
    assert len(got[1].prompt_logprobs) == len(got[1].prompt)
    assert (eng.prefix_cache_queries, eng.prefix_cache_hits) == (len(got[2].prompt), 64)


# --- the block manager --------------------------------------------------------------------------------

def _seq(tokens: list[int], new: int = 4) -> Sequence:
    return Sequence(prompt=list(tokens), sampling=SamplingConfig(max_new_tokens=new))


def test_the_hash_chain_keys_a_block_by_its_whole_prefix():
    salt = cache_salt("model", 1)
    a = list(range(40))
    keys = block_hashes(a, 8, salt)
    assert len(keys) == 5 and len(set(keys)) == 5 and all(len(k) == 16 for k in keys)
    assert block_hashes(a + [7, 7], 8, salt) == keys                     # a partial block has no key
    b = a.copy()
    b[12] = 99                                                            # block 1 changes: keys 1.. change
    kb = block_hashes(b, 8, salt)
    assert kb[0] == keys[0] and all(x != y for x, y in zip(kb[1:], keys[1:]))
    assert block_hashes(a[8:16], 8, salt)[0] != keys[1]                   # the same tokens after another prefix
    assert set(block_hashes(a, 8, cache_salt("model", 2))).isdisjoint(keys)


def test_refcounts_commit_and_eviction():
    bm = BlockManager(7, 4, salt=cache_salt("t"))
    a = _seq(range(10), new=2)                                            # 12 positions: 3 blocks
    assert bm.lookup(a, 10) == []
    bm.allocate(a)
    bm.commit(a, 0, 5)                                                    # block 0 full; block 1 not yet
    assert list(bm.cached.values()) == [a.block_table[0]]
    bm.commit(a, 5, 10)                                                   # block 1 completed; 2 is partial
    assert list(bm.cached.values()) == a.block_table[:2]
    b = _seq(list(range(8)) + [50, 51, 52], new=1)                        # shares blocks 0 and 1
    hit = bm.lookup(b, len(b.prompt) - 1)
    assert hit == a.block_table[:2] and bm.lookup(b, 7) == a.block_table[:1]
    assert bm.can_allocate(b, hit)
    bm.allocate(b, hit)
    assert b.block_table[:2] == hit and bm.ref_count(hit[0]) == 2 and bm.num_free == 7 - 4
    bm.free(a)
    assert bm.ref_count(hit[0]) == 1 and bm.num_free == 4 and not bm.evictable
    bm.free(b)
    assert bm.num_free == 7 and list(bm.evictable) == [hit[1], hit[0]]    # the tail first: evicted first
    c = _seq([9] * 8, new=8)                                              # 4 of the 5 plain free blocks
    bm.allocate(c)
    assert set(bm.cached.values()) == set(hit)
    d = _seq(range(8), new=1)                                             # a hit on block 0 only, taken first
    assert bm.lookup(d, 8) == hit and bm.can_allocate(d, hit[:1]) and not bm.can_allocate(_seq([1] * 12))
    bm.allocate(d, hit[:1])                                               # + 2 blocks: the plain one, hit[1] evicted
    assert hit[1] in d.block_table and list(bm.cached.values()) == [hit[0]] and not bm.evictable
    bm.free(c)
    bm.free(d)
    assert bm.num_free == 7 and not bm.holders and bm.lookup(_seq(range(12)), 12) == [hit[0]]


def test_a_prefix_committed_twice_stays_in_one_block():
    """Two requests of one prompt prefilled together: the second's copy of each block stays private and returns
    to the plain free list."""
    bm = BlockManager(8, 4, salt=cache_salt("t"))
    a, b = _seq(range(8)), _seq(range(8))
    bm.allocate(a)
    bm.allocate(b)
    bm.commit(a, 0, 8)
    bm.commit(b, 0, 8)
    assert list(bm.cached.values()) == a.block_table[:2] and not set(b.block_table) & set(bm.block_key)
    bm.free(b)
    assert sorted(bm.free_blocks) == sorted(set(range(8)) - set(a.block_table)) and not bm.evictable


def test_caching_off_keeps_no_keys():
    eng = _engine(cache=False)
    _turns(eng, [torch.cat([DOC, QUESTIONS[0]])] * 2)
    blocks = eng.executor.blocks
    assert not eng.prefix_caching and not blocks.caching and not blocks.cached
    assert (eng.prefix_cache_queries, eng.prefix_cache_hits) == (0, 0)
    with pytest.raises(RuntimeError, match="prefix caching is off"):
        blocks.lookup(_seq(range(20)), 20)


# --- which methods, and the surfaces -----------------------------------------------------------------

def test_methods_without_prefix_caching_are_refused_by_name_and_off_by_default():
    from _completion import completion_maps
    from macattn.methods.completion.config import CompletionConfig
    from test_chunked_prefill import _mka_model

    cfg = CompletionConfig(n_sink=4, n_tail=8, top_k=3, feature_dim=16, hidden=32)
    model = tiny_model("llama", seed=2)
    kw = dict(method="completion", method_config=cfg,
              method_kwargs={"maps": completion_maps(model, cfg), "use_op": False})
    with pytest.raises(ValueError, match="enable_prefix_caching=True is not available: method 'completion'"):
        LLMEngine(model, None, RuntimeConfig(max_batch_size=1, max_seq_len=64, enable_prefix_caching=True), **kw)
    assert not LLMEngine(model, None, RuntimeConfig(max_batch_size=1, max_seq_len=64), **kw).prefix_caching
    with pytest.raises(ValueError, match="FastMKA-patched"):
        LLMEngine(_mka_model(), MAC, RuntimeConfig(max_batch_size=1, max_seq_len=64, enable_prefix_caching=True))
    assert not LLMEngine(_mka_model(), MAC, RuntimeConfig(max_batch_size=1, max_seq_len=64)).prefix_caching
    assert _engine(cache=None).prefix_caching and _engine(case="full", cache=None).prefix_caching


def test_engine_args_carry_enable_prefix_caching():
    import argparse

    assert EngineArgs().enable_prefix_caching is None and EngineArgs().runtime_config().enable_prefix_caching is None
    assert EngineArgs(enable_prefix_caching=False).runtime_config().enable_prefix_caching is False
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    for flag, want in (("--no-enable-prefix-caching", False), ("--enable-prefix-caching", True)):
        assert EngineArgs.from_cli_args(parser.parse_args([flag])).enable_prefix_caching is want
    with pytest.raises(TypeError, match="enable_prefix_caching must be bool or None"):
        EngineArgs(enable_prefix_caching="yes")
    with pytest.raises(ValueError, match="enable_prefix_caching must be a bool"):
        RuntimeConfig(enable_prefix_caching=1)


def test_tensor_parallel_ranks_reuse_the_cached_blocks():
    """TP = 2 (gloo): every rank's pool holds the cached blocks' K/V (rank 0's block tables are every rank's), so
    the later turns over the document equal TP = 1 without the cache (logits <= 1e-5 fp32, the same tokens)."""
    from test_tensor_parallel import MAC as TP_MAC, tp_model

    ps = [p % 250 for p in _multi_turn()]

    def run(tp, cache):
        eng = LLMEngine(tp_model("llama"), TP_MAC, RuntimeConfig(max_batch_size=2, max_seq_len=128, block_size=BS,
                                                                 tensor_parallel_size=tp, enable_prefix_caching=cache))
        try:
            out, logits = _turns(eng, ps)
            return out, logits, eng.prefix_cache_hits
        finally:
            eng.close()

    plain_out, plain_logits, _ = run(1, False)
    out, logits, hits = run(2, True)
    assert out == plain_out and hits >= 4 * 3 * BS
    for a, b in zip(logits, plain_logits):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
