"""Triton ``macattn::route_fused_attention`` against the fp64 reference (``macattn.methods.mka.reference``).

``@pytest.mark.gpu``, skipped without CUDA or triton; ``MACATTN_TRITON_INTERPRET=1`` runs the
same tests through Triton's interpreter on CPU tensors. Inputs are fresh random draws, outputs
NaN-poisoned (the launcher's allocator is swapped for one that fills with NaN, scratch included),
state rows of other slots must stay untouched.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from triton_env import DEVICE, GPU_MARKS, INTERPRET  # noqa: E402  (first: sets the interpreter switch)
from macattn.methods.mka.reference import route_fused_decode_reference  # noqa: E402

pytestmark = GPU_MARKS

# (B, D, Dq, R, Nk, S); interpreter shapes stay tiny
SHAPES = [(1, 32, 32, 8, 16, 2), (3, 48, 64, 5, 24, 5), (2, 96, 96, 16, 40, 4), (9, 32, 16, 4, 12, 11)]
if not INTERPRET:
    SHAPES += [(8, 4096, 4096, 64, 1024, 16), (5, 896, 896, 64, 128, 8), (1, 256, 256, 64, 64, 2), (19, 1024, 1024, 64, 256, 24)]


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    from macattn.plugins.route_fused import op

    def nan_empty(*shape, dtype, device):
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    monkeypatch.setattr(op, "_alloc", nan_empty)


def _triton():
    from macattn.plugins.route_fused.op import route_fused_attention_triton
    return route_fused_attention_triton


def _problem(B, D, Dq, R, N, S, dtype, seed, gate, Nv=None):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    Nv = N if Nv is None else Nv
    x, q = r(B, D), r(B, Dq)
    w1, b1, w2, b2 = r(R, Dq) / Dq ** 0.5, r(R), r(3, R), r(3)
    wk, bk, wv, bv = r(N, D) / D ** 0.5, r(N), r(Nv, D) / D ** 0.5, r(Nv)
    mean = r(S, D)
    count = torch.randint(0, 50, (S,), generator=g)
    count[0] = 0    # a fresh slot
    slots = torch.randperm(S, generator=g)[:B]
    ins = dict(x=x.to(dtype), q=q.to(dtype), w1=w1.to(dtype), b1=b1.to(dtype), w2=w2.to(dtype), b2=b2.to(dtype),
               gate=torch.tensor(gate, dtype=dtype), wk=wk.to(dtype), bk=bk.to(dtype), wv=wv.to(dtype), bv=bv.to(dtype))
    return ins, mean, count, slots

def _reference(up: dict, mean: torch.Tensor, count: torch.Tensor, slots: torch.Tensor, mode: int, beta: float):
    """The fp64 reference of one decode step over ``up`` (``_problem``'s inputs in fp64): ``(k, v, lam)``; it
    advances ``mean`` / ``count`` in place as the op does."""
    return route_fused_decode_reference(up["x"], up["q"], up["w1"], up["b1"], up["w2"], up["b2"], up["gate"], mean, count,
                                        slots, up["wk"], up["bk"], up["wv"], up["bv"], mode, beta,
                                        compute_dtype=torch.float64)



def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("mode,beta", [(0, 0.0), (1, 0.9)])
@pytest.mark.parametrize("gate", [0.0, 0.6, 1.0])
def test_route_fused_matches_reference(shape, dtype, mode, beta, gate):
    B, D, Dq, R, N, S = shape
    ins, mean, count, slots = _problem(B, D, Dq, R, N, S, dtype, seed=hash((shape, mode, gate)) % 10_000, gate=gate)
    ref_mean, ref_count = mean.double(), count.clone()
    up = {k: v.double() for k, v in ins.items()}
    rk, rv, rlam = _reference(up, ref_mean, ref_count, slots, mode, beta)
    dev = {k: v.to(DEVICE) for k, v in ins.items()}
    d_mean, d_count, d_slots = mean.to(DEVICE), count.to(DEVICE), slots.to(DEVICE)
    k, v, lam = _triton()(dev["x"], dev["q"], dev["w1"], dev["b1"], dev["w2"], dev["b2"], dev["gate"], d_mean, d_count,
                          d_slots, dev["wk"], dev["bk"], dev["wv"], dev["bv"], mode, beta)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    for out in (k, v, lam):
        assert torch.isfinite(out).all()
    assert k.dtype == dtype and v.dtype == dtype and lam.dtype == torch.float32
    assert _rel(k.cpu(), rk) <= tol and _rel(v.cpu(), rv) <= tol
    assert (lam.cpu().double() - rlam).abs().max().item() <= 1e-5
    if gate == 0.0:
        assert torch.equal(lam.cpu(), torch.tensor([[1.0, 0.0, 0.0]]).expand(B, 3))
    assert torch.equal(d_count.cpu(), ref_count)
    assert _rel(d_mean.cpu(), ref_mean) <= 1e-5
    untouched = torch.ones(S, dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(d_mean.cpu()[untouched], mean[untouched])


# (B, D, Dq, R, Nk, Nv, S), launch: several row blocks, a split that leaves a partial s_block, R = 1 and
# R > 16, Dq > D and D > Dq, Nk != Nv (a block that straddles k and v), blocks larger than the problem
EDGES = [((33, 48, 80, 20, 40, 24, 40), dict(split=16, max_block_b=16, s_block=2, block_n=16, block_d=16)),
         ((5, 80, 24, 1, 8, 56, 7), dict(split=32, block_n=32, block_d=64, stages=2)),
         ((2, 16, 16, 3, 16, 16, 2), dict(split=64, block_n=64, block_d=128, s_block=16)),
         ((17, 64, 64, 8, 24, 40, 20), dict(split=16, max_block_b=16, s_block=4, block_n=16, block_d=32, warps=8))]
if not INTERPRET:
    EDGES += [((8, 4096, 4096, 64, 1024, 1024, 16), dict(split=256, block_n=32, block_d=128, stages=3)),   # no spills
              ((64, 1024, 1024, 64, 256, 256, 70), dict(split=64, max_block_b=64, block_n=16, block_d=64, stages=2, warps=8))]


@pytest.mark.parametrize("shape,launch", EDGES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_route_fused_launch_configs_and_edge_shapes(shape, launch, dtype):
    """Fresh inputs, NaN-poisoned outputs and scratch, per launch configuration: every element written, = the
    fp64 reference; the plan's two launches one by one = the op; a second call on the same state = the first
    bit for bit (the fixed-order reductions)."""
    from macattn.plugins.route_fused.op import RouteFusedLaunch, RouteFusedPlan

    B, D, Dq, R, Nk, Nv, S = shape
    ins, mean, count, slots = _problem(B, D, Dq, R, Nk, S, dtype, seed=sum(shape), gate=0.8, Nv=Nv)
    up = {k: v.double() for k, v in ins.items()}
    ref_mean, ref_count = mean.double(), count.clone()
    rk, rv, rlam = _reference(up, ref_mean, ref_count, slots, 0, 0.0)
    dev = {k: v.to(DEVICE) for k, v in ins.items()}
    outs, states = [], []
    for split_launches in (False, True):
        d_mean, d_count = mean.to(DEVICE, copy=True), count.to(DEVICE, copy=True)
        plan = RouteFusedPlan(dev["x"], dev["q"], dev["w1"], dev["b1"], dev["w2"], dev["b2"], dev["gate"], d_mean,
                              d_count, slots.to(DEVICE), dev["wk"], dev["bk"], dev["wv"], dev["bv"], 0, 0.0,
                              launch=RouteFusedLaunch(**launch))
        if split_launches:
            plan.route_update()
            plan.fuse_project()
            got = (plan.k, plan.v, plan.lam)
        else:
            got = plan.run()
        outs.append([t.cpu() for t in got])
        states.append((d_mean.cpu(), d_count.cpu()))
    k, v, lam = outs[0]
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    assert k.shape == (B, Nk) and v.shape == (B, Nv)
    for out in (k, v, lam):
        assert torch.isfinite(out).all()
    assert _rel(k, rk) <= tol and _rel(v, rv) <= tol
    assert (lam.double() - rlam).abs().max().item() <= 1e-5
    assert torch.equal(states[0][1], ref_count)
    assert _rel(states[0][0], ref_mean) <= 1e-5
    untouched = torch.ones(S, dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(states[0][0][untouched], mean[untouched])
    for a, b in zip(outs[0] + list(states[0]), outs[1] + list(states[1])):
        assert torch.equal(a, b)


def test_route_fused_empty_batch():
    ins, mean, count, _ = _problem(1, 32, 32, 4, 16, 3, torch.float32, seed=2, gate=0.5)
    ins = {k: (v[:0] if k in ("x", "q") else v).to(DEVICE) for k, v in ins.items()}
    d_mean, d_count = mean.to(DEVICE), count.to(DEVICE)
    k, v, lam = _triton()(ins["x"], ins["q"], ins["w1"], ins["b1"], ins["w2"], ins["b2"], ins["gate"], d_mean, d_count,
                          torch.zeros(0, dtype=torch.int64, device=DEVICE), ins["wk"], ins["bk"], ins["wv"], ins["bv"],
                          0, 0.0)
    assert k.shape == (0, 16) and v.shape == (0, 16) and lam.shape == (0, 3)
    assert torch.equal(d_mean.cpu(), mean) and torch.equal(d_count.cpu(), count)


def test_route_fused_mixed_dtypes_fp32_router_bf16_activations():
    """The patched model's case: fp32 router weights and gate, bf16 activations and K/V weights."""
    ins, mean, count, slots = _problem(4, 64, 48, 8, 24, 6, torch.bfloat16, seed=11, gate=0.7)
    for name in ("w1", "b1", "w2", "b2", "gate"):
        ins[name] = ins[name].float()
    up = {k: v.double() for k, v in ins.items()}
    ref_mean, ref_count = mean.double(), count.clone()
    rk, rv, rlam = _reference(up, ref_mean, ref_count, slots, 0, 0.0)
    dev = {k: v.to(DEVICE) for k, v in ins.items()}
    d_mean, d_count = mean.to(DEVICE), count.to(DEVICE)
    k, v, lam = _triton()(dev["x"], dev["q"], dev["w1"], dev["b1"], dev["w2"], dev["b2"], dev["gate"], d_mean, d_count,
                          slots.to(DEVICE), dev["wk"], dev["bk"], dev["wv"], dev["bv"], 0, 0.0)
    assert k.dtype == torch.bfloat16
    assert _rel(k.cpu(), rk) <= 1e-2 and _rel(v.cpu(), rv) <= 1e-2
    assert (lam.cpu().double() - rlam).abs().max().item() <= 1e-5
    assert torch.equal(d_count.cpu(), ref_count)


def test_route_fused_op_dispatches_to_triton():
    if INTERPRET:
        pytest.skip("dispatch to the CUDA kernel needs a CUDA device")
    from macattn.methods.kernels import register_kernels
    assert "macattn::route_fused_attention" in register_kernels()
    ins, mean, count, slots = _problem(2, 64, 64, 8, 32, 3, torch.bfloat16, seed=3, gate=0.5)
    dev = {k: v.cuda() for k, v in ins.items()}
    m1, c1 = mean.cuda(), count.cuda()
    m2, c2 = mean.cuda(), count.cuda()
    args = lambda m, c: (dev["x"], dev["q"], dev["w1"], dev["b1"], dev["w2"], dev["b2"], dev["gate"], m, c,  # noqa: E731
                         slots.cuda(), dev["wk"], dev["bk"], dev["wv"], dev["bv"], 0, 0.0)
    a = torch.ops.macattn.route_fused_attention(*args(m1, c1))
    b = _triton()(*args(m2, c2))
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    assert torch.equal(m1, m2) and torch.equal(c1, c2)


def test_route_fused_cuda_graph_replay_carries_state():
    if INTERPRET:
        pytest.skip("CUDA graphs need a CUDA device")
    ins, mean, count, slots = _problem(4, 128, 128, 16, 64, 6, torch.bfloat16, seed=5, gate=0.7)
    dev = {k: v.cuda() for k, v in ins.items()}
    d_mean, d_count, d_slots = mean.cuda(), count.cuda(), slots.cuda()
    call = lambda: _triton()(dev["x"], dev["q"], dev["w1"], dev["b1"], dev["w2"], dev["b2"], dev["gate"],  # noqa: E731
                             d_mean, d_count, d_slots, dev["wk"], dev["bk"], dev["wv"], dev["bv"], 1, 0.8)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        call()   # warm-up compiles (and is one step of state)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = call()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    ref_mean, ref_count = mean.double(), count.clone()
    up = {k: v.double() for k, v in ins.items()}
    for _ in range(4):   # the warm-up and the 3 replays each advance the state once (capture only records)
        rk, rv, _ = _reference(up, ref_mean, ref_count, slots, 1, 0.8)
    assert torch.equal(d_count.cpu(), ref_count)
    assert _rel(d_mean.cpu(), ref_mean) <= 1e-5
    assert _rel(outs[0].cpu(), rk) <= 1e-2


def test_route_fused_fp32_dots_take_capped_constants():
    """fp32 weights (and an fp32 router against bf16 queries) run their dots in IEEE fp32; on the GPU the
    launcher caps the constants there (``F32_CAPS``: the uncapped tiles spill or overflow shared memory), and the
    outputs stay the reference's. The interpreter runs every dot in fp32, uncapped."""
    from macattn.plugins.route_fused.op import F32_CAPS, RouteFusedLaunch, RouteFusedPlan

    big = RouteFusedLaunch(split=256, block_n=64, block_d=256, stages=3, warps=8)   # compiles for bf16 (64 KiB smem)
    for dtype, router in ((torch.float32, torch.float32), (torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16)):
        ins, mean, count, slots = _problem(3, 256, 256, 16, 64, 4, dtype, seed=21, gate=0.7)
        for name in ("w1", "b1", "w2", "b2", "gate"):
            ins[name] = ins[name].to(router)
        up = {k: v.double() for k, v in ins.items()}
        ref_mean, ref_count = mean.double(), count.clone()
        rk, _, rlam = _reference(up, ref_mean, ref_count, slots, 0, 0.0)
        dev = {k: v.to(DEVICE) for k, v in ins.items()}
        plan = RouteFusedPlan(dev["x"], dev["q"], dev["w1"], dev["b1"], dev["w2"], dev["b2"], dev["gate"],
                              mean.to(DEVICE, copy=True), count.to(DEVICE, copy=True), slots.to(DEVICE), dev["wk"],
                              dev["bk"], dev["wv"], dev["bv"], 0, 0.0, launch=big)
        k, _, lam = plan.run()
        want = dict(dataclasses.asdict(big))
        if not INTERPRET:
            if router != dtype or dtype == torch.float32:
                want["split"] = min(want["split"], F32_CAPS["route"]["split"])
            if dtype == torch.float32:
                want.update({n: min(want[n], c) for n, c in F32_CAPS["project"].items()})
        assert dataclasses.asdict(plan.launch) == want
        assert _rel(k.cpu(), rk) <= (1e-2 if dtype == torch.bfloat16 else 1e-5)
        assert (lam.cpu().double() - rlam).abs().max().item() <= 1e-5
