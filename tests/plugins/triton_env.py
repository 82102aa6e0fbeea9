"""Shared switch of the Triton kernel tests: on the GPU by default; with ``MACATTN_TRITON_INTERPRET=1``
the same tests run through Triton's interpreter on CPU tensors. Import this before anything that
defines a Triton kernel (Triton reads ``TRITON_INTERPRET`` when a kernel is defined)."""
import os

import pytest
import torch

INTERPRET = os.environ.get("MACATTN_TRITON_INTERPRET", "0") == "1"
if INTERPRET:
    os.environ["TRITON_INTERPRET"] = "1"

try:
    import triton  # noqa: F401
    HAVE_TRITON = True
except ImportError:
    HAVE_TRITON = False

DEVICE = "cpu" if INTERPRET else "cuda"
GPU_MARKS = [
    pytest.mark.gpu,
    pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed"),
    pytest.mark.skipif(not INTERPRET and not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def rerun_in_interpreter(target, *pytest_args: str, timeout: int = 900) -> None:
    """Run the GPU test file ``target`` in a subprocess through Triton's interpreter
    (``MACATTN_TRITON_INTERPRET=1``, CPU tensors) and assert that its tests ran and passed."""
    import subprocess
    import sys

    env = {**os.environ, "MACATTN_TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(target), *pytest_args],
                          env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert " passed" in last and " failed" not in last, proc.stdout[-2000:]


def poison_allocations(monkeypatch, op_module) -> None:
    """Make ``op_module._alloc`` (the launchers' output / scratch allocator) return NaN-filled floats and
    ``-7``-filled integers, so a value a kernel fails to write shows up in the comparison."""
    def nan_empty(*shape, dtype, device):
        fill = float("nan") if dtype.is_floating_point else -7
        return torch.full(shape, fill, dtype=dtype, device=device)
    monkeypatch.setattr(op_module, "_alloc", nan_empty)
