"""MkaState: the FastMKA L2 session summary per layer and request slot (docs/spec.md §2)."""
import pytest
import torch

from macattn.methods.mka import ops as ops_mka  # noqa: F401
from macattn.methods.mka.state import MkaState
from macattn.runtime.slots import SlotStates


def _state(num_slots=3, **kw):
    return MkaState.allocate(**{"num_layers": 2, "num_slots": num_slots, "hidden_size": 8, **kw})


def _step(state, slots, seed, layer=0):
    """One route_fused_attention step of ``layer`` for ``slots`` (returns k)."""
    g = torch.Generator().manual_seed(seed)
    B, D, R, N = len(slots), 8, 4, 6
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    mean, count = state.layer(layer)
    k, _, _ = torch.ops.macattn.route_fused_attention(
        r(B, D), r(B, D), r(R, D), r(R), r(3, R), r(3), torch.tensor(0.9), mean, count,
        torch.tensor(slots, dtype=torch.int64), r(N, D), r(N), r(N, D), r(N), 0, 0.0)
    return k


def test_shapes_dtypes_and_validation():
    s = _state()
    assert s.num_layers == 2 and s.num_slots == 3
    assert all(m.shape == (3, 8) and m.dtype == torch.float32 for m in s.mean)
    assert all(c.shape == (3,) and c.dtype == torch.int64 for c in s.count)
    for bad in ({"num_slots": 0}, {"hidden_size": True}, {"num_layers": 1.5}):
        with pytest.raises(ValueError):
            _state(**bad)
    with pytest.raises(ValueError, match="slot"):
        s.reset(3)
    with pytest.raises(ValueError, match="layer"):
        s.layer(2)
    with pytest.raises(ValueError, match="mean"):
        s.seed(0, 0, torch.zeros(7), 1)


def test_admission_until_full_then_eviction_and_reuse_is_clean():
    s = _state(num_slots=2)
    a, b = s.acquire(), s.acquire()
    assert {a, b} == {0, 1} and s.num_free == 0
    with pytest.raises(RuntimeError, match="no free"):
        s.acquire()
    _step(s, [a, b], seed=1)
    _step(s, [a], seed=2, layer=1)
    assert s.count[0][a] == 1 and s.count[1][a] == 1 and s.mean[0][a].abs().sum() > 0
    s.release(a)                     # evict a
    with pytest.raises(ValueError, match="not in use"):
        s.release(a)
    c = s.acquire()
    assert c == a                    # the slot is reused ...
    for layer in range(2):           # ... and shows nothing of its previous owner
        assert s.count[layer][c] == 0 and not s.mean[layer][c].any()
    assert s.count[0][b] == 1        # the other request keeps its state


def test_requests_do_not_see_each_other():
    """A request's k/v depend only on its own history, whatever shares the batch."""
    s = _state(num_slots=3)
    a, b = s.acquire(), s.acquire()
    _step(s, [a, b], seed=3)
    k_ab = _step(s, [a, b], seed=4)
    other = _state(num_slots=3)      # same request a, a neighbour with a different history
    y, z = other.acquire(), other.acquire()
    _step(other, [z], seed=9)
    _step(other, [y, z], seed=3)
    k_other = _step(other, [y, z], seed=4)
    assert torch.equal(k_other[0], k_ab[0])
    assert not torch.equal(k_other[1], k_ab[1])
    s.release(b)
    d = s.acquire()
    assert d == b
    k_after = _step(s, [a, d], seed=5)
    fresh = _state(num_slots=3)
    fa, fd = fresh.acquire(), fresh.acquire()
    _step(fresh, [fa, fd], seed=3)
    _step(fresh, [fa, fd], seed=4)
    fresh.release(fd)
    assert torch.equal(k_after, _step(fresh, [fa, fresh.acquire()], seed=5))


def test_registers_in_the_runtime_slot_registry():
    reg = SlotStates(2)
    s = reg.register("mka", _state(num_slots=2))
    slot = reg.acquire()
    _step(s, [slot], seed=6)
    assert s.count[0][slot] == 1
    reg.release(slot)
    assert s.count[0][slot] == 0 and not s.mean[0][slot].any()
