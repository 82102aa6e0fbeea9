"""The FastMKA op's kernels on the CPU: ``test_route_fused_gpu.py`` re-run in a subprocess through Triton's
interpreter (``MACATTN_TRITON_INTERPRET=1``), so CI checks the kernels' logic against the reference too."""
from __future__ import annotations

from pathlib import Path

import pytest

from triton_env import rerun_in_interpreter

pytest.importorskip("triton")


@pytest.mark.slow
def test_route_fused_kernels_in_the_interpreter():
    rerun_in_interpreter(Path(__file__).with_name("test_route_fused_gpu.py"))


def test_route_fused_launch_constants_are_checked():
    from macattn.plugins.route_fused.op import DEFAULT_LAUNCH, RouteFusedLaunch

    assert RouteFusedLaunch() == DEFAULT_LAUNCH
    for bad in (dict(split=8), dict(split=48), dict(block_n=8), dict(block_d=100), dict(max_block_b=8),
                dict(s_block=3), dict(warps=3), dict(stages=0), dict(split=True)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            RouteFusedLaunch(**bad)
