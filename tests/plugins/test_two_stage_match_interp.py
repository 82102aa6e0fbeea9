"""The two-stage match kernels on the CPU: ``test_two_stage_match_gpu.py`` re-run in a subprocess through
Triton's interpreter (``MACATTN_TRITON_INTERPRET=1``), so CI checks the kernels' logic against the
reference too (the small shapes; the GPU runs them all)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")


@pytest.mark.slow
def test_two_stage_match_kernels_in_the_interpreter():
    env = {**os.environ, "MACATTN_TRITON_INTERPRET": "1"}
    target = Path(__file__).with_name("test_two_stage_match_gpu.py")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(target),
                           "-k", "not 5-4-1024"], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert " passed" in last and " failed" not in last, proc.stdout[-2000:]
