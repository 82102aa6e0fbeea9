"""The ring-seeding kernel on the CPU: ``test_ring_seed_gpu.py`` re-run in a subprocess through Triton's interpreter
(``MACATTN_TRITON_INTERPRET=1``), so CI checks the kernel's logic against the reference too (the 8B shapes of the
default window ``K = 1024`` take ~12 s each there: left to the GPU)."""
from __future__ import annotations

from pathlib import Path

import pytest

from triton_env import rerun_in_interpreter

pytest.importorskip("triton")


@pytest.mark.slow
def test_ring_seed_kernel_in_the_interpreter():
    rerun_in_interpreter(Path(__file__).with_name("test_ring_seed_gpu.py"), "-k", "not 1024")
