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

The host writes again only after the previous step's copy has run (``wait_copied``): with async
scheduling (``runtime/in_flight.py``) the next step's inputs are written while the step before runs.
"""
from __future__ import annotations

import numpy as np
import torch

from macattn.runtime.sampling import _PARAM_COLUMNS, BIAS_WIDTH, SamplingBatch, SamplingRow, bias_row

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
        self.copied = torch.cuda.Event() if torch.device(device).type == "cuda" else None   # the last upload ran
        self.row_keys = [_UNSET] * nb              # which request's parameters each row holds (``write_sampling``)
        self.bias_keys = [_UNSET] * nb             # what each bias-table row holds

    def sampling(self) -> SamplingBatch:
        """The rows' sampling inputs: views of the device buffer."""
        return SamplingBatch(**{f: self.device[name] for f, name in _SAMPLING_FIELDS.items()})

    def write_sampling(self, rows: list[SamplingRow], keys: list) -> None:
        """Write the ``nb`` sampling ``rows`` (padding rows included) into the host twin. ``keys[i]``:
        ``(request, whether its min_tokens ban is on)``, None for a padding row: a row's parameters and seed
        are rewritten only when its request changed, its bias-table row only when its key did; positions
        every step."""
        h = self.host
        h["sample_pos"][:] = np.fromiter((r.position for r in rows), dtype=np.int64, count=len(rows))
        moved, rebias = [], []
        for i, key in enumerate(keys):
            request = None if key is None else key[0]
            if self.row_keys[i] is _UNSET or self.row_keys[i] != request:
                moved.append(i)
                self.row_keys[i] = request
            if self.bias_keys[i] is _UNSET or self.bias_keys[i] != key:
                rebias.append(i)
                self.bias_keys[i] = key
        if moved:
            scalars = np.array([rows[i].params._scalars for i in moved], dtype=np.float64)
            for j, f in enumerate(_PARAM_COLUMNS):   # fp64 holds every value exactly; the cast rounds as torch's
                h[_SAMPLING_FIELDS[f]][moved] = scalars[:, j]
            h["seed"][moved] = np.fromiter((rows[i].seed for i in moved), dtype=np.int64, count=len(moved))
        if rebias:
            h["bias_ids"][rebias] = 0
            h["bias_values"][rebias] = 0.0
            for i in rebias:
                if rows[i].params.biased:
                    h["bias_ids"][i], h["bias_values"][i] = bias_row(rows[i], BIAS_WIDTH)

    def wait_copied(self) -> None:
        """Wait until the last ``upload`` has read the host twin (before the host writes it again)."""
        if self.copied is not None:
            self.copied.synchronize()

    def upload(self) -> None:
        """Copy every field to the device (asynchronous; stream-ordered before the step's graph)."""
        self.device_buffer.copy_(self.host_buffer, non_blocking=True)
        if self.copied is not None:
            self.copied.record()
