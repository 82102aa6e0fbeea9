"""The offloaded retrieval-completion decode with its kernels (``macattn.methods.completion.offload`` with
``use_kernels``: the page selector, the device LRU, the page gather reading pinned host memory, the shared
split-K tail) against the same decode on the CPU with the torch gather and the fp64 tail; the gather kernel
against its torch twin; on the GPU, a whole step (every layer, prefetch on its copy stream) captured in a
CUDA graph and replayed = the eager step.

``@pytest.mark.gpu``; ``MACATTN_TRITON_INTERPRET=1`` runs the kernel tests through Triton's interpreter on
CPU tensors (``test_offload_interp.py``; the graph test needs CUDA). Poisoned outputs: the hot-page cache
starts NaN, so a row the tail reads without a fetch having written it shows.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from triton_env import DEVICE, GPU_MARKS, INTERPRET  # noqa: E402  (first: sets the interpreter switch)

sys.path.insert(0, str(Path(__file__).parents[1] / "methods" / "completion"))
from offload_case import admit, make_problem, step_inputs  # noqa: E402

pytestmark = GPU_MARKS


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


@pytest.mark.parametrize("W,dtype", [(16, torch.bfloat16), (24, torch.float32)])
def test_gather_pages_kernel_equals_torch(W, dtype):
    from macattn.plugins.page_fetch.op import gather_pages, gather_pages_torch

    g = torch.Generator().manual_seed(W)
    S, H, P, page, C, K = 3, 2, 11, 8, 6, 4
    src = torch.randn(S, 3, H, P, page, W, generator=g).to(dtype)[:, 1]        # one layer of [S, L, ...]: strided
    if DEVICE == "cuda":
        src = src.pin_memory()
    pages = torch.stack([torch.stack([torch.randperm(P, generator=g)[:K] for _ in range(H)]) for _ in range(S)])
    slots = torch.stack([torch.stack([torch.randperm(C, generator=g)[:K] for _ in range(H)]) for _ in range(S)])
    miss = torch.rand(S, H, K, generator=g) < 0.6
    want = torch.full((S, H, C * page, W), float("nan"), dtype=dtype)
    gather_pages_torch(src.cpu(), want, pages, slots, miss)
    got = torch.full((S, H, C * page, W), float("nan"), dtype=dtype, device=DEVICE)
    gather_pages(src, got, pages.to(DEVICE), slots.to(DEVICE), miss.to(DEVICE), use_kernel=True)
    assert torch.equal(got.cpu().isnan(), want.isnan())          # untouched rows stay poisoned
    assert torch.equal(got.cpu().nan_to_num(7.0), want.nan_to_num(7.0))
    assert (~want.isnan()).sum() == int(miss.sum()) * page * W


def _poison_cache(st):
    for name in ("cache_k", "cache_v", "cache_lpk"):
        for t in getattr(st, name):
            t.fill_(float("nan"))


@pytest.mark.parametrize("hot,dtype", [(6, torch.float32), (3, torch.bfloat16)])
def test_offloaded_decode_with_kernels_equals_the_cpu_decode(hot, dtype):
    t = make_problem(hot=hot, dtype=dtype, seed=hot + 20, steps=3)
    ref, slots = admit(t, "cpu", use_kernels=False)
    st, _ = admit(t, DEVICE, use_kernels=True)
    _poison_cache(st)
    for step in range(t["steps"]):
        for layer in range(t["L"]):
            pos = torch.tensor([n + step for n in t["prompts"]])
            rows = torch.arange(len(slots))
            kk, vv = t["k"][layer][rows, :, pos], t["v"][layer][rows, :, pos]
            sl = torch.tensor(slots)
            ref.append(layer, sl, pos, kk, vv)
            st.append(layer, sl.to(DEVICE), pos.to(DEVICE), kk.to(DEVICE), vv.to(DEVICE))
            want = ref.decode(layer, *step_inputs(t, ref, slots, step, layer), 0.25)[sl]
            got = st.decode(layer, *step_inputs(t, st, slots, step, layer, DEVICE), 0.25)[sl.to(DEVICE)]
            assert not got.isnan().any()
            assert _rel(got.cpu(), want) < (2e-5 if dtype == torch.float32 else 8e-3), (step, layer)
    assert torch.equal(st.hits.cpu(), ref.hits) and torch.equal(st.misses.cpu(), ref.misses)


@pytest.mark.skipif(INTERPRET, reason="CUDA graphs and streams need a GPU")
@pytest.mark.parametrize("prefetch", ["none", "query"])
def test_offloaded_step_captured_in_a_cuda_graph_equals_eager(prefetch):
    from macattn.methods.completion.offload import OffloadConfig

    t = make_problem(hot=12, dtype=torch.bfloat16, seed=31, steps=3, L=3)
    off = OffloadConfig(hot_pages=12, max_generated=5, max_prefill=max(t["prompts"]), prefetch=prefetch)
    eager, slots = admit(t, "cuda", use_kernels=True, off=off)
    graphed, _ = admit(t, "cuda", use_kernels=True, off=off)
    assert eager.host_k.is_pinned() and (eager._copy_stream is not None) == (prefetch == "query")
    sl = torch.tensor(slots, device="cuda")
    rows = torch.arange(len(slots))

    def run(st, step, static):
        outs = []
        for layer in range(t["L"]):
            q_all, lpq_all, lens, npf = static[layer]
            pos = static["pos"]
            st.append(layer, sl, pos, static["k"][layer], static["v"][layer])
            outs.append(st.decode(layer, q_all, lpq_all, lens, npf, 0.25))
        return outs

    def inputs(step, st):
        pos = torch.tensor([n + step for n in t["prompts"]], device="cuda")
        d = {layer: step_inputs(t, st, slots, step, layer, "cuda") for layer in range(t["L"])}
        d["pos"] = pos
        d["k"] = [t["k"][layer][rows, :, pos.cpu()].cuda() for layer in range(t["L"])]
        d["v"] = [t["v"][layer][rows, :, pos.cpu()].cuda() for layer in range(t["L"])]
        return d

    for st in (eager, graphed):                   # step 0 eager on both (compiles the kernels)
        run(st, 0, inputs(0, st))
    static = inputs(1, graphed)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = run(graphed, 1, static)
    graph.replay()
    want = run(eager, 1, inputs(1, eager))
    torch.cuda.synchronize()
    for o, w in zip(outs, want):
        torch.testing.assert_close(o[sl], w[sl], rtol=0, atol=0)
    for name in ("hits", "misses", "prefetched", "clock"):
        assert torch.equal(getattr(graphed, name), getattr(eager, name)), name
    # the next step through the same graph: new inputs copied into the static tensors
    nxt = inputs(2, graphed)
    for layer in range(t["L"]):
        for a, b in zip(static[layer], nxt[layer]):
            a.copy_(b)
        static["k"][layer].copy_(nxt["k"][layer])
        static["v"][layer].copy_(nxt["v"][layer])
    static["pos"].copy_(nxt["pos"])
    graph.replay()
    want = run(eager, 2, inputs(2, eager))
    torch.cuda.synchronize()
    for o, w in zip(outs, want):
        torch.testing.assert_close(o[sl], w[sl], rtol=0, atol=0)
