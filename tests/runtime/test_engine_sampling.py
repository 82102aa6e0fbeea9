"""The sampler's processors through the engine: every request's tokens — penalties, min-p, logit bias,
min-tokens bans and stop token ids, draws and greedy rows in one in-flight batch under a token budget,
slots reused — equal the per-request reference (``_sampler_ref``) applied to the logits it was sampled
from and its own history, on the CPU decode and on ``CudaDecoder``'s step (eager, on the CPU: the code
that a CUDA graph captures, with the bucket's static inputs); default requests keep their tokens."""
from __future__ import annotations

import random

import pytest

from macattn.methods.base import ModelDims
from macattn.methods.full.backend import FullAttention
from macattn.methods.full.config import FullConfig
from macattn.runtime.config import RuntimeConfig
from macattn.runtime.engine import LLMEngine
from macattn.runtime.sampling import SamplingConfig

from _sampler_ref import reference_token
from _paged_reference import PagedReference, attach_cpu_decoder
from _tiny import MAC, prompts, tiny_model

V = 256


class _PagedFull(FullAttention):
    def decode_plans(self, geometry, rows):
        return PagedReference(geometry, rows)


def _engine(kind: str, *, slots: int = 3, budget: int | None = 11, overlap: bool = False) -> LLMEngine:
    model = tiny_model("llama", seed=6)
    rc = RuntimeConfig(max_batch_size=slots, max_seq_len=128, num_blocks=64, max_num_batched_tokens=budget,
                       async_scheduling=overlap)
    if kind == "mac":
        return LLMEngine(model, MAC, rc)
    dims = ModelDims.of(model)
    extra = kind == "bucketed"          # the scratch slot of the GPU decode's padding rows
    eng = LLMEngine(model, None, rc, method=lambda n: _PagedFull(FullConfig(), dims, num_slots=n + extra))
    if kind == "bucketed":     # the GPU decode's step, eagerly on the CPU
        attach_cpu_decoder(eng)
    return eng


def _params(rng: random.Random, i: int) -> SamplingConfig:
    kinds = [dict(), dict(repetition_penalty=1.8), dict(presence_penalty=1.5, frequency_penalty=0.7),
             dict(logit_bias={rng.randrange(V): 8.0, rng.randrange(V): -50.0}),
             dict(min_tokens=5, end_id=rng.randrange(V), stop_token_ids=[rng.randrange(V)]),
             dict(frequency_penalty=-1.0, repetition_penalty=0.7)]
    kw = dict(kinds[i % len(kinds)], max_new_tokens=8)
    if i % 2:
        kw.update(temperature=rng.uniform(0.6, 1.5), top_k=rng.choice([0, 40]),
                  top_p=rng.choice([0.0, 0.9]), min_p=rng.choice([0.0, 0.05]), random_seed=rng.randrange(1 << 40))
    return SamplingConfig(**kw)


def _run(eng: LLMEngine, ps, params, *, arrivals: bool = True):
    """Requests arriving over the first steps; per request its ``(token, logits)`` per step."""
    ids, steps = [], {}
    pending = list(zip(ps, params))
    while pending or eng.has_unfinished():
        if pending:
            p, sp = pending.pop(0)
            ids.append(eng.add_request(p, sp))
            steps[ids[-1]] = []
            if arrivals and len(pending) % 2:
                continue
        for o in eng.step():
            steps[o.request_id].append((o.token, o.logits, o.finish_reason))
    return ids, steps


def _check_against_reference(eng, ids, steps, ps, params):
    for rid, p, sp in zip(ids, ps, params):
        seq = eng.requests[rid]
        out = []
        for j, (token, logits, reason) in enumerate(steps[rid]):
            want = reference_token(logits, sp, seq.seed, len(p) + j, p.tolist(), out)
            if token is None:                   # the end token: not emitted
                assert reason == "end_id" and want == sp.end_id and len(out) >= sp.min_tokens
            else:
                assert token == want, (rid, j)
                out.append(token)
        assert out == eng.pop_finished(rid).output
        if len(out) < sp.min_tokens:
            raise AssertionError(f"request {rid} ended before min_tokens")
        if seq.finish_reason == "stop_token_id":
            assert out[-1] in sp.stop_token_ids and len(out) >= sp.min_tokens


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "async"])
@pytest.mark.parametrize("kind", ["cpu", "bucketed", "mac"])
def test_every_request_equals_the_per_request_reference(kind, overlap):
    """Serially and with async scheduling (each step launched before the previous step's tokens are read; the
    bucketed decoder then takes pending tokens from the device, ``TokenFeed``)."""
    rng = random.Random(11)
    ps = prompts(9, seed=17, lo=12, hi=30)
    params = [_params(rng, i) for i in range(9)]
    eng = _engine(kind, overlap=overlap)
    variants = []
    if kind == "bucketed":
        dec = eng.executor.decoder
        forward = dec._forward
        dec._forward = lambda b, variant, key: (variants.append(variant), forward(b, variant, key))[1]
    ids, steps = _run(eng, ps, params)
    _check_against_reference(eng, ids, steps, ps, params)
    assert eng.slot_states.num_free == eng.slot_states.num_slots - (kind == "bucketed")
    if kind == "bucketed":       # the bucket steps ran the sampler's variants: draw, bias table, penalties
        assert len(set(variants)) > 2 and all(any(v[i] for v in variants) for i in range(3))
    assert eng.executor.token_counts.allocated


def test_default_requests_keep_their_tokens_beside_processed_ones():
    ps = prompts(6, seed=4, lo=15, hi=25)
    rng = random.Random(2)
    plain = [SamplingConfig(max_new_tokens=8), SamplingConfig(max_new_tokens=8, top_k=0, top_p=0.9, random_seed=5)] * 3
    mixed = [plain[i] if i % 2 == 0 else _params(rng, i) for i in range(6)]
    for kind in ("cpu", "bucketed"):
        alone_eng = _engine(kind)
        a_ids, _ = _run(alone_eng, ps[0::2], plain[0::2])
        alone = [alone_eng.pop_finished(i).output for i in a_ids]
        eng = _engine(kind)
        m_ids, _ = _run(eng, ps, mixed)
        assert [eng.pop_finished(m_ids[i]).output for i in range(0, 6, 2)] == alone, kind
        assert not eng.executor.token_counts.allocated or any(p.penalized for p in mixed)


def test_min_tokens_bans_the_end_and_stop_tokens_and_stop_token_ids_end_a_request():
    p = prompts(1, seed=8, lo=20, hi=20)[0]
    eng = _engine("cpu", budget=None)
    first = eng.add_request(p, max_new_tokens=6)
    eng.run_to_completion()
    greedy = eng.pop_finished(first).output
    end = greedy[0]
    rid = eng.add_request(p, max_new_tokens=6, end_id=end)           # ends at once
    eng.run_to_completion()
    seq = eng.pop_finished(rid)
    assert seq.output == [] and seq.finish_reason == "end_id"
    rid = eng.add_request(p, max_new_tokens=6, end_id=end, min_tokens=3)
    eng.run_to_completion()
    seq = eng.pop_finished(rid)
    assert len(seq.output) >= 3 and end not in seq.output[:3]
    rid = eng.add_request(p, max_new_tokens=6, stop_token_ids=[greedy[1]])
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    assert outs[-1].finish_reason == "stop_token_id" and outs[-1].token == greedy[1] and outs[-1].finished
    assert eng.pop_finished(rid).output == greedy[:2]                 # the stop token is emitted
    rid = eng.add_request(p, max_new_tokens=6, stop_token_ids=[greedy[0]], min_tokens=1)
    eng.run_to_completion()
    assert greedy[0] not in eng.pop_finished(rid).output[:1]


def test_the_engine_checks_token_ids_against_the_vocabulary():
    eng = _engine("cpu")
    p = prompts(1, seed=1)[0]
    with pytest.raises(ValueError, match=r"logit_bias token ids must lie in \[0, 255\]"):
        eng.add_request(p, max_new_tokens=2, logit_bias={256: 1.0})
    with pytest.raises(ValueError, match=r"stop_token_ids token ids must lie in \[0, 255\]"):
        eng.add_request(p, max_new_tokens=2, stop_token_ids=[300])
    with pytest.raises(ValueError, match=r"end_id must lie in \[0, 255\].*min_tokens"):
        eng.add_request(p, max_new_tokens=2, end_id=-1, min_tokens=1)
    with pytest.raises(ValueError, match=r"prompt_logprobs must be an int in \[0, vocab_size=256\]"):
        eng.add_request(p, max_new_tokens=2, prompt_logprobs=257)
    eng.add_request(p, max_new_tokens=2, end_id=-1)                 # never generated: accepted as before
    assert not eng.scheduler.running and len(eng.scheduler.waiting) == 1


def test_tensor_parallel_equals_one_rank_with_the_processors_and_prompt_logprobs():
    """TP = 2 (CPU, gloo; a vocabulary the ranks split unevenly): penalties, bias, min-tokens bans, stop ids
    and prompt log-probabilities as on one rank (rank 0 samples and reduces; the workers' copies agree)."""
    from macattn.models.builtin import build_builtin_model

    shapes = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=16, vocab_size=250, max_position_embeddings=256)
    ps = [p % 250 for p in prompts(3, seed=21, lo=18, hi=30)]
    sps = [SamplingConfig(max_new_tokens=6, prompt_logprobs=2, repetition_penalty=1.5, temperature=1.2, top_k=30,
                          random_seed=4),
           SamplingConfig(max_new_tokens=6, logit_bias={7: 4.0}, min_tokens=3, end_id=7, frequency_penalty=0.5),
           SamplingConfig(max_new_tokens=6, stop_token_ids=[3], presence_penalty=1.0, prompt_logprobs=0)]

    def run(tp):
        eng = LLMEngine(build_builtin_model("llama", seed=3, **shapes).double(), MAC,
                        RuntimeConfig(max_batch_size=2, block_size=8, max_num_batched_tokens=12,
                                      tensor_parallel_size=tp))
        try:
            ids = [eng.add_request(p, sp) for p, sp in zip(ps, sps)]
            lp = {}
            while eng.has_unfinished():
                for o in eng.step():
                    if o.prompt_logprobs is not None:
                        lp[o.request_id] = o.prompt_logprobs
            return [eng.pop_finished(i).output for i in ids], [lp.get(i) for i in ids]
        finally:
            eng.close()

    (tokens1, lp1), (tokens2, lp2) = run(1), run(2)
    assert tokens2 == tokens1
    assert lp1[1] is None and lp2[1] is None
    for a, b in zip(lp1, lp2):
        if a is not None:
            assert len(a) == len(b) and a[0] is None and b[0] is None
            for x, y in zip(a[1:], b[1:]):
                assert list(x) == list(y) and max(abs(x[t] - y[t]) for t in x) < 1e-9
