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
