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
top_k            ``[nb]``         int64  |
top_p            ``[nb]``         fp32   |
seed             ``[nb]``         int64  |
sample_pos       ``[nb]``         int64  |  the rows' ``SamplingBatch`` (``sample_pos``: its
min_p            ``[nb]``         fp32   |  ``position``, of the token being generated)
rep_penalty      ``[nb]``         fp32   |
pres_penalty     ``[nb]``         fp32   |
freq_penalty     ``[nb]``         fp32   |
bias_ids         ``[nb, K]``      int64  |  (the bias table: ``K = sampling.BIAS_WIDTH``)
bias_values      ``[nb, K]``      fp32  /
write_rows       ``[nb]``         int64: flat KV-pool row of position ``m`` (paged KV only)
page_table       ``[nb, P]``      int32: KV block ids (paged KV only)
===============  ===============  =========================================================

The previous step's copy has finished before the host writes again: the step reads its tokens
back (a synchronisation) after the copy, the graph and the sampler, in stream order.
"""
from __future__ import annotations

import numpy as np
import torch

from macattn.runtime.sampling import BIAS_WIDTH, SamplingBatch, SamplingRow, bias_row, columns

__all__ = ["StepInputs"]

# SamplingBatch field -> StepInputs field
_SAMPLING_FIELDS = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "seed": "seed",
                    "position": "sample_pos", "min_p": "min_p", "repetition_penalty": "rep_penalty",
                    "presence_penalty": "pres_penalty", "frequency_penalty": "freq_penalty",
                    "bias_ids": "bias_ids", "bias_values": "bias_values"}
_UNSET = object()


class StepInputs:
    def __init__(self, nb: int, *, max_pages: int, paged: bool, device: torch.device) -> None:
        i64, f32, i32 = torch.int64, torch.float32, torch.int32
        layout = [("ids", i64, (nb, 1)), ("positions", i64, (nb,)), ("slots", i64, (nb,)),
                  ("valid", torch.float64, (nb,)),
                  ("temperature", f32, (nb,)), ("top_k", i64, (nb,)), ("top_p", f32, (nb,)),
                  ("seed", i64, (nb,)), ("sample_pos", i64, (nb,)), ("min_p", f32, (nb,)),
                  ("rep_penalty", f32, (nb,)), ("pres_penalty", f32, (nb,)), ("freq_penalty", f32, (nb,)),
                  ("bias_ids", i64, (nb, BIAS_WIDTH)), ("bias_values", f32, (nb, BIAS_WIDTH))]
        if paged:
            layout += [("write_rows", i64, (nb,)), ("page_table", i32, (nb, max_pages))]
        spans, offset = [], 0
        for name, dtype, shape in layout:
            nbytes = int(np.prod(shape)) * dtype.itemsize
            spans.append((name, dtype, shape, offset, nbytes))
            offset += -(-nbytes // 8) * 8                       # every field 8-byte aligned
        # pinned for the asynchronous copy to a GPU (a CPU twin, for tests, needs none)
        self.host_buffer = torch.empty(offset, dtype=torch.uint8, pin_memory=torch.device(device).type == "cuda")
        self.device_buffer = torch.empty(offset, dtype=torch.uint8, device=device)
        self.host: dict[str, np.ndarray] = {}
        self.device: dict[str, torch.Tensor] = {}
        for name, dtype, shape, start, nbytes in spans:
            self.host[name] = self.host_buffer[start:start + nbytes].view(dtype).view(shape).numpy()
            self.device[name] = self.device_buffer[start:start + nbytes].view(dtype).view(shape)
        self.bias_keys = [_UNSET] * nb             # what each bias-table row holds (``write_sampling``)

    def sampling(self) -> SamplingBatch:
        """The rows' sampling inputs: views of the device buffer."""
        return SamplingBatch(**{f: self.device[name] for f, name in _SAMPLING_FIELDS.items()})

    def write_sampling(self, rows: list[SamplingRow], keys: list) -> None:
        """Write the ``nb`` sampling ``rows`` (padding rows included) into the host twin. A bias-table row
        is rewritten only when its key changed (``keys[i]``: e.g. the request and whether its
        ``min_tokens`` ban is on; None for a padding row)."""
        h = self.host
        for f, col in columns(rows).items():
            h[_SAMPLING_FIELDS[f]][:] = col
        for i, (row, key) in enumerate(zip(rows, keys)):
            if self.bias_keys[i] is _UNSET or self.bias_keys[i] != key:
                h["bias_ids"][i], h["bias_values"][i] = bias_row(row, BIAS_WIDTH)
                self.bias_keys[i] = key

    def upload(self) -> None:
        """Copy every field to the device (asynchronous; stream-ordered before the step's graph)."""
        self.device_buffer.copy_(self.host_buffer, non_blocking=True)
