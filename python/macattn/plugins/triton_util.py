"""Small helpers shared by the Triton kernels' launchers (no kernels here).

Importing this module needs ``triton``; ``macattn.plugins`` imports it only when triton
is importable.
"""
from __future__ import annotations

import functools
import os

import torch
import triton

__all__ = ["interpreting", "num_sms", "next_pow2", "check_cuda_or_interp", "default_pdl", "resident_per_sm"]


def interpreting() -> bool:
    """True under ``TRITON_INTERPRET=1`` (kernels run on the CPU through numpy).

    The interpreter mis-computes ``tl.dot`` on bf16 operands (seen with triton 3.6), so
    the kernels take a ``DOT_F32`` constexpr that upcasts dot operands there.
    """
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Multiprocessor count of ``device`` (132 on the H100 SXM; 8 for the CPU interpreter)."""
    device = torch.device(device)
    if device.type != "cuda":
        return 8
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def default_pdl(device: torch.device) -> bool:
    """Programmatic dependent launch (Hopper+): each kernel of a step may start while its predecessor
    drains and waits (``griddepcontrol.wait``) before touching the predecessor's outputs.
    On by default on sm90+; ``MACATTN_PDL=0`` turns it off."""
    device = torch.device(device)
    if device.type != "cuda" or interpreting() or os.environ.get("MACATTN_PDL", "1") == "0":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_capability(index)[0] >= 9


def resident_per_sm(compiled, num_warps: int, device: torch.device, default: int = 4) -> int:
    """Programs of ``compiled`` (a Triton ``CompiledKernel``) that fit on one SM at once.

    From its registers and shared memory and the device's per-SM limits (register allocation
    granularity 256 per warp, 1 KB shared memory reserved per block). ``default`` when
    unknown (interpreter, or no compiled kernel).
    """
    if compiled is None or torch.device(device).type != "cuda":
        return default
    try:
        compiled._init_handles()
        regs, smem = int(compiled.n_regs), int(compiled.metadata.shared)
    except Exception:  # noqa: BLE001 - an estimate only
        return default
    props = torch.cuda.get_device_properties(torch.device(device))
    threads = 32 * num_warps
    by_threads = getattr(props, "max_threads_per_multi_processor", 2048) // threads
    per_warp = -(-(max(regs, 1) * 32) // 256) * 256
    by_regs = getattr(props, "regs_per_multiprocessor", 65536) // (per_warp * num_warps)
    sm_smem = getattr(props, "shared_memory_per_multiprocessor", 233472)
    by_smem = sm_smem // (smem + 1024)
    return max(1, min(by_threads, by_regs, by_smem, 32))


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else triton.next_power_of_2(int(n))


def check_cuda_or_interp(name: str, t: torch.Tensor) -> None:
    """Kernels run on CUDA tensors, or on CPU tensors under the interpreter."""
    if t.device.type != "cuda" and not interpreting():
        raise ValueError(f"{name} must be a CUDA tensor (or set TRITON_INTERPRET=1), got device {t.device}")
