"""The Triton launchers as the TensorRT JIT impls use them: ``out=`` destinations written in place
(the same values as a fresh allocation, every element written: destinations are NaN-poisoned),
wrong destinations named; attend-only ``MacDecodePlan`` (no tau) refusing the match stages; and
explicit, idempotent kernel registration (``macattn.methods.kernels.register_kernels``).

``@pytest.mark.gpu``, skipped without CUDA or triton; ``MACATTN_TRITON_INTERPRET=1`` runs them
through Triton's interpreter on CPU tensors.
"""
from __future__ import annotations

import pytest
import torch

from triton_env import DEVICE, GPU_MARKS, INTERPRET  # noqa: E402  (first: sets the interpreter switch)
from mac_problem import BF16, Problem, _all, _mixed_kinds, _poison  # noqa: E402

pytestmark = GPU_MARKS
F32, I64 = torch.float32, torch.int64


def _problem(seed: int = 3) -> Problem:
    g = torch.Generator().manual_seed(seed)
    B, Hq, Hkv, d = 3, 4, 2, 16
    return Problem(B=B, Hq=Hq, Hkv=Hkv, d=d, K=32, band=8, tau=0.45, positions=[40, 71, 9],
                   kinds=_mixed_kinds(B, Hq, Hkv, g), gen=g).to(DEVICE)


def _poisoned_like(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(_poison(*t.shape, dtype=t.dtype, device=t.device) for t in tensors)


def _same_into_out(launch, args, state=()):
    """``launch(*args)`` and ``launch(*args, out=poisoned)`` from the same ``state`` (tensors the
    launcher updates in place, restored between the calls): the results are equal and the second
    is the given ``out``."""
    saved = [t.clone() for t in state]
    fresh = launch(*args)
    for t, s in zip(state, saved):
        t.copy_(s)
    single = torch.is_tensor(fresh)
    out = _poisoned_like(*((fresh,) if single else fresh))
    got = launch(*args, out=out[0] if single else out)
    got, fresh = ((got,), (fresh,)) if single else (got, fresh)
    for g, o, f in zip(got, out, fresh):
        assert g is o
        assert torch.equal(g, f)


def test_match_launcher_writes_out():
    from macattn.plugins.mac.match_op import MacMatchLauncher

    pr = _problem()
    launch = MacMatchLauncher()
    args = (pr.q_pre, pr.qring, pr.ring_lse, pr.ring_pos, pr.slots, pr.positions, pr.band, pr.tau)
    _same_into_out(launch, args)
    mp, dist = launch(*args)
    bad = (torch.empty(pr.B, pr.Hq, dtype=torch.int32, device=DEVICE), dist)
    with pytest.raises(ValueError, match=r"out\[0\] \(match_pos\) must be a contiguous torch.int64"):
        launch(*args, out=bad)
    with pytest.raises(ValueError, match=r"out\[1\] \(dist\)"):
        launch(*args, out=(mp, torch.empty(pr.Hq, pr.B, dtype=F32, device=DEVICE).t()))


def test_attend_launcher_writes_out_and_rings():
    from macattn.plugins.mac.attend_op import MacAttendLauncher
    from macattn.plugins.mac.match_op import MacMatchLauncher

    pr = _problem(5)
    match_pos, _ = MacMatchLauncher()(pr.q_pre, pr.qring, pr.ring_lse, pr.ring_pos, pr.slots, pr.positions, pr.band,
                                      pr.tau)
    rings = pr.rings()
    args = (pr.q, pr.q_pre, pr.k, pr.v, pr.positions, match_pos, pr.slots, *rings, pr.band, pr.scale)
    launch = MacAttendLauncher()
    _same_into_out(launch, args, state=rings)
    with pytest.raises(ValueError, match="out must be a contiguous torch.bfloat16"):
        launch(*args, out=torch.empty(pr.B, pr.Hq, pr.d, dtype=F32, device=DEVICE))
    # one attend-only plan per shape bucket, reused
    assert len(launch._plans) == 1 and next(iter(launch._plans.values())).tau is None


def test_attend_only_plan_refuses_the_match_stages():
    from macattn.plugins.mac.decode_plan import MacDecodePlan

    pr = Problem(B=2, Hq=4, Hkv=2, d=16, K=32, band=8, tau=0.45, positions=[40, 71], kinds=_all("miss", 2, 4),
                 gen=torch.Generator().manual_seed(1)).to(DEVICE)
    plan = MacDecodePlan(batch_size=2, max_context=pr.T, num_q_heads=4, num_kv_heads=2, head_dim=16, window=32,
                         band=8, q_dtype=BF16, device=DEVICE)
    assert plan.tau is None and plan.thr is None
    with pytest.raises(ValueError, match="made without tau"):
        plan.run(pr.q, pr.q_pre, pr.k, pr.v, pr.positions, pr.slots, *pr.rings())
    with pytest.raises(ValueError, match="made without tau"):
        plan.run_match(pr.q_pre, pr.qring, pr.ring_pos, pr.ring_lse, pr.slots, pr.positions)
    with pytest.raises(ValueError, match="made without tau"):
        plan.run_plan(pr.positions)
    with pytest.raises(TypeError, match="window must be an int >= 1"):
        MacDecodePlan(batch_size=2, max_context=8, num_q_heads=4, num_kv_heads=2, head_dim=16, window=2.0, band=8,
                      device=DEVICE)


def test_route_fused_launcher_writes_out():
    from macattn.plugins.route_fused.op import route_fused_attention_triton

    g = torch.Generator().manual_seed(7)
    B, D, Dq, R, N, S = 3, 32, 16, 4, 12, 5
    r = lambda *s: torch.randn(*s, generator=g).to(DEVICE)  # noqa: E731
    mean, count = r(S, D), torch.randint(0, 9, (S,), generator=g).to(DEVICE)
    args = (r(B, D), r(B, Dq), r(R, Dq), r(R), r(3, R), r(3), torch.tensor(0.6, device=DEVICE), mean, count,
            torch.tensor([4, 0, 2], device=DEVICE), r(N, D), r(N), r(N, D), r(N), 1, 0.9)
    _same_into_out(route_fused_attention_triton, args, state=(mean, count))
    k, v, lam = route_fused_attention_triton(*args)
    with pytest.raises(ValueError, match=r"out\[2\] \(lam\)"):
        route_fused_attention_triton(*args, out=(k, v, torch.empty(B, 2, device=DEVICE)))


def test_retrieval_completion_launchers_write_out():
    from macattn.plugins.retrieval_completion.op import completion_cache_triton, retrieval_completion_triton

    g = torch.Generator().manual_seed(9)
    B, Hq, Hkv, d, F, T = 2, 4, 2, 16, 8, 40
    r = lambda *s: torch.randn(*s, generator=g).to(DEVICE)  # noqa: E731
    q, k, v, lpq, lpk = r(B, Hq, d), r(B, Hkv, T, d), r(B, Hkv, T, d), r(B, Hq, F), r(B, Hkv, T, F)
    npf, sl = torch.tensor([30, 12], device=DEVICE), torch.tensor([36, 20], device=DEVICE)
    _same_into_out(completion_cache_triton, (lpk, v, npf, 2, 4))
    comp = completion_cache_triton(lpk, v, npf, 2, 4)
    _same_into_out(retrieval_completion_triton, (q, k, v, sl, npf, lpq, lpk, *comp, 2, 4, 5, 0.0))
    with pytest.raises(ValueError, match="out must be a contiguous torch.float32 tensor of shape"):
        retrieval_completion_triton(q, k, v, sl, npf, lpq, lpk, *comp, 2, 4, 5, 0.0, out=torch.empty(B, Hq, d + 1))


def test_register_kernels_is_explicit_and_idempotent():
    from macattn.methods import kernels
    from macattn.methods.completion.ops import register_cuda_kernels as completion
    from macattn.methods.mac.ops import register_cuda_kernels as mac
    from macattn.methods.mka.ops import register_cuda_kernels as mka

    names = kernels.register_kernels()
    assert names == ("macattn::mac_match", "macattn::mac_attend", "macattn::route_fused_attention",
                     "macattn::completion_cache", "macattn::retrieval_completion", "macattn::page_retrieval_completion")
    launchers = kernels.registered_kernels()
    assert set(launchers) == set(names)
    # again: the same names, nothing registered twice (the same launcher instances)
    assert kernels.register_kernels() == names
    assert mac() + mka() + completion() == names
    assert all(kernels.registered_kernels()[n] is launchers[n] for n in names)
    from macattn.plugins.mac.attend_op import MacAttendLauncher
    from macattn.plugins.mac.match_op import MacMatchLauncher
    assert isinstance(launchers["macattn::mac_match"], MacMatchLauncher)
    assert isinstance(launchers["macattn::mac_attend"], MacAttendLauncher)
    if not INTERPRET:   # CUDA tensors now dispatch to the registered launcher
        pr = _problem(11)
        mp, dist = torch.ops.macattn.mac_match(pr.q_pre, pr.qring, pr.ring_lse, pr.ring_pos, pr.slots, pr.positions,
                                               pr.band, pr.tau)
        want = launchers["macattn::mac_match"](pr.q_pre, pr.qring, pr.ring_lse, pr.ring_pos, pr.slots,
                                               pr.positions, pr.band, pr.tau)
        assert torch.equal(mp, want[0]) and torch.equal(dist, want[1])
