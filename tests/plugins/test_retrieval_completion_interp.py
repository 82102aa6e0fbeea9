"""The retrieval-completion Triton kernels on the CPU: ``test_retrieval_completion_gpu.py`` re-run in a
subprocess through Triton's interpreter (``MACATTN_TRITON_INTERPRET=1``), so CI checks the kernels'
logic against the fp64 reference too; the H100 runs the compiled kernels
(``benchmarks/results/junit_gpu_h100.xml``)."""
from __future__ import annotations

from pathlib import Path

import pytest

from triton_env import rerun_in_interpreter

pytest.importorskip("triton")


@pytest.mark.slow
def test_retrieval_completion_kernels_in_the_interpreter():
    # the small cases (the GPU adds long ones); every test function, both split modes
    rerun_in_interpreter(Path(__file__).with_name("test_retrieval_completion_gpu.py"), "-k", "not T200 and not F20")
