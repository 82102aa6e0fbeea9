"""The static inputs of one CUDA-graph batch bucket in one device buffer with a pinned host twin.

The host writes each step's values into numpy views of the pinned buffer and one asynchronous
copy moves all of them (one host-to-device transfer per step instead of one per tensor; the graph
reads the device views). Fields (``nb`` rows, ``P`` pages per request):

===============  ===============  =========================================================
name             shape            dtype / meaning
===============  ===============  =========================================================
ids              ``[nb, 1]``      int64: the token fed to each row
positions        ``[nb]``         int64: its position ``m``
slots            ``[nb]``         int64: the row's per-request state slot
valid            ``[nb]``         fp64: 1 for a request's row, 0 for padding (diagnostics)
temperature      ``[nb]``         fp32 \\
top_k            ``[nb]``         int64  |  the rows' ``SamplingBatch``
top_p            ``[nb]``         fp32   |
seed             ``[nb]``         int64  |
sample_pos       ``[nb]``         int64 /  (position of the token being generated)
write_rows       ``[nb]``         int64: flat KV-pool row of position ``m`` (paged KV only)
page_table       ``[nb, P]``      int32: KV block ids (paged KV only)
===============  ===============  =========================================================

The previous step's copy has finished before the host writes again: the step reads its tokens
back (a synchronisation) after the copy, the graph and the sampler, in stream order.
"""
from __future__ import annotations

import numpy as np
import torch

from macattn.runtime.sampling import SamplingBatch

__all__ = ["StepInputs"]


class StepInputs:
    def __init__(self, nb: int, *, max_pages: int, paged: bool, device: torch.device) -> None:
        i64, f32, i32 = torch.int64, torch.float32, torch.int32
        layout = [("ids", i64, (nb, 1)), ("positions", i64, (nb,)), ("slots", i64, (nb,)),
                  ("valid", torch.float64, (nb,)),
                  ("temperature", f32, (nb,)), ("top_k", i64, (nb,)), ("top_p", f32, (nb,)),
                  ("seed", i64, (nb,)), ("sample_pos", i64, (nb,))]
        if paged:
            layout += [("write_rows", i64, (nb,)), ("page_table", i32, (nb, max_pages))]
        spans, offset = [], 0
        for name, dtype, shape in layout:
            nbytes = int(np.prod(shape)) * dtype.itemsize
            spans.append((name, dtype, shape, offset, nbytes))
            offset += -(-nbytes // 8) * 8                       # every field 8-byte aligned
        self.host_buffer = torch.empty(offset, dtype=torch.uint8, pin_memory=True)
        self.device_buffer = torch.empty(offset, dtype=torch.uint8, device=device)
        self.host: dict[str, np.ndarray] = {}
        self.device: dict[str, torch.Tensor] = {}
        for name, dtype, shape, start, nbytes in spans:
            self.host[name] = self.host_buffer[start:start + nbytes].view(dtype).view(shape).numpy()
            self.device[name] = self.device_buffer[start:start + nbytes].view(dtype).view(shape)

    def sampling(self) -> SamplingBatch:
        """The rows' sampling inputs: views of the device buffer."""
        d = self.device
        return SamplingBatch(d["temperature"], d["top_k"], d["top_p"], d["seed"], d["sample_pos"])

    def upload(self) -> None:
        """Copy every field to the device (asynchronous; stream-ordered before the step's graph)."""
        self.device_buffer.copy_(self.host_buffer, non_blocking=True)
