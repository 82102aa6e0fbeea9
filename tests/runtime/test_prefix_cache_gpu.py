"""Automatic prefix caching on CUDA, where the captured decode graphs and the piecewise prefill graphs run: the
outputs with the cache equal those without it (the three families, MAC on and off, one request after another
and under in-flight batching), and MAC's ring after a hit equals its ring after a fresh prefill within the
kernels' bf16 tolerance (the CPU suite holds both bit for bit: ``test_prefix_cache.py``)."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from macattn.runtime.config import RuntimeConfig
from macattn.runtime.engine import LLMEngine

from _tiny import MAC, prompts, tiny_model
from test_prefix_cache import BS, DOC, LONG_QUESTION, QUESTIONS, _multi_turn, _ring_after_prefill, _turns

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _cuda_engine(family: str, case: str, *, cache: bool, budget: int | None = None, dtype=torch.float32) -> LLMEngine:
    rc = RuntimeConfig(max_batch_size=2, max_seq_len=128, block_size=BS, device="cuda", use_cuda_graphs=True,
                       max_num_batched_tokens=budget, enable_prefix_caching=cache)
    model = tiny_model(family, seed=2).to(dtype)
    return LLMEngine(model, MAC if case == "mac" else replace(MAC, enabled=False), rc)


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("case", ["mac", "mac_off"])
def test_outputs_with_the_cache_equal_outputs_without_on_cuda(family, case):
    """fp32 on CUDA: the later turns over the document hit and give the uncached run's tokens; logits within
    fp32 kernel rounding (a hit's rest is one chunk over cached rows instead of part of a whole prompt)."""
    ps = _multi_turn()
    plain_out, plain_logits = _turns(_cuda_engine(family, case, cache=False), ps)
    eng = _cuda_engine(family, case, cache=True)
    out, logits = _turns(eng, ps)
    assert out == plain_out
    for a, b in zip(logits, plain_logits):
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-4, atol=1e-4)
    assert eng.prefix_cache_hits >= 4 * 3 * BS


def test_outputs_equal_under_in_flight_batching_on_cuda():
    ps = [torch.cat([DOC, q]) for q in QUESTIONS]

    def run(cache):
        eng = _cuda_engine("llama", "mac", cache=cache, budget=9)
        ids = [eng.add_request(p, max_new_tokens=6) for p in ps]
        eng.run_to_completion()
        return [eng.pop_finished(i).output for i in ids], eng

    want, _ = run(False)
    got, eng = run(True)
    assert got == want and eng.prefix_cache_hits > 0


@pytest.mark.parametrize("long", [False, True])
def test_the_ring_after_a_hit_equals_a_fresh_prefills_on_cuda(long):
    """bf16 on CUDA (the fused seeding kernel): the ring rows' positions exactly, queries / summaries / log-sum-exps
    within bf16 rounding."""
    prompt = torch.cat([DOC, LONG_QUESTION if long else QUESTIONS[0]])
    fresh, none_cached = _ring_after_prefill(_cuda_engine("llama", "mac", cache=False, dtype=torch.bfloat16), prompt)
    eng = _cuda_engine("llama", "mac", cache=True, dtype=torch.bfloat16)
    eng.add_request(torch.cat([DOC, QUESTIONS[1]]), max_new_tokens=2)
    eng.run_to_completion()
    hit, cached = _ring_after_prefill(eng, prompt)
    assert none_cached == 0 and cached > 0
    n = len(fresh) // 4
    for i, (a, b) in enumerate(zip(hit, fresh)):
        if i >= 3 * n:                                     # ring_pos: the positions each column holds
            assert torch.equal(a, b)
        else:
            assert torch.isfinite(a[torch.isfinite(b)]).all()
            torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)
