"""The batched sampler (``macattn.runtime.sampling.sample_tokens``): greedy rows are the argmax, drawn
tokens follow softmax(logits / T) restricted by top-k / top-p, a row's draw depends only on its own
seed, position and logits (not on the batch), and no input gives a token outside the kept set."""
from __future__ import annotations

import torch

from macattn.runtime.sampling import SamplingBatch, SamplingConfig, sample_tokens


def _draw(logits, params, *, n, seed=7):
    """``n`` draws of one row at positions 0..n-1 (one batch of n rows)."""
    batch = SamplingBatch.of([(params, seed, pos) for pos in range(n)], "cpu")
    return sample_tokens(logits.expand(n, -1), batch)


def test_greedy_rows_take_the_argmax_and_greedy_only_matches():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    batch = SamplingBatch.of([(SamplingConfig(top_k=1, temperature=3.0), i, i) for i in range(6)], "cpu")
    assert torch.equal(sample_tokens(logits, batch), logits.argmax(-1))
    assert torch.equal(sample_tokens(logits, batch, greedy_only=True), logits.argmax(-1))


def test_frequencies_follow_the_tempered_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5]])
    n = 40_000
    got = torch.bincount(_draw(logits, SamplingConfig(top_k=0, top_p=1.0, temperature=1.5), n=n), minlength=5) / n
    want = torch.softmax(logits[0] / 1.5, -1)
    assert (got - want).abs().max() < 0.012, (got, want)


def test_top_k_and_top_p_cut_then_renormalise():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    n = 20_000
    k2 = torch.bincount(_draw(logits, SamplingConfig(top_k=2, temperature=1.0), n=n), minlength=4) / n
    assert k2[2:].sum() == 0 and abs(float(k2[0]) - 0.5 / 0.8) < 0.015
    p7 = torch.bincount(_draw(logits, SamplingConfig(top_k=0, top_p=0.7, temperature=1.0), n=n), minlength=4) / n
    assert p7[2:].sum() == 0 and abs(float(p7[0]) - 0.5 / 0.8) < 0.015
    p9 = torch.bincount(_draw(logits, SamplingConfig(top_k=0, top_p=0.9, temperature=1.0), n=n), minlength=4) / n
    assert p9[3] == 0 and p9[2] > 0.1


def test_a_row_depends_on_its_seed_and_position_not_on_the_batch():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 300, generator=g)
    params = SamplingConfig(top_k=40, top_p=0.95, temperature=1.3)
    rows = [(params, 100 + i, 17 + i) for i in range(5)]
    together = sample_tokens(logits, SamplingBatch.of(rows, "cpu"))
    for i in range(5):
        solo = sample_tokens(logits[i:i + 1], SamplingBatch.of([rows[i]], "cpu"))
        assert int(solo) == int(together[i])
    again = sample_tokens(logits, SamplingBatch.of(rows, "cpu"))
    assert torch.equal(together, again)
    other = sample_tokens(logits, SamplingBatch.of([(params, 999, 17 + i) for i in range(5)], "cpu"))
    assert not torch.equal(together, other)    # 5 draws over ~40 tokens each: a collision of all is ~0


def test_padding_rows_are_greedy_and_extreme_logits_stay_in_range():
    logits = torch.full((3, 10), float("-inf"))
    logits[:, 4] = 1e30
    logits[1, 7] = 1e30
    batch = SamplingBatch.of([(SamplingConfig(top_k=0, top_p=0.5, temperature=0.01), 3, 9)], "cpu", pad_to=3)
    out = sample_tokens(logits, batch)
    assert out.shape == (3,) and int(out[0]) == 4 and int(out[2]) == 4 and int(out[1]) in (4, 7)
    assert batch.top_k.tolist() == [0, 1, 1]


def test_random_seed_none_draws_a_fresh_seed():
    p = SamplingConfig(top_k=0, top_p=0.9)
    assert p.make_seed() != p.make_seed()
    assert SamplingConfig(random_seed=5).make_seed() == 5


def test_values_the_sampler_cannot_hold_are_refused_by_name():
    """A top_k or seed past int64 used to pass validation and fail the whole engine step (issue 41)."""
    import pytest

    from macattn import SamplingParams
    from macattn.runtime.sampling import SamplingConfig

    with pytest.raises(ValueError, match=r"top_k must be an int in \[0, 2\^63 - 1\]"):
        SamplingConfig(top_k=2 ** 63)
    with pytest.raises(ValueError, match=r"random_seed must be an int in \[0, 2\^63 - 1\]"):
        SamplingConfig(random_seed=2 ** 63)
    with pytest.raises(ValueError, match="top_k must be an int in"):
        SamplingParams(top_k=2 ** 63)
    with pytest.raises(ValueError, match="seed must be an int in"):
        SamplingParams(seed=2 ** 63)
    SamplingConfig(top_k=2 ** 63 - 1, random_seed=2 ** 63 - 1)
