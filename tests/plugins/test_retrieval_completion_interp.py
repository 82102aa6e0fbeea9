"""The retrieval-completion Triton kernels on the CPU: ``test_retrieval_completion_gpu.py`` re-run in a
subprocess through Triton's interpreter (``MACATTN_TRITON_INTERPRET=1``), so CI checks the kernels'
logic against the fp64 reference too; the H100 runs the compiled kernels
(``benchmarks/results/junit_gpu_h100.xml``)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")


@pytest.mark.slow
def test_retrieval_completion_kernels_in_the_interpreter():
    env = {**os.environ, "MACATTN_TRITON_INTERPRET": "1"}
    target = Path(__file__).with_name("test_retrieval_completion_gpu.py")
    # the small cases (the GPU adds long ones); every test function, both split modes
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(target),
                           "-k", "not T200 and not F20"], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert " passed" in last and " failed" not in last, proc.stdout[-2000:]
