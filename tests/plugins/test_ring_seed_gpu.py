"""The ring-seeding launcher (``macattn.plugins.ring_seed.op.seed_rows_``) equals its reference bit for bit on fresh
random inputs laid out as the packed prefill lays them out (token-major ``q_pre``, a transposed ``o``, a strided
``lse``), across prompt lengths around the window (``L = 1, K - 1, K, 2K + 3``), d = 64 / 128, bf16 / fp16 query
rings, fp32 / bf16 / fp16 summary rings, an int slot, a ``[1]`` slot tensor and several rows: every other slot's
rows, poisoned (NaN, ``-7``) first, stay untouched and the seeded rows hold no poison. Also: no host
synchronisation, CUDA-graph replay. GPU; ``MACATTN_TRITON_INTERPRET=1`` runs them through Triton's interpreter on
the CPU (``test_ring_seed_interp.py`` does, in CI).

The interpreter rounds fp32 -> bf16 its own way (it truncates), so there a bf16 summary ring filled from fp32
summaries is held to one bf16 unit in the last place; on the GPU every ring is compared bit for bit.
"""
from __future__ import annotations

import pytest
import torch

from triton_env import DEVICE, GPU_MARKS, INTERPRET  # noqa: E402  (first: sets the interpreter switch)
from macattn.plugins.ring_seed.reference import seed_rows_reference  # noqa: E402

pytestmark = GPU_MARKS
POISON_POS = -7
S = 6


def _rings(Hq, K, d, q_dtype, o_dtype):
    """Rings of ``S`` slots, every element poisoned."""
    return [torch.full((S, Hq, K, d), float("nan"), dtype=q_dtype, device=DEVICE),
            torch.full((S, Hq, K, d), float("nan"), dtype=o_dtype, device=DEVICE),
            torch.full((S, Hq, K), float("nan"), dtype=torch.float32, device=DEVICE),
            torch.full((S, K), POISON_POS, dtype=torch.int64, device=DEVICE)]


def _inputs(B, Hq, L, K, d, q_dtype, summary_dtype, seed):
    """``q_pre [B, Hq, L, d]`` a token-major view (NaN before the last ``n`` positions, which no column keeps),
    ``o [B, Hq, n, d]`` a transposed one, ``lse [B, Hq, n]`` a strided slice; the first summaries empty
    (``o = 0, lse = -inf``: a far part before the band)."""
    g = torch.Generator().manual_seed(seed)
    n = min(K, L)
    q_pre = torch.randn(B, L, Hq, d, generator=g).to(DEVICE, q_dtype).transpose(1, 2)
    o = torch.randn(B, n, Hq, d, generator=g).to(DEVICE, summary_dtype).transpose(1, 2)
    lse = (5 * torch.randn(B, Hq, 2 * n, generator=g)).to(DEVICE)[:, :, ::2]
    q_pre[:, :, : L - n] = float("nan")
    empty = min(n, 3)
    o[:, :, :empty] = 0.0
    lse[:, :, :empty] = float("-inf")
    return q_pre, o, lse


def _assert_rings_equal(got, want, slots):
    for i, (a, b) in enumerate(zip(got, want)):
        loose = INTERPRET and a.dtype == torch.bfloat16 and i == 1      # oring: from fp32 summaries
        tol = dict(rtol=2 ** -7, atol=0) if loose else dict(rtol=0, atol=0)
        torch.testing.assert_close(a, b, equal_nan=True, **tol)
    q, o, lse, pos = got
    for s in slots:
        assert not q[s].isnan().any() and not o[s].isnan().any() and not lse[s].isnan().any()
        assert (pos[s] != POISON_POS).all()
    untouched = [s for s in range(S) if s not in slots]
    assert q[untouched].isnan().all() and lse[untouched].isnan().all() and (pos[untouched] == POISON_POS).all()


K_SMALL = 16
LENGTHS = (1, K_SMALL - 1, K_SMALL, 2 * K_SMALL + 3)


@pytest.mark.parametrize("L", LENGTHS)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("q_dtype,o_dtype", [(torch.bfloat16, torch.float32), (torch.float16, torch.float32),
                                             (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16)])
@pytest.mark.parametrize("slot_kind", ["int", "tensor"])
def test_one_row_equals_the_reference(L, d, q_dtype, o_dtype, slot_kind):
    from macattn.plugins.ring_seed.op import seed_rows_

    Hq, K = 4, K_SMALL
    q_pre, o, lse = _inputs(1, Hq, L, K, d, q_dtype, torch.float32, seed=L * 7 + d)
    slot = 4 if slot_kind == "int" else torch.tensor([4], device=DEVICE)
    got, want = _rings(Hq, K, d, q_dtype, o_dtype), _rings(Hq, K, d, q_dtype, o_dtype)
    seed_rows_(*got, slot, q_pre, o, lse)
    seed_rows_reference(*want, slot, q_pre, o, lse)
    _assert_rings_equal(got, want, [4])


@pytest.mark.parametrize("L,K", [(1, 1024), (1023, 1024), (1024, 1024), (2051, 1024), (700, 100)])
@pytest.mark.parametrize("summary_dtype", [torch.float32, torch.bfloat16])
def test_8b_shapes_equal_the_reference(L, K, summary_dtype):
    """8B shapes (32 query heads, d = 128, the default window) with bf16 query rings and fp32 summary rings; the
    summaries fp32 (the fused seeding's) or bf16; a batch of two rows."""
    from macattn.plugins.ring_seed.op import seed_rows_

    Hq, d = 32, 128
    q_pre, o, lse = _inputs(2, Hq, L, K, d, torch.bfloat16, summary_dtype, seed=L + K)
    slots = torch.tensor([5, 1], device=DEVICE)
    got, want = _rings(Hq, K, d, torch.bfloat16, torch.float32), _rings(Hq, K, d, torch.bfloat16, torch.float32)
    seed_rows_(*got, slots, q_pre, o, lse)
    seed_rows_reference(*want, slots, q_pre, o, lse)
    _assert_rings_equal(got, want, [5, 1])


@pytest.mark.skipif(INTERPRET, reason="host synchronisation and CUDA graphs are the GPU's")
def test_no_host_synchronisation():
    from macattn.plugins.ring_seed.op import seed_rows_

    q_pre, o, lse = _inputs(1, 8, 40, 16, 64, torch.bfloat16, torch.float32, seed=1)
    rings = _rings(8, 16, 64, torch.bfloat16, torch.float32)
    slot = torch.tensor([2], device=DEVICE)
    seed_rows_(*rings, slot, q_pre, o, lse)          # compiled before the check
    seed_rows_(*rings, 3, q_pre, o, lse)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        seed_rows_(*rings, slot, q_pre, o, lse)
        seed_rows_(*rings, 3, q_pre, o, lse)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.skipif(INTERPRET, reason="host synchronisation and CUDA graphs are the GPU's")
def test_cuda_graph_replay_follows_the_slot_and_the_inputs():
    from macattn.plugins.ring_seed.op import seed_rows_

    Hq, K, d, L = 8, 16, 64, 21
    q_pre, o, lse = _inputs(1, Hq, L, K, d, torch.bfloat16, torch.float32, seed=2)
    rings = _rings(Hq, K, d, torch.bfloat16, torch.float32)
    slot = torch.tensor([0], device=DEVICE)
    seed_rows_(*rings, slot, q_pre, o, lse)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        seed_rows_(*rings, slot, q_pre, o, lse)
    fresh = _inputs(1, Hq, L, K, d, torch.bfloat16, torch.float32, seed=3)
    for t, new in zip((q_pre, o, lse), fresh):
        t.copy_(new)
    slot.fill_(3)
    graph.replay()
    want = [t.clone() for t in rings]
    seed_rows_reference(*want, 3, *fresh)
    _assert_rings_equal(rings, want, [0, 3])
