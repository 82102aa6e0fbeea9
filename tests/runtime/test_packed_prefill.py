"""Packed (ragged) prefill and the token-budget step: several requests' prompts in one model call give
each request the logits and method state of its solo prefill (every registered method, the three
families, fp64), and a run whose steps mix decodes with prompt chunks gives every request the tokens and
logits of running it alone."""
from __future__ import annotations

import pytest
import torch

from macattn.core import ragged
from macattn.methods.mac import backend
from macattn.methods.registry import ATTENTION_METHODS
from macattn.runtime.config import RuntimeConfig
from macattn.runtime.engine import LLMEngine
from macattn.runtime.sequence import PrefillChunk

from _tiny import MAC, prompts, tiny_model
from test_every_method import _exact_engine
from test_prefix_cache import _ring_after_prefill

FAMILIES = ("llama", "qwen2", "mistral")


def _state_rows(engine, slot: int) -> list[torch.Tensor]:
    """Every per-slot tensor of ``slot`` (MAC's rings, FastMKA's summaries, ...) that the method keeps."""
    rows = []
    for state in engine.executor.slot_states().values():
        for t in vars(state).values():
            for x in (t if isinstance(t, (list, tuple)) else [t]):
                if isinstance(x, torch.Tensor) and x.dim() and x.shape[0] == engine.executor.num_slots:
                    rows.append(x[slot].clone())
    return rows


def _prefill(make, ps, packed: bool):
    eng = make()
    seqs = [eng.make_request(p, max_new_tokens=3) for p in ps]
    for s in seqs:
        eng.submit(s)
    eng.scheduler.admit()
    chunks = [PrefillChunk(s, 0, len(s.prompt)) for s in seqs]
    if packed:
        logits = eng.executor.prefill_chunks(chunks)
    else:
        logits = [eng.executor.prefill_chunks([c])[0] for c in chunks]
    return logits, [_state_rows(eng, s.slot) for s in seqs]


def _maker(family: str, name: str):
    """A fresh two-slot engine of ``name`` (a registered method, or ``"mac_on"``: MAC at ``_tiny.MAC``) per call."""
    if name == "mac_on":
        return lambda: LLMEngine(tiny_model(family, seed=4), MAC, RuntimeConfig(max_batch_size=2, max_seq_len=128))
    return lambda: _exact_engine(name, tiny_model(family, seed=4))


def _assert_same_prefill(solo, packed) -> None:
    """``_prefill``'s logits and per-slot state rows of two runs agree (fp64: 1e-9)."""
    (solo_logits, solo_state), (packed_logits, packed_state) = solo, packed
    for a, b in zip(solo_logits, packed_logits):
        torch.testing.assert_close(b, a, rtol=1e-9, atol=1e-9)
    for rows_a, rows_b in zip(solo_state, packed_state):
        assert len(rows_a) == len(rows_b)
        for a, b in zip(rows_a, rows_b):
            torch.testing.assert_close(b, a, rtol=1e-9, atol=1e-9, equal_nan=True)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name", ATTENTION_METHODS + ("mac_on",))
def test_packed_prefill_equals_solo_prefill(family, name):
    make, ps = _maker(family, name), prompts(2, seed=11, lo=9, hi=40)
    _assert_same_prefill(_prefill(make, ps, packed=False), _prefill(make, ps, packed=True))


def _run_alone(family, p, new):
    eng = LLMEngine(tiny_model(family, seed=5), MAC, RuntimeConfig(max_batch_size=1, max_seq_len=128))
    rid = eng.add_request(p, max_new_tokens=new)
    logits = []
    while eng.has_unfinished():
        logits += [o.logits for o in eng.step() if o.logits is not None]
    return eng.pop_finished(rid).output, logits


@pytest.mark.parametrize("family", FAMILIES)
def test_mixed_steps_equal_each_request_run_alone(family):
    """Staggered arrivals under a 9-token budget: steps decode some requests while packing others'
    prompt chunks (checked: such steps happen); every request's tokens and logits equal its solo run."""
    model = tiny_model(family, seed=5)
    ps = prompts(5, seed=13, lo=10, hi=30)
    eng = LLMEngine(model, MAC, RuntimeConfig(max_batch_size=3, max_seq_len=128, max_num_batched_tokens=9))
    ids, logits, mixed = [], {}, 0
    for i, p in enumerate(ps):
        ids.append(eng.add_request(p, max_new_tokens=6))
        logits[ids[-1]] = []
        for _ in range(i % 3):
            sched_decodes = len(eng.scheduler.decode_batch())
            out = eng.step()
            mixed += bool(sched_decodes and any(not s.prefilled for s in eng.scheduler.running))
            for o in out:
                if o.logits is not None:
                    logits[o.request_id].append(o.logits)
    while eng.has_unfinished():
        for o in eng.step():
            if o.logits is not None:
                logits[o.request_id].append(o.logits)
    assert mixed > 0
    for rid, p in zip(ids, ps):
        tokens, alone = _run_alone(family, p, 6)
        assert eng.pop_finished(rid).output == tokens
        for a, b in zip(alone, logits[rid]):
            torch.testing.assert_close(b, a, rtol=1e-9, atol=1e-9)


def test_a_step_stays_within_its_token_budget():
    eng = LLMEngine(tiny_model("llama", seed=5), MAC, RuntimeConfig(max_batch_size=3, max_seq_len=128,
                                                                   max_num_batched_tokens=10))
    for p in prompts(3, seed=3, lo=25, hi=40):
        eng.add_request(p, max_new_tokens=4)
    while eng.has_unfinished():
        step = eng.scheduler.schedule()
        assert step.num_tokens <= 10
        assert len({c.seq.request_id for c in step.prefills} & {s.request_id for s in step.decodes}) == 0
        # run what was scheduled, as LLMEngine.step does
        if step.decodes:
            batch = list(step.decodes)
            tokens, rows = eng.executor.decode_step(batch)
            for s, t, r in zip(batch, tokens, rows):
                eng._append(s, t, r)
        if step.prefills:
            for c, row in zip(step.prefills, eng.executor.prefill_chunks(list(step.prefills))):
                if row is not None:
                    eng._append(c.seq, eng.executor.sample([c.seq], row[None])[0], row)


def _whole_prompt_outputs(ps, max_new_tokens: int) -> list:
    """The tokens of ``ps`` run on the tiny llama with whole-prompt prefills (the CPU default), in order."""
    whole = LLMEngine(tiny_model("llama", seed=5), MAC, RuntimeConfig(max_batch_size=3, max_seq_len=128))
    ids = [whole.add_request(p, max_new_tokens=max_new_tokens) for p in ps]
    while whole.has_unfinished():
        whole.step()
    return [whole.pop_finished(i).output for i in ids]


def test_a_step_without_decodes_takes_the_prefill_budget():
    """With nothing decoding, a step takes prompt tokens up to ``max_prefill_tokens``; once a request
    decodes, steps fall back to ``max_num_batched_tokens``; the tokens equal a whole-prompt run's."""
    cfg = RuntimeConfig(max_batch_size=3, max_seq_len=128, max_num_batched_tokens=10, max_prefill_tokens=45)
    eng = LLMEngine(tiny_model("llama", seed=5), MAC, cfg)
    ps = prompts(3, seed=4, lo=25, hi=40)
    ids = [eng.add_request(p, max_new_tokens=4) for p in ps]
    sizes = []
    while eng.has_unfinished():
        step = eng.scheduler.schedule()
        limit = 10 if step.decodes else 45
        # over the budget only by the decode rows, when the first chunk is the rest of its prompt
        assert step.num_tokens <= limit + (len(step.decodes) if step.prefills[:1] and step.prefills[0].completes_prompt
                                           else 0)
        sizes.append((bool(step.decodes), step.num_tokens))
        eng.execute(step)
    # the first step takes a whole first prompt of 25-40 tokens, over the decode budget (a second prompt that does
    # not fit the rest of the prefill budget waits: a chunk that leaves part of its prompt is its step's first)
    assert sizes[0] == (False, len(ps[0])) and 10 < len(ps[0]) and len(ps[0]) + len(ps[1]) > 45
    assert [eng.pop_finished(i).output for i in ids] == _whole_prompt_outputs(ps, 4)


def test_the_prefill_budget_is_validated():
    with pytest.raises(ValueError, match="max_prefill_tokens must be >= max_num_batched_tokens=10"):
        RuntimeConfig(max_batch_size=3, max_num_batched_tokens=10, max_prefill_tokens=9)
    with pytest.raises(ValueError, match="max_prefill_tokens needs max_num_batched_tokens"):
        RuntimeConfig(max_batch_size=3, max_prefill_tokens=9)


def test_close_releases_the_device_memory_even_while_the_engine_is_referenced():
    """``LLMEngine.close`` drops the KV pool and the fused forward (whose weights the model's own projections
    view): a reference to the engine kept anywhere (a server object, a traceback) then holds neither."""
    import gc
    import weakref

    eng = LLMEngine(tiny_model("llama", seed=5), MAC, RuntimeConfig(max_batch_size=2, max_seq_len=64))
    eng.add_request(prompts(1, seed=1, lo=5, hi=9)[0], max_new_tokens=2)
    eng.run_to_completion()
    pool = weakref.ref(eng.executor.kv.k[0])
    fused = weakref.ref(eng.executor.fused.layers[0].qkv_weight)
    eng.close()
    gc.collect()
    assert pool() is None and fused() is None


def test_partial_chunks_are_multiples_of_the_quantum():
    """A chunk that leaves part of its prompt is a multiple of ``chunk_quantum`` whatever the decodes beside it
    (room below one quantum: the room itself) and its step's first chunk; the last chunk ends its prompt;
    every step's prompt tokens stay within its budget, and a step over it by its decode rows takes the rest of one
    prompt whole; the tokens equal a whole-prompt run's."""
    cfg = RuntimeConfig(max_batch_size=3, max_seq_len=128, max_num_batched_tokens=30)
    eng = LLMEngine(tiny_model("llama", seed=5), MAC, cfg)
    assert eng.scheduler.chunk_quantum == 1                  # the CPU default; CUDA_CHUNK_QUANTUM on CUDA
    eng.scheduler.chunk_quantum = 8
    ps = prompts(3, seed=6, lo=40, hi=60)
    ids = [eng.add_request(p, max_new_tokens=5) for p in ps]
    partial = []
    while eng.has_unfinished():
        step = eng.scheduler.schedule()
        assert step.num_tokens - len(step.decodes) <= 30
        if step.num_tokens > 30:
            first = step.prefills[0]
            assert first.completes_prompt and step.num_tokens - first.num_tokens <= 30 - first.num_tokens + len(step.decodes)
        room = 30 - len(step.decodes)
        for c in step.prefills:
            if c.end < len(c.seq.prompt):
                partial.append(c.num_tokens)
                assert c is step.prefills[0] and (c.num_tokens % 8 == 0 or c.num_tokens < 8), (c.num_tokens, room)
            room -= c.num_tokens
        eng.execute(step)
    assert partial and any(n % 8 == 0 for n in partial)
    assert [eng.pop_finished(i).output for i in ids] == _whole_prompt_outputs(ps, 5)


def test_the_chunk_quantum_rule_and_its_validation():
    from macattn.runtime.config import quantized_chunk
    from macattn.runtime.scheduler import Scheduler

    assert [quantized_chunk(t, 256) for t in (8191, 7937, 7936, 300, 255, 1)] == [7936, 7936, 7936, 256, 255, 1]
    assert quantized_chunk(37, 1) == 37
    eng = LLMEngine(tiny_model("llama", seed=5), MAC, RuntimeConfig(max_batch_size=2, max_seq_len=64))
    with pytest.raises(ValueError, match="chunk_quantum"):
        Scheduler(eng.slot_states, eng.executor.blocks, chunk_quantum=0)


def _rings_after_prefill(mac_config, prompt: torch.Tensor) -> list[list[torch.Tensor]]:
    """Per layer the ring rows (q, o, lse, pos) of ``prompt``'s request right after its packed prefill
    (``test_prefix_cache._ring_after_prefill``'s rows, which run tensor by tensor, each over the layers)."""
    eng = LLMEngine(tiny_model("llama", seed=4), mac_config, RuntimeConfig(max_batch_size=1, max_seq_len=128))
    rows, _ = _ring_after_prefill(eng, prompt)
    layers = eng.mac_state.num_layers
    return [rows[layer::layers] for layer in range(layers)]


def test_a_layer_with_mac_off_seeds_no_ring():
    """Seeding writes a ring only where MAC is on: a layer with MAC off never matches against its ring, so its
    row stays empty (every position -1) while a layer with MAC on holds what an all-on engine's holds."""
    prompt = prompts(1, seed=3, lo=40, hi=40)[0]
    every = _rings_after_prefill(MAC, prompt)
    mixed = _rings_after_prefill(MAC.with_overrides({0: {"enabled": False}}), prompt)
    assert (every[0][3] >= 0).any() and (mixed[0][3] == -1).all()
    for a, b in zip(every[1], mixed[1]):
        torch.testing.assert_close(b, a, rtol=0, atol=0, equal_nan=True)


def test_a_prompt_rest_that_fits_the_budget_is_not_split_for_the_decode_rows_and_a_partial_chunk_is_a_first():
    """Budget 30, quantum 8: with one stream decoding, a 30-token prompt is taken whole (31 tokens in the step,
    not 29 + a 1-token remainder) and the prompt behind it waits; with two decoding, a 40-token prompt gets a
    24-token chunk and the 4 tokens of room left give the next prompt no chunk (it starts as a step's first)."""
    eng = LLMEngine(tiny_model("llama", seed=5), MAC, RuntimeConfig(max_batch_size=4, max_seq_len=128,
                                                                    max_num_batched_tokens=30))
    eng.scheduler.chunk_quantum = 8
    a, b, c, d = prompts(4, seed=9, lo=5, hi=5)[0], *(p[:n] for p, n in zip(prompts(3, seed=10, lo=40, hi=40),
                                                                            (30, 40, 40)))
    eng.add_request(a, max_new_tokens=6)
    eng.step()                                           # a's prompt, alone
    rb, rc, rd = (eng.add_request(p, max_new_tokens=3) for p in (b, c, d))
    step = eng.scheduler.schedule()
    assert len(step.decodes) == 1
    assert [(ch.seq.request_id, ch.start, ch.end) for ch in step.prefills] == [(rb, 0, 30)]
    assert step.num_tokens == 31
    eng.execute(step)
    step = eng.scheduler.schedule()
    assert len(step.decodes) == 2
    assert [(ch.seq.request_id, ch.start, ch.end) for ch in step.prefills] == [(rc, 0, 24)]
    eng.execute(step)
    eng.run_to_completion()
    assert all(eng.requests[r].finished for r in (rb, rc, rd))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name", ATTENTION_METHODS + ("mac_on",))
def test_fresh_prompts_as_one_varlen_call_equal_solo_prefill(family, name, monkeypatch):
    """The CUDA path for a call of fresh prompts (``RaggedPrefill.varlen``: one varlen attention call, MAC's rings
    seeded at once by ``seed_packed_``) forced on the CPU through its reference: every method's logits and state
    equal each prompt's solo prefill. Prompts of 3..19 tokens (window 16, band 4), so MAC takes the packed seeding.
    The retrieval-completion methods keep their own KV and prefill one request per call, so they never take it."""
    make, ps = _maker(family, name), prompts(2, seed=12, lo=3, hi=19)
    solo = _prefill(make, ps, packed=False)
    seeded, real = [], backend.seed_packed_
    monkeypatch.setattr(backend, "seed_packed_", lambda *a, **kw: seeded.append(1) or real(*a, **kw))
    monkeypatch.setattr(ragged, "varlen_applies", lambda query: True)
    packed = _prefill(make, ps, packed=True)
    if name == "mac_on":
        assert seeded, "MAC's packed seeding was not taken"
    _assert_same_prefill(solo, packed)
