"""The decode-step kernels on the CPU: ``test_decode_step_gpu.py`` re-run in a subprocess through Triton's
interpreter (``MACATTN_TRITON_INTERPRET=1``), so CI checks the kernels' logic (``rope_append``'s tiles of
(token, head) pairs included) against the references too."""
from __future__ import annotations

from pathlib import Path

import pytest

from triton_env import rerun_in_interpreter

pytest.importorskip("triton")


@pytest.mark.slow
def test_decode_step_kernels_in_the_interpreter():
    rerun_in_interpreter(Path(__file__).with_name("test_decode_step_gpu.py"))
