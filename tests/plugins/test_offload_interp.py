"""The offloaded decode's kernels on the CPU: ``test_offload_gpu.py`` re-run in a subprocess through Triton's
interpreter (``MACATTN_TRITON_INTERPRET=1``; the CUDA-graph test skips there)."""
from __future__ import annotations

from pathlib import Path

import pytest

from triton_env import rerun_in_interpreter

pytest.importorskip("triton")


@pytest.mark.slow
def test_offload_kernels_in_the_interpreter():
    rerun_in_interpreter(Path(__file__).with_name("test_offload_gpu.py"))
