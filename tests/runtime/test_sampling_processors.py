"""The sampler's per-row logits processors (``macattn.runtime.sampling``): repetition / presence /
frequency penalties, min-p, logit bias and the min-tokens bans, batched as tensor ops over ``[B, V]``
with the per-slot token counts (``TokenCounts``), equal a plain per-request reference (``_sampler_ref``)
on fresh random inputs; a row with every default gets exactly the tokens of the sampler before them;
the parameters are validated by name; a CUDA bucket's static inputs (``StepInputs``, here on the CPU)
hold the batch ``SamplingBatch.of`` builds."""
from __future__ import annotations

import math
import random

import pytest
import torch

from macattn.runtime.sampling import (BIAS_WIDTH, MAX_LOGIT_BIAS, MAX_STOP_TOKEN_IDS, PAD_ROW, SamplerVariant,
                                      SamplingBatch, SamplingConfig, SamplingRow, TokenCounts, _uniforms,
                                      process_logits, sample_tokens)
from macattn.runtime.step_inputs import StepInputs

from _sampler_ref import reference_logits, reference_token

V = 97


def _random_params(rng: random.Random, *, max_new: int = 40) -> SamplingConfig:
    """Every processor on or off at random, values across their ranges."""
    pick = rng.random
    kw = dict(max_new_tokens=max_new)
    if pick() < 0.6:
        kw.update(repetition_penalty=rng.choice([rng.uniform(0.5, 2.0), 1.0]))
    if pick() < 0.6:
        kw.update(presence_penalty=rng.uniform(-2, 2))
    if pick() < 0.6:
        kw.update(frequency_penalty=rng.uniform(-2, 2))
    if pick() < 0.5:
        kw.update(logit_bias={t: rng.uniform(-100, 100) if pick() < 0.3 else rng.uniform(-5, 5)
                              for t in rng.sample(range(V), rng.randint(1, 12))})
    if pick() < 0.5:
        kw.update(min_tokens=rng.randint(0, max_new), end_id=rng.randrange(V) if pick() < 0.8 else None,
                  stop_token_ids=rng.sample(range(V), rng.randint(0, 4)))
    if pick() < 0.7:            # a draw, else greedy
        kw.update(temperature=rng.uniform(0.3, 2.0), top_k=rng.choice([0, 0, 5, 30]),
                  top_p=rng.choice([0.0, 1.0, rng.uniform(0.3, 0.99)]))
        if pick() < 0.6:
            kw.update(min_p=rng.choice([0.0, rng.uniform(0.01, 0.5)]))
    return SamplingConfig(**kw)


def _histories(rng: random.Random, n: int):
    """Per row: a prompt and an output drawn from a small part of the vocabulary (repeats happen)."""
    out = []
    for _ in range(n):
        hot = rng.sample(range(V), 20)
        prompt = [rng.choice(hot) for _ in range(rng.randint(1, 30))]
        output = [rng.choice(hot) for _ in range(rng.randint(0, 25))]
        out.append((prompt, output))
    return out


def _counts(hist, slots, num_slots):
    """``TokenCounts`` filled as the runtime does: the prompt marked, then each generated token recorded."""
    tc = TokenCounts(num_slots, V, "cpu")
    for (prompt, output), s in zip(hist, slots):
        tc.add_prompt(s, prompt)
        for t in output:
            tc.record(torch.tensor([s]), torch.tensor([t]))
    return tc


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("trial", range(4))
def test_the_batched_processors_equal_the_per_request_reference(dtype, trial):
    rng = random.Random(100 * trial + 7)
    B = 12
    logits = (torch.randn(B, V, generator=torch.Generator().manual_seed(trial)) * 3).to(dtype)
    params = [_random_params(rng) for _ in range(B)]
    hist = _histories(rng, B)
    slots = rng.sample(range(2 * B), B)
    tc = _counts(hist, slots, 2 * B)
    rows = [SamplingRow(p, rng.randrange(1 << 62), len(pr) + len(out), len(out))
            for p, (pr, out) in zip(params, hist)]
    batch = SamplingBatch.of(rows, "cpu")
    counts = tc.rows(torch.tensor(slots))
    # the processed logits, bit for bit
    x = process_logits(logits, batch, counts=counts)
    for b, (p, (pr, out)) in enumerate(zip(params, hist)):
        assert torch.equal(x[b], reference_logits(logits[b], p, pr, out)), b
    # the tokens: the argmax for greedy rows, the draw for the others
    got = sample_tokens(logits, batch, counts=counts).tolist()
    want = [reference_token(logits[b], p, r.seed, r.position, pr, out)
            for b, (p, r, (pr, out)) in enumerate(zip(params, rows, hist))]
    assert got == want
    # greedy_only is the argmax of the processed logits
    assert torch.equal(sample_tokens(logits, batch, greedy_only=True, counts=counts), x.argmax(-1))


def _sampler_before(logits, batch, *, greedy_only=False):
    """The sampler before the processors (temperature, top-k, top-p, the draw) — frozen here."""
    best = logits.argmax(dim=-1)
    if greedy_only:
        return best
    V_ = logits.shape[-1]
    x = logits.float() / batch.temperature[:, None]
    ordered = x.sort(dim=-1, descending=True).values
    rank = torch.arange(V_)
    k = torch.where(batch.top_k > 0, batch.top_k, V_)
    keep = rank[None, :] < k[:, None]
    probs = torch.softmax(ordered.masked_fill(~keep, float("-inf")), dim=-1)
    use_p = (batch.top_p > 0) & (batch.top_p < 1)
    keep &= ~use_p[:, None] | ((probs.cumsum(-1) - probs) < batch.top_p[:, None])
    last_kept = ordered.masked_fill(~keep, float("inf")).amin(dim=-1, keepdim=True)
    gumbel = -torch.log(-torch.log(_uniforms(batch.seed, batch.position, V_)))
    drawn = (x.masked_fill(x < last_kept, float("-inf")) + gumbel).argmax(dim=-1)
    greedy = (batch.top_k == 1) | ((batch.top_k == 0) & (batch.top_p == 0))
    return torch.where(greedy, best, drawn)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_rows_with_every_default_get_todays_tokens(dtype):
    """Default rows (greedy, or a draw with only temperature / top-k / top-p) beside rows with every
    processor on, in every sampler variant, get the tokens of the sampler before the processors."""
    rng = random.Random(3)
    gen = torch.Generator().manual_seed(3)
    for trial in range(6):
        B = 10
        logits = (torch.randn(B, V, generator=gen) * 4).to(dtype)
        logits[0, :5] = logits[0].max()                       # ties survive (no rounding of fp64 to fp32)
        plain = [SamplingConfig(), SamplingConfig(top_k=0, top_p=0.8, temperature=0.7),
                 SamplingConfig(top_k=20, temperature=1.4), SamplingConfig(top_k=0, top_p=1.0)]
        params = [plain[b % 4] if b % 2 == 0 else _random_params(rng) for b in range(B)]
        hist = _histories(rng, B)
        tc = _counts(hist, list(range(B)), B)
        rows = [SamplingRow(p, rng.randrange(1 << 62), 50 + b, len(hist[b][1])) for b, p in enumerate(params)]
        batch = SamplingBatch.of(rows, "cpu", bias_width=BIAS_WIDTH)
        before = _sampler_before(logits, batch)
        for use_bias in (False, True):
            for counts in (None, tc.rows(torch.arange(B))):
                got = sample_tokens(logits, batch, use_bias=use_bias, counts=counts)
                assert torch.equal(got[0::2], before[0::2]), (trial, use_bias)
        only_plain = SamplingBatch.of(rows[0::2], "cpu")
        assert torch.equal(sample_tokens(logits[0::2], only_plain), before[0::2])
        greedy = [b for b in range(0, B, 2) if params[b].greedy]
        assert torch.equal(sample_tokens(logits[greedy], SamplingBatch.of([rows[b] for b in greedy], "cpu"),
                                         greedy_only=True), logits[greedy].argmax(-1))


def test_min_p_keeps_the_tokens_near_the_most_likely():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.15, 0.1, 0.05]]))
    n = 4000
    p = SamplingConfig(top_k=0, top_p=1.0, min_p=0.3)            # keeps p >= 0.12: tokens 0, 1, 2
    batch = SamplingBatch.of([(p, 9, pos) for pos in range(n)], "cpu")
    freq = torch.bincount(sample_tokens(logits.expand(n, -1), batch), minlength=5) / n
    assert freq[3:].sum() == 0 and abs(float(freq[0]) - 0.4 / 0.85) < 0.03


def test_penalties_and_bias_steer_the_greedy_token():
    logits = torch.tensor([[3.0, 2.0, 1.0, -1.0]])
    tc = TokenCounts(1, 4, "cpu")
    tc.add_prompt(0, [0])
    s = torch.tensor([0])

    def tok(**kw):
        return int(sample_tokens(logits, SamplingBatch.of([SamplingRow(SamplingConfig(**kw), 0, 5, 1)], "cpu"),
                                 counts=tc.rows(s)))
    assert tok() == 0
    assert tok(repetition_penalty=2.0) == 1                 # 3 / 2 < 2: the prompt's token is penalised
    tc.record(s, torch.tensor([1]))
    tc.record(s, torch.tensor([1]))                          # token 1 generated twice
    assert tc.data[0].tolist() == [1, 4, 0, 0]
    assert tok(repetition_penalty=2.0) == 0                 # both seen ones halved: 1.5, 1.0, 1.0
    assert tok(repetition_penalty=4.0) == 2                 # 0.75, 0.5, 1.0
    assert tok(logit_bias={0: -2.4, 1: -1.5}) == 2          # 0.6, 0.5, 1.0
    assert tok(repetition_penalty=0.5, logit_bias={0: -2.4, 1: -1.5}) == 0   # seen ones doubled: 1.2, 1.0, 1.0
    assert tok(frequency_penalty=0.6) == 0 and tok(frequency_penalty=1.0, logit_bias={0: -2.1}) == 2
    assert tok(presence_penalty=2.0, logit_bias={0: -2.5}) == 2   # 0.5, 0.0, 1.0
    assert tok(logit_bias={3: 5.0}) == 3
    assert tok(min_tokens=2, end_id=0, max_new_tokens=3) == 1    # 1 generated < 2: the end token is banned
    assert tok(min_tokens=1, end_id=0, max_new_tokens=3) == 0
    assert tok(min_tokens=2, stop_token_ids=[0, 1], max_new_tokens=3) == 2


def test_token_counts_reset_copy_and_lazy_allocation():
    tc = TokenCounts(3, 5, "cpu")
    tc.reset(1)
    tc.copy(0, 1)
    assert not tc.allocated                                   # nothing held until a penalty asks
    tc.add_prompt(0, [4, 4, 2])
    tc.record(torch.tensor([0, 2, 2]), torch.tensor([4, 1, 1]), torch.tensor([1.0, 1.0, 0.0]))
    assert tc.data.tolist() == [[0, 0, 1, 0, 3], [0] * 5, [0, 2, 0, 0, 0]]    # a padding row adds nothing
    tc.copy(0, 1)
    tc.reset(0)
    assert tc.data.tolist() == [[0] * 5, [0, 0, 1, 0, 3], [0, 2, 0, 0, 0]]


def test_the_sampler_variant():
    assert SamplerVariant.of([SamplingConfig()]) == (False, False, False)
    assert SamplerVariant.of([SamplingConfig(), SamplingConfig(top_k=0, top_p=0.9)]) == (True, False, False)
    assert SamplerVariant.of([SamplingConfig(logit_bias={1: 1.0})]) == (False, True, False)
    assert SamplerVariant.of([SamplingConfig(min_tokens=1, end_id=2)]) == (False, True, False)
    assert SamplerVariant.of([SamplingConfig(min_tokens=1)]) == (False, False, False)   # nothing to ban
    assert SamplerVariant.of([SamplingConfig(presence_penalty=0.1)]) == (False, False, True)
    assert SamplingConfig(min_p=0.5).plain and not SamplingConfig(repetition_penalty=1.1).plain


@pytest.mark.parametrize("field, value, match", [
    ("repetition_penalty", 0.0, r"repetition_penalty must be a finite float in \[1e-06, 1e\+06\]"),
    ("repetition_penalty", float("inf"), r"repetition_penalty must be a finite float in \[1e-06, 1e\+06\]"),
    ("repetition_penalty", "1", r"repetition_penalty must be a float in \[1e-06, 1e\+06\]"),
    ("presence_penalty", 2.5, r"presence_penalty must be a finite float in \[-2, 2\]"),
    ("frequency_penalty", -2.01, r"frequency_penalty must be a finite float in \[-2, 2\]"),
    ("frequency_penalty", float("nan"), r"frequency_penalty must be a finite float in \[-2, 2\]"),
    ("min_p", 1.5, r"min_p must be a finite float in \[0, 1\]"),
    ("min_p", True, r"min_p must be a float in \[0, 1\]"),
    ("logit_bias", {3: 101.0}, r"logit_bias\[3\] must be a finite float in \[-100, 100\]"),
    ("logit_bias", {-1: 1.0}, r"logit_bias must map token ids \(int >= 0\)"),
    ("logit_bias", {"5": 1.0}, r"logit_bias must map token ids \(int >= 0\)"),
    ("logit_bias", {i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)}, rf"at most {MAX_LOGIT_BIAS}"),
    ("logit_bias", 3, r"logit_bias must map token ids"),
    ("min_tokens", -1, r"min_tokens must be an int in \[0, max_new_tokens=4\]"),
    ("min_tokens", 5, r"min_tokens must be an int in \[0, max_new_tokens=4\]"),
    ("stop_token_ids", [1, -2], r"stop_token_ids must be ints >= 0"),
    ("stop_token_ids", "12", r"stop_token_ids must be a sequence of ints"),
    ("stop_token_ids", list(range(MAX_STOP_TOKEN_IDS + 1)), rf"at most {MAX_STOP_TOKEN_IDS}"),
    ("prompt_logprobs", -1, r"prompt_logprobs must be None or an int >= 0"),
    ("prompt_logprobs", 1.0, r"prompt_logprobs must be None or an int >= 0"),
    ("random_seed", 1 << 63, r"random_seed must be an int in \[0, 2\^63 - 1\]"),
])
def test_each_new_field_is_validated_by_name(field, value, match):
    with pytest.raises((ValueError, TypeError), match=match):
        SamplingConfig(max_new_tokens=4, **{field: value})


def test_field_normalisation():
    p = SamplingConfig(max_new_tokens=4, logit_bias={9: 1, 2: -100}, stop_token_ids=[7, 3, 7], min_tokens=4,
                       repetition_penalty=2, presence_penalty=-2, frequency_penalty=2, min_p=1, prompt_logprobs=0)
    assert p.logit_bias == ((2, -100.0), (9, 1.0)) and p.stop_token_ids == (7, 3)
    assert isinstance(p.repetition_penalty, float) and isinstance(p.min_p, float)
    assert SamplingConfig(logit_bias=[(4, 0.5)]).logit_bias == ((4, 0.5),)
    assert hash(p) == hash(SamplingConfig(max_new_tokens=4, logit_bias=[(9, 1.0), (2, -100.0)], stop_token_ids=(7, 3),
                                          min_tokens=4, repetition_penalty=2.0, presence_penalty=-2.0,
                                          frequency_penalty=2.0, min_p=1.0, prompt_logprobs=0))
    assert p.bias_entries(3) == [(2, -100.0), (9, 1.0), (7, -math.inf), (3, -math.inf)]
    assert p.bias_entries(4) == [(2, -100.0), (9, 1.0)]


def test_a_buckets_static_inputs_hold_the_batch_and_rewrite_bias_rows_when_they_change():
    rng = random.Random(5)
    nb = 8
    inputs = StepInputs(nb, max_pages=4, paged=True, device=torch.device("cpu"))
    params = [_random_params(rng, max_new=3) for _ in range(5)] + [SamplingConfig(min_tokens=2, end_id=4,
                                                                                   max_new_tokens=4)]
    order = list(range(len(params)))
    for step in range(6):
        if step == 3:                                   # requests finish and join: rows move
            order = [5, 0, 3]
        if step == 4:
            order = [1, 2, 5, 0, 3, 4]
        rows = [SamplingRow(params[i], 1000 + i, 30 + step, step) for i in order]
        keys = [(i, step < params[i].min_tokens) for i in order] + [None] * (nb - len(rows))
        inputs.write_sampling(rows + [PAD_ROW] * (nb - len(rows)), keys)
        inputs.upload()
        got, want = inputs.sampling(), SamplingBatch.of(rows, "cpu", pad_to=nb, bias_width=BIAS_WIDTH)
        for name in want.__dataclass_fields__:
            assert torch.equal(getattr(got, name), getattr(want, name)), (step, name)
    assert inputs.bias_keys[2] == (5, False) and inputs.row_keys[:6] == [1, 2, 5, 0, 3, 4]
