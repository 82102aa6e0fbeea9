"""``n > 1``: one prompt prefilled once, ``n`` sequences forked from it (``LLMEngine.add_request(..., n=)``).
Forks share the prompt's full KV blocks (reference counts in ``BlockManager``), get a copy of its partly
filled last block and of every per-slot state (MAC rings, FastMKA summaries, the penalties' token counts),
and sample with seeds ``seed + i``: each sequence's tokens and logits equal an independent request with
that seed; blocks are freed exactly once; slots and blocks are all free at the end; aborts at every stage
release what the group holds."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from macattn.runtime.config import RuntimeConfig
from macattn.runtime.engine import LLMEngine
from macattn.runtime.sampling import SamplingConfig
from macattn.runtime.sequence import SequenceStatus

from _tiny import MAC, prompts, tiny_model
from test_chunked_prefill import _mka_model
from test_every_method import _exact_engine

BS = 8


def _engine(case: str, *, slots: int = 4, budget: int | None = 9, num_blocks: int = 64) -> LLMEngine:
    model = _mka_model() if case == "mka" else tiny_model("llama", seed=3)
    rc = RuntimeConfig(max_batch_size=slots, max_seq_len=96, block_size=BS, num_blocks=num_blocks,
                       max_num_batched_tokens=budget)
    return LLMEngine(model, None, rc, method="full") if case == "full" else LLMEngine(model, MAC, rc)


def _drain(eng: LLMEngine, checks=None) -> dict[int, list]:
    logits: dict[int, list] = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.logits is not None:
                logits.setdefault(o.request_id, []).append(o.logits)
        if checks is not None:
            checks(eng)
    return logits


def _check_pool(eng: LLMEngine) -> None:
    """Every block is free (plain, or evictable with a cached prefix) xor held; a block's holders are exactly the
    running requests whose table has it."""
    blocks = eng.executor.blocks
    free = list(blocks.free_blocks) + list(blocks.evictable)
    assert len(free) == len(set(free)) and not set(free) & set(blocks.holders)
    assert len(free) + len(blocks.holders) == blocks.num_blocks
    holders: dict[int, set] = {}
    for seq in eng.requests.values():
        for b in seq.block_table:
            holders.setdefault(b, set()).add(seq.request_id)
    assert holders == blocks.holders


def _all_free(eng: LLMEngine) -> None:
    blocks = eng.executor.blocks
    assert blocks.num_free == blocks.num_blocks and not blocks.holders
    assert sorted([*blocks.free_blocks, *blocks.evictable]) == list(range(blocks.num_blocks))
    assert eng.slot_states.num_free == eng.slot_states.num_slots


@pytest.mark.parametrize("case", ["mac", "full", "mka"])
@pytest.mark.parametrize("prompt_len", [2 * BS, 2 * BS + 5])
def test_each_fork_equals_an_independent_request_with_its_seed(case, prompt_len):
    p = prompts(1, seed=prompt_len, lo=prompt_len, hi=prompt_len)[0]
    other = prompts(1, seed=9, lo=20, hi=20)[0]
    sp = SamplingConfig(max_new_tokens=7, temperature=1.3, top_k=40, random_seed=1234,
                        repetition_penalty=1.2 if case == "mac" else 1.0)
    eng = _engine(case)
    before = eng.add_request(other, max_new_tokens=10)         # running while the group prefills
    eng.step()
    ids = eng.add_request(p, sp, n=3)
    assert len(ids) == 3 and [eng.requests[i].index for i in ids] == [0, 1, 2]
    assert [eng.requests[i].seed for i in ids] == [1234, 1235, 1236]
    shared = prompt_len // BS
    seen = []

    def checks(e):
        _check_pool(e)
        seqs = [e.requests[i] for i in ids if i in e.requests and not e.requests[i].finished]
        if len(seqs) == 3 and all(s.status is SequenceStatus.RUNNING for s in seqs):
            tables = [s.block_table for s in seqs]
            assert all(t[:shared] == tables[0][:shared] for t in tables)        # the full prompt blocks shared
            assert len({b for t in tables for b in t[shared:]}) == 3 * (len(tables[0]) - shared)   # the rest not
            assert all(e.executor.blocks.ref_count(b) == 3 for b in tables[0][:shared])
            seen.append(True)

    logits = _drain(eng, checks)
    assert seen
    outs = [eng.pop_finished(i).output for i in ids]
    eng.pop_finished(before)
    _all_free(eng)
    for i, rid in enumerate(ids):
        alone = _engine(case)
        r = alone.add_request(p, replace(sp, random_seed=1234 + i))
        alone_logits = _drain(alone)[r]
        assert alone.pop_finished(r).output == outs[i], i
        assert len(alone_logits) == len(logits[rid])
        for a, b in zip(alone_logits, logits[rid]):
            torch.testing.assert_close(b, a, rtol=1e-9, atol=1e-9)
    assert len({tuple(o) for o in outs}) > 1                     # the seeds differ


def test_forks_share_the_prompt_logprobs_and_take_fresh_seeds_when_none_is_given():
    p = prompts(1, seed=2, lo=21, hi=21)[0]
    eng = _engine("mac", budget=None)
    ids = eng.add_request(p, max_new_tokens=3, temperature=1.0, top_k=0, top_p=0.95, prompt_logprobs=2, n=3)
    seeds = [eng.requests[i].seed for i in ids]
    assert seeds == [seeds[0], seeds[0] + 1, seeds[0] + 2]
    first = {o.request_id: o for o in eng.step()}
    assert set(first) == set(ids)
    lp = first[ids[0]].prompt_logprobs
    assert len(lp) == 21 and all(first[i].prompt_logprobs is lp for i in ids)
    eng.run_to_completion()
    _all_free(eng)


def test_a_group_is_admitted_when_all_its_slots_and_blocks_are_free():
    ps = prompts(3, seed=4, lo=17, hi=17)
    eng = _engine("mac", slots=3, budget=None)
    a = eng.add_request(ps[0], max_new_tokens=4)
    eng.step()
    ids = eng.add_request(ps[1], max_new_tokens=3, n=3)      # needs 3 slots: waits for a
    c = eng.add_request(ps[2], max_new_tokens=2)              # FIFO: behind the group
    eng.step()
    assert eng.requests[ids[0]].status is SequenceStatus.WAITING and eng.requests[c].status is SequenceStatus.WAITING
    _drain(eng, _check_pool)
    assert all(eng.pop_finished(i).finish_reason == "length" for i in [a, *ids, c])
    _all_free(eng)


@pytest.mark.parametrize("stage", ["waiting", "prefilling", "after_fork"])
def test_aborting_a_parent(stage):
    p = prompts(1, seed=5, lo=30, hi=30)[0]
    eng = _engine("mac", slots=3, budget=8)
    if stage == "waiting":
        blocker = eng.add_request(prompts(1, seed=6)[0], max_new_tokens=3)
        eng.step()
    ids = eng.add_request(p, max_new_tokens=5, n=3)
    if stage != "waiting":
        eng.step()                                                    # the first chunk (8 of 30 tokens)
        assert [eng.requests[i].status for i in ids[1:]] == [SequenceStatus.FORK_PENDING] * 2
    if stage == "after_fork":
        while eng.requests[ids[1]].status is not SequenceStatus.RUNNING:
            eng.step()
    eng.abort(ids[0])
    _check_pool(eng)
    if stage == "after_fork":                     # the forks go on, holding the shared prompt blocks
        assert all(eng.requests[i].status is SequenceStatus.RUNNING for i in ids[1:])
        _drain(eng, _check_pool)
        assert [eng.pop_finished(i).finish_reason for i in ids] == ["aborted", "length", "length"]
    else:                                         # the forks never start
        assert [eng.pop_finished(i).finish_reason for i in ids] == ["aborted"] * 3
        if stage == "waiting":
            eng.run_to_completion()
            eng.pop_finished(blocker)
    _all_free(eng)


def test_aborting_a_pending_fork_leaves_the_rest_of_its_group():
    p = prompts(1, seed=5, lo=30, hi=30)[0]
    eng = _engine("mac", slots=3, budget=8)
    ids = eng.add_request(p, max_new_tokens=5, temperature=1.0, top_k=0, top_p=0.9, random_seed=77, n=3)
    eng.step()
    eng.abort(ids[1])
    _check_pool(eng)
    assert eng.slot_states.num_free == 1
    _drain(eng, _check_pool)
    assert eng.pop_finished(ids[1]).finish_reason == "aborted"
    outs = [eng.pop_finished(i).output for i in (ids[0], ids[2])]
    _all_free(eng)
    alone = _engine("mac", slots=3, budget=8)
    r = alone.add_request(p, max_new_tokens=5, temperature=1.0, top_k=0, top_p=0.9, random_seed=79)
    alone.run_to_completion()
    assert alone.pop_finished(r).output == outs[1]


def test_n_is_validated():
    p = prompts(1, seed=1, lo=20, hi=20)[0]
    eng = _engine("mac", slots=2, num_blocks=8)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="n must be an int >= 1"):
            eng.add_request(p, max_new_tokens=2, n=bad)
    with pytest.raises(ValueError, match=r"n=3 > the 2 request slots"):
        eng.add_request(p, max_new_tokens=2, n=3)
    with pytest.raises(ValueError, match=r"n=2: the 2 sequences need 14 KV blocks together, the pool has 8"):
        eng.add_request(p, max_new_tokens=40, n=2)                 # 60 tokens: 8 blocks, + 8 - 2 shared = 14
    assert eng.add_request(p, max_new_tokens=2) == eng.requests[max(eng.requests)].request_id   # n=None: an id
    assert not eng.scheduler.running and len(eng.scheduler.waiting) == 1
    comp = _exact_engine("completion", tiny_model("llama", seed=4))
    with pytest.raises(ValueError, match=r"n=2 > 1 is not supported with method 'completion'.*'completion'"):
        comp.add_request(p, max_new_tokens=2, n=2)
