"""The two-stage match kernels on the CPU: ``test_two_stage_match_gpu.py`` re-run in a subprocess through
Triton's interpreter (``MACATTN_TRITON_INTERPRET=1``), so CI checks the kernels' logic against the
reference too (the small shapes; the GPU runs them all)."""
from __future__ import annotations

from pathlib import Path

import pytest

from triton_env import rerun_in_interpreter

pytest.importorskip("triton")


@pytest.mark.slow
def test_two_stage_match_kernels_in_the_interpreter():
    rerun_in_interpreter(Path(__file__).with_name("test_two_stage_match_gpu.py"), "-k", "not 5-4-1024")
