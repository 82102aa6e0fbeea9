"""Issue 36 item 7: the JIT ``mac_py::attend`` launcher keeps one plan per shape bucket, not one per context
length ``T`` (64 decode steps made 64 plans of 0.6 MB each, inside TensorRT's enqueue), and a bounded number of
them (one launcher serves every layer and execution context). CPU: plans are made, no kernel runs."""
from __future__ import annotations

import pytest
import torch

from macattn.plugins.mac.attend_op import MacAttendLauncher


def _tensors(B, T, Hq=4, Hkv=2, d=16, K=32):
    return (torch.empty(B, Hq, d, dtype=torch.bfloat16), torch.empty(B, Hkv, T, d, dtype=torch.bfloat16),
            torch.empty(3, Hq, K, d, dtype=torch.bfloat16))


def test_item7_one_plan_across_decode_steps():
    launch = MacAttendLauncher()
    plans = {id(launch.plan_for(*_tensors(2, T), 8, 0.25)) for T in range(40, 104)}     # 64 decode steps
    assert len(plans) == 1 and len(launch._plans) == 1
    assert launch.plan_for(*_tensors(2, 5000), 8, 0.25) is launch.plan_for(*_tensors(2, 41), 8, 0.25)
    other = launch.plan_for(*_tensors(3, 41), 8, 0.25)                  # another batch size: another bucket
    assert other.B == 3 and len(launch._plans) == 2


def test_item7_plans_are_bounded_least_recently_used_first():
    launch = MacAttendLauncher(max_plans=2)
    p1 = launch.plan_for(*_tensors(1, 9), 8, 0.25)
    p2 = launch.plan_for(*_tensors(2, 9), 8, 0.25)
    assert launch.plan_for(*_tensors(1, 10), 8, 0.25) is p1              # p1 used last: p2 is dropped next
    launch.plan_for(*_tensors(3, 9), 8, 0.25)
    assert len(launch._plans) == 2 and p2 not in launch._plans.values() and p1 in launch._plans.values()
    with pytest.raises(ValueError, match="max_plans"):
        MacAttendLauncher(max_plans=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_item7_execution_contexts_on_two_streams_do_not_share_scratch():
    launch = MacAttendLauncher()
    q, k, qring = (t.cuda() for t in _tensors(2, 40))
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(s1):
        p1 = launch.plan_for(q, k, qring, 8, 0.25)
    with torch.cuda.stream(s2):
        p2 = launch.plan_for(q, k, qring, 8, 0.25)
    with torch.cuda.stream(s1):
        assert launch.plan_for(q, k[:, :, :20], qring, 8, 0.25) is p1
    assert p1 is not p2 and p1.part_o.data_ptr() != p2.part_o.data_ptr()
