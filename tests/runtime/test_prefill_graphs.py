"""The piecewise prefill (``runtime.prefill_graphs``): a packed call through the pieces — padded to its token
bucket, the attention eager between them — gives the tokens, logits and method state of the plain fused
forward. On the CPU the pieces run eagerly (``capture=False``: the decomposition and the padding); on CUDA the
captured graphs replay them (GPU test)."""
from __future__ import annotations

import pytest
import torch

from macattn.runtime.config import RuntimeConfig
from macattn.runtime.engine import LLMEngine
from macattn.runtime.prefill_graphs import PrefillGraphs

from _tiny import MAC, prompts, tiny_model


def _engine(case: str, budget, device="cpu", dtype=None, graphs: str = "off", use_cuda_graphs=False):
    model = tiny_model("llama", seed=2)
    if dtype is not None:
        model = model.to(dtype)
    kw = {"method": "full"} if case == "full" else {}
    eng = LLMEngine(model, None if case == "full" else MAC,
                    RuntimeConfig(max_batch_size=3, max_seq_len=128, max_num_batched_tokens=budget, device=device,
                                  use_cuda_graphs=use_cuda_graphs), **kw)
    ex = eng.executor
    if graphs == "eager-pieces":
        pad_block = ex.blocks.free_blocks.pop()       # a block no request gets: the padded tokens' K/V go there
        ex.prefill_graphs = PrefillGraphs(ex.fused, ex.kv, pad_row=pad_block * ex.config.block_size,
                                          needs_q_pre=ex.method.capabilities.needs_pre_rope_query, capture=False,
                                          buckets=(8, 24, 48))
    elif graphs == "off":
        ex.prefill_graphs = None
    return eng


def _run(eng, ps, new_tokens=6):
    ids = [eng.add_request(p, max_new_tokens=new_tokens) for p in ps]
    logits = {i: [] for i in ids}
    while eng.has_unfinished():
        for o in eng.step():
            assert o.error is None, f"request {o.request_id}: {o.error}"
            if o.logits is not None:
                logits[o.request_id].append(o.logits.cpu())
    return [eng.pop_finished(i).output for i in ids], [logits[i] for i in ids]


@pytest.mark.parametrize("case", ["mac", "full"])
@pytest.mark.parametrize("budget", [7, 20, None])
def test_pieces_equal_the_fused_forward(case, budget):
    """Calls of 1 .. 48 tokens (chunks beside decodes, several requests packed, whole prompts over the largest
    bucket run eagerly) through padded buckets of 8 / 24 / 48: the same tokens, logits to fp64 rounding."""
    ps = prompts(4, seed=31, lo=20, hi=60)
    want_tokens, want_logits = _run(_engine(case, budget), ps)
    eng = _engine(case, budget, graphs="eager-pieces")
    got_tokens, got_logits = _run(eng, ps)
    assert got_tokens == want_tokens
    for a, b in zip(want_logits, got_logits):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            torch.testing.assert_close(y, x, rtol=1e-9, atol=1e-9)
    assert eng.executor.prefill_graphs.buckets, "no call went through the pieces"


def test_a_call_picks_the_smallest_bucket_that_holds_it():
    eng = _engine("full", None, graphs="eager-pieces")
    g = eng.executor.prefill_graphs
    assert [g.bucket_size(n) for n in (1, 8, 9, 24, 25, 48, 49)] == [8, 8, 24, 24, 48, 48, None]
    assert g.max_tokens == 48


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", ["mac", "full"])
@pytest.mark.parametrize("budget", [40, None])
def test_captured_pieces_equal_eager_on_cuda(case, budget):
    """bf16 on CUDA: the engine with its captured prefill graphs (default buckets: every call here pads to
    256) against the same engine with the plain fused prefill — the same tokens, logits within bf16 rounding."""
    ps = prompts(4, seed=32, lo=20, hi=60)
    eager = _engine(case, budget, device="cuda", dtype=torch.bfloat16, use_cuda_graphs=True, graphs="off")
    want_tokens, want_logits = _run(eager, ps)
    graphed = _engine(case, budget, device="cuda", dtype=torch.bfloat16, use_cuda_graphs=True, graphs="default")
    assert graphed.executor.prefill_graphs is not None
    got_tokens, got_logits = _run(graphed, ps)
    assert graphed.executor.prefill_graphs.buckets[256].graphs
    for a, b in zip(want_logits, got_logits):
        for x, y in zip(a, b):
            assert torch.isfinite(y).all()
            torch.testing.assert_close(y.float(), x.float(), rtol=0.05, atol=0.05)
    assert got_tokens == want_tokens


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_prewarm_captures_every_bucket_before_any_request():
    from macattn.runtime.prefill_graphs import PREFILL_GRAPH_BUCKETS, graph_buckets

    eng = _engine("mac", None, device="cuda", dtype=torch.bfloat16, use_cuda_graphs=True, graphs="default")
    done = eng.executor.prewarm_graphs()
    assert done["prefill"] == list(graph_buckets(3)) and done["decode"]
    assert set(PREFILL_GRAPH_BUCKETS) < set(done["prefill"]) and 1024 + 3 in done["prefill"]
    from macattn.core.ragged import continued_cudnn_shapes
    from macattn.runtime.config import quantized_chunk

    cfg, q = eng.executor.config, eng.executor.chunk_quantum
    want = continued_cudnn_shapes({quantized_chunk(cfg.max_num_batched_tokens - 1, q),
                                   quantized_chunk(cfg.max_prefill_tokens, q)}, cfg.max_seq_len)
    assert done["cudnn_plans"] == [f"{a}x{b}" for a, b in want]
    assert all(len(b.graphs) == len(eng.executor.fused.layers) + 1 for b in eng.executor.prefill_graphs.buckets.values())
