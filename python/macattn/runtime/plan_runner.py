"""Run an engine directory's step graphs (``macattn build``): a TensorRT ``.plan`` or any runner of the same
I/O, through one decode loop.

The graphs' contract is ``docs/graph.md`` / ``macattn.builder.export`` (``decode_io_names``,
``prefill_io_names``): named inputs in, named outputs out, each ring ``<r>.l`` updated into ``<r>.l.out``.
``GraphDecoder`` drives that contract — prefill, then greedy decode steps that append each step's new K/V
row and carry the rings — over a *step function* ``feeds -> outputs``:

* ``TensorRTPlan(path).run``: deserializes ``decode.plan`` / ``prefill.plan`` with TensorRT, binds each ring
  input and its ``.out`` output to **one** buffer (the plan's aliased I/O: ``mac::attend`` writes the rings in
  place), allocates the other outputs, executes on a CUDA stream. Needs ``tensorrt >= 10.3`` (aliased plugin
  I/O) and a CUDA GPU; without them ``require_tensorrt_runtime`` raises an ``ImportError`` naming what is
  missing. TensorRT cannot be installed in this workplace: this class has **never run**.
* the tests pass ONNX Runtime sessions of the same directory's ``.onnx`` graphs (which return the rings as
  new tensors rather than in place; the loop handles both), so the loop itself is checked against the torch
  model's own greedy decode.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

import torch

from macattn.plugins.trt_compat import MIN_TENSORRT, load_plugin_library, require_version

__all__ = ["RING_NAMES", "StepFn", "require_tensorrt_runtime", "TensorRTPlan", "GraphDecoder", "GraphShapes"]

RING_NAMES = ("qring", "oring", "ring_lse", "ring_pos")   # = macattn.builder.export.RING_NAMES (graph.md order)
StepFn = Callable[[Mapping[str, torch.Tensor]], Mapping[str, torch.Tensor]]
_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "torch.bfloat16": torch.bfloat16,
           "torch.float32": torch.float32}


def require_tensorrt_runtime():
    """``tensorrt`` if a ``.plan`` of this project can run here, else ``ImportError`` naming what is missing:
    the ``tensorrt`` package (>= 10.3, aliased plugin I/O) or a CUDA GPU visible to torch."""
    try:
        import tensorrt as trt
    except ImportError as exc:
        raise ImportError("running a .plan needs the `tensorrt` Python package (>= 10.3: aliased plugin I/O for "
                          f"the rings) and a CUDA GPU; `import tensorrt` failed: {exc}") from exc
    require_version("tensorrt", trt.__version__, MIN_TENSORRT, "running a macattn .plan (aliased ring I/O)")
    if not torch.cuda.is_available():
        raise ImportError("running a .plan needs a CUDA GPU; torch.cuda.is_available() is False")
    return trt


class TensorRTPlan:
    """One deserialized ``.plan``; ``run(feeds)`` is a step function (see the module docstring).

    ``path``: the ``.plan`` file; ``plugin_library``: ``libmacattn_trt.so`` to load first (native plugins), or
    None when the plan was built from the Python plugins' AOT images (no plugin code needed at run time)."""

    def __init__(self, path: str | Path, plugin_library: str | Path | None = None) -> None:
        trt = require_tensorrt_runtime()
        self._trt = trt
        self.logger = trt.Logger(trt.Logger.WARNING)
        self.runtime = trt.Runtime(self.logger)
        if plugin_library is not None:
            load_plugin_library(self.runtime.get_plugin_registry(), plugin_library)     # once per process
        self.engine = self.runtime.deserialize_cuda_engine(Path(path).read_bytes())
        if self.engine is None:
            raise RuntimeError(f"TensorRT could not deserialize {path} (built by another TensorRT version or GPU?)")
        self.context = self.engine.create_execution_context()
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        mode = trt.TensorIOMode.INPUT
        self.inputs = [n for n in names if self.engine.get_tensor_mode(n) == mode]
        self.outputs = [n for n in names if self.engine.get_tensor_mode(n) != mode]
        # aliased rings: output "<r>.l.out" shares the buffer of input "<r>.l"
        self.aliases = {o: o[:-len(".out")] for o in self.outputs if o.endswith(".out") and o[:-4] in self.inputs}

    def _torch_dtype(self, name: str) -> torch.dtype:
        trt = self._trt
        table = {trt.float32: torch.float32, trt.float16: torch.float16, trt.bfloat16: torch.bfloat16,
                 trt.int64: torch.int64, trt.int32: torch.int32}
        return table[self.engine.get_tensor_dtype(name)]

    def run(self, feeds: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Bind ``feeds`` (CUDA tensors, contiguous, each input's engine dtype), execute, return every output;
        an aliased ring output is its input tensor, written in place."""
        missing = [n for n in self.inputs if n not in feeds]
        if missing:
            raise ValueError(f"feeds is missing the plan inputs {missing}")
        ctx = self.context
        for n in self.inputs:
            t = feeds[n]
            if t.device.type != "cuda" or not t.is_contiguous() or t.dtype != self._torch_dtype(n):
                raise ValueError(f"input {n} must be a contiguous CUDA {self._torch_dtype(n)} tensor, got "
                                 f"{t.dtype} on {t.device}")
            ctx.set_input_shape(n, tuple(t.shape))
            ctx.set_tensor_address(n, t.data_ptr())
        out = {}
        for n in self.outputs:
            if n in self.aliases:
                out[n] = feeds[self.aliases[n]]
            else:
                out[n] = torch.empty(tuple(ctx.get_tensor_shape(n)), dtype=self._torch_dtype(n), device="cuda")
            ctx.set_tensor_address(n, out[n].data_ptr())
        stream = torch.cuda.current_stream()
        if not ctx.execute_async_v3(stream.cuda_stream):
            raise RuntimeError("TensorRT execute_async_v3 failed (see the log above)")
        stream.synchronize()
        return out


@dataclass(frozen=True)
class GraphShapes:
    """What the decode loop needs of ``manifest.json``: layers, heads, head dim, per-layer windows, dtype."""

    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    windows: tuple[int, ...]
    dtype: torch.dtype

    @classmethod
    def from_engine_dir(cls, path: str | Path) -> "GraphShapes":
        raw = json.loads((Path(path) / "manifest.json").read_text())
        s = raw["shapes"]
        dtype = raw.get("export_dtype") or s.get("model_dtype", "fp32")
        if dtype not in _DTYPES:
            raise ValueError(f"manifest export dtype must be one of {tuple(_DTYPES)}, got {dtype!r}")
        return cls(s["num_layers"], s["num_q_heads"], s["num_kv_heads"], s["head_dim"], tuple(s["windows"]),
                   _DTYPES[dtype])


class GraphDecoder:
    """Greedy generation through an engine directory's prefill / decode step functions.

    ``prefill`` / ``decode``: step functions over the graphs' named I/O; ``shapes``: ``GraphShapes``;
    ``num_slots``: ring rows (``>= batch``). ``generate(input_ids [B, L] int64, steps)`` -> ``[B, steps]``
    int64 tokens (the first from the prefill logits)."""

    def __init__(self, prefill: StepFn, decode: StepFn, shapes: GraphShapes, *, num_slots: int,
                 device: str | torch.device = "cpu") -> None:
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 1:
            raise ValueError(f"num_slots must be an int >= 1, got {num_slots!r}")
        self.prefill_fn, self.decode_fn, self.shapes = prefill, decode, shapes
        self.num_slots, self.device = num_slots, torch.device(device)

    def empty_rings(self) -> dict[str, torch.Tensor]:
        """Fresh rings ``qring.l`` (model dtype, 0), ``oring.l`` (fp32, 0), ``ring_lse.l`` (fp32, -inf),
        ``ring_pos.l`` (int64, -1) for ``num_slots`` slots."""
        sh, S, dev = self.shapes, self.num_slots, self.device
        rings = {}
        for l, K in enumerate(sh.windows):
            q = (S, sh.num_q_heads, K, sh.head_dim)
            rings[f"qring.{l}"] = torch.zeros(q, dtype=sh.dtype, device=dev)
            rings[f"oring.{l}"] = torch.zeros(q, dtype=torch.float32, device=dev)
            rings[f"ring_lse.{l}"] = torch.full(q[:3], float("-inf"), device=dev)
            rings[f"ring_pos.{l}"] = torch.full((S, K), -1, dtype=torch.int64, device=dev)
        return rings

    def _carry_rings(self, rings: dict, out: Mapping[str, torch.Tensor]) -> None:
        for name, t in rings.items():
            new = out[f"{name}.out"]
            if new is not t:                 # ONNX Runtime returns new tensors; a .plan writes in place
                rings[name] = new.to(t.device, t.dtype).contiguous()

    def generate(self, input_ids: torch.Tensor, steps: int) -> torch.Tensor:
        if input_ids.dim() != 2 or input_ids.dtype != torch.int64:
            raise ValueError(f"input_ids must be [B, L] int64, got {tuple(input_ids.shape)} {input_ids.dtype}")
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"steps must be an int >= 1, got {steps!r}")
        B, L = input_ids.shape
        if B > self.num_slots:
            raise ValueError(f"batch {B} exceeds num_slots={self.num_slots}")
        n = self.shapes.num_layers
        slots = torch.arange(B, dtype=torch.int64, device=self.device)
        rings = self.empty_rings()
        out = self.prefill_fn({"input_ids": input_ids.to(self.device), "slots": slots, **rings})
        self._carry_rings(rings, out)
        keys = [out[f"key.{l}"] for l in range(n)]
        values = [out[f"value.{l}"] for l in range(n)]
        tokens = [out["logits"].argmax(-1)]
        for step in range(steps - 1):
            pos = torch.full((B,), L + step, dtype=torch.int64, device=self.device)
            feeds = {"input_ids": tokens[-1].view(B, 1).to(self.device), "positions": pos, "slots": slots, **rings}
            for l in range(n):
                feeds[f"key.{l}"], feeds[f"value.{l}"] = keys[l], values[l]
            out = self.decode_fn(feeds)
            self._carry_rings(rings, out)
            keys = [torch.cat([keys[l], out[f"key.{l}.new"].to(keys[l].dtype)], dim=2).contiguous() for l in range(n)]
            values = [torch.cat([values[l], out[f"value.{l}.new"].to(values[l].dtype)], dim=2).contiguous()
                      for l in range(n)]
            tokens.append(out["logits"].argmax(-1))
        return torch.stack([t.to(torch.int64).cpu() for t in tokens], dim=1)
