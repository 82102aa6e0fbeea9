"""A fresh segment's split (``seeding.fresh_split_attention``: the ring's tail through ``band_split_attention``, the
rest as its own causal segment, the far part seeding the ring) on the CPU, in fp64 with plain-torch stand-ins for the
flash kernels (``_fresh_split.use_stand_in_kernels``): a packed MAC layer's output equals the definition and the
unsplit path's, its rings equal the unsplit path's bit for bit, at the edges where it splits or falls back; a split one
position off fails these checks. The same cases run on CUDA in bf16 in ``test_seeding_gpu.py``."""
from __future__ import annotations

import pytest
import torch

from macattn.core.ragged import PrefillSegment, RaggedPrefill, ragged_attention_reference
from macattn.methods.mac import backend, seeding
from macattn.methods.mac.seeding import fresh_split_attention, seeded_ring_rows

from _fresh_split import MUTATIONS, assert_same_rings, cases, mutant, packed_call, row_error, run_both, \
    use_stand_in_kernels

K, B = 16, 4
CASES = cases(K, B)


def _definition(p):
    """``ragged_attention_reference`` of the call (every segment's keys: its pool history, then its own rows)."""
    ks, vs = zip(*(p.plan.segment_kv(0, i, p.key, p.value) for i in range(len(p.plan.segments))))
    return ragged_attention_reference(p.query, ks, vs, [s.length for s in p.plan.segments], 0.25)


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("Hq,Hkv", [(4, 2), (4, 4)])
def test_a_packed_layer_splits_fresh_segments_and_equals_the_unsplit_path(name, Hq, Hkv, monkeypatch):
    use_stand_in_kernels(monkeypatch)
    segs, want = CASES[name]
    p = packed_call(segs, Hq=Hq, Hkv=Hkv, d=16, dtype=torch.float64, device="cpu", seed=len(name) + Hkv)
    (out, rings, taken), (old_out, old_rings) = run_both(monkeypatch, p, window=K, band=B)
    assert taken == want
    assert row_error(out, _definition(p)) < 1e-6         # band_split_attention merges in fp32
    assert row_error(out, old_out) < 1e-6
    assert_same_rings(rings, old_rings, p)


@pytest.mark.parametrize("mutation", MUTATIONS)
def test_a_split_one_position_off_is_caught(mutation, monkeypatch):
    """The checks above fail for each deliberate off-by-one of the split (``_fresh_split.MUTATIONS``)."""
    use_stand_in_kernels(monkeypatch)
    segs, _ = CASES["mixed"]
    p = packed_call(segs, Hq=4, Hkv=2, d=16, dtype=torch.float64, device="cpu", seed=5)
    monkeypatch.setattr(backend, "fresh_split_attention", mutant(mutation))
    with pytest.raises(AssertionError):
        (out, rings, _), (old_out, old_rings) = run_both(monkeypatch, p, window=K, band=B)
        assert row_error(out, old_out) < 1e-6
        assert_same_rings(rings, old_rings, p)


def test_the_split_falls_back_where_it_does_not_apply(monkeypatch):
    q = torch.zeros(1, 4, K + B, 16, dtype=torch.float64)
    k = torch.zeros(1, 2, K + B, 16, dtype=torch.float64)
    assert fresh_split_attention(q, k, k, window=K, band=B, scale=0.25) is None       # the CPU: no fused path
    use_stand_in_kernels(monkeypatch)
    assert fresh_split_attention(q, k, k, window=K, band=B, scale=0.25) is not None
    assert fresh_split_attention(q, k, k, window=K, band=B + 1, scale=0.25) is None   # L - n < band
    assert fresh_split_attention(q, k, k, window=K + B, band=B, scale=0.25) is None   # n == L
    assert fresh_split_attention(q, k, k, window=K, band=0, scale=0.25) is None       # no band: no far part
    monkeypatch.setattr(seeding, "_WINDOW_OK", {torch.device("cpu"): False})
    assert fresh_split_attention(q, k, k, window=K, band=B, scale=0.25) is None       # flash without a window


def test_the_split_parts_and_far_part_in_shapes_and_order(monkeypatch):
    """``((head [1, Hq, L - n, d], tail [1, Hq, n, d]), far)``: the head's rows are the first queries' causal
    attention, the far part the ``tail_summaries`` that ``seeded_ring_rows`` makes; a summary of another length is
    refused."""
    use_stand_in_kernels(monkeypatch)
    g = torch.Generator().manual_seed(0)
    L = 3 * K
    q, qp = torch.randn(1, 4, L, 16, generator=g).double(), torch.randn(1, 4, L, 16, generator=g).double()
    k, v = torch.randn(1, 2, L, 16, generator=g).double(), torch.randn(1, 2, L, 16, generator=g).double()
    (head, tail), far = fresh_split_attention(q, k, v, window=K, band=B, scale=0.25)
    assert head.shape == (1, 4, L - K, 16) and tail.shape == (1, 4, K, 16) and far.o.shape == (1, 4, K, 16)
    ref = ragged_attention_reference(q, [k], [v], [L], 0.25)
    torch.testing.assert_close(head.transpose(1, 2), ref[:, : L - K], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(tail.transpose(1, 2), ref[:, L - K:], rtol=1e-6, atol=1e-6)
    rows = seeded_ring_rows(q, qp, k, v, window=K, band=B, scale=0.25, summary=far)
    for a, b in zip(rows, seeded_ring_rows(q, qp, k, v, window=K, band=B, scale=0.25)):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="summary must cover the last 16 positions"):
        short = type(far)(far.o[:, :, 1:], far.lse[:, :, 1:])
        seeded_ring_rows(q, qp, k, v, window=K, band=B, scale=0.25, summary=short)


def test_the_plan_joins_a_segments_parts_in_one_concatenation():
    """``segment_attention`` may return consecutive query rows' parts: the plan's output equals the whole
    segment's, every other segment's in place."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 9, 8, generator=g).double() for _ in range(3))
    plan = RaggedPrefill([PrefillSegment(0, 5, 0, 0), PrefillSegment(5, 4, 0, 1)], [None], [None])
    whole = plan.attend(0, q, k, v, 0.3)
    split = plan.attend(0, q, k, v, 0.3, segment_attention=lambda i, q, k, v: (
        (whole[:, :2].transpose(1, 2), whole[:, 2:5].transpose(1, 2)) if i == 0 else None))
    assert torch.equal(split, whole)
