"""Write a Triton Inference Server model repository (Python backend) for an engine directory.

Layout written under ``out`` (``name`` defaults to ``macattn``)::

    out/<name>/config.pbtxt        decoupled (streaming over gRPC): one response per token
    out/<name>/1/model.py          this package's ``triton_model.py``
    out/<name>_sync/config.pbtxt   same model, not decoupled: one response with all tokens
    out/<name>_sync/1/model.py     (for HTTP / KServe v2 ``infer`` clients)

Inputs: ``input_ids`` INT64 ``[-1]``, ``max_new_tokens`` INT32 ``[1]``; optional
``end_id`` INT32, ``temperature`` FP32, ``top_k`` INT32, ``top_p`` FP32, ``random_seed``
INT64 (all ``[1]``), ``rag_lengths`` INT32 ``[-1]`` (an A3 chunked prompt: ``[len(system),
len(chunk_1), …]``, question = the rest of ``input_ids``; ``docs/a3.md``). Output: ``output_ids`` INT64 ``[-1]`` — the generated tokens (not the
prompt; the end token is not emitted). The decoupled model sends one response per token,
the last one flagged final (an empty final response if the request ends on ``end_id``).

Parameters (``config.pbtxt``, written now and read by ``model.py`` at load time):
``engine_dir``, ``sys_path`` (JSON list of site-packages directories that ``model.py``
adds itself — the Python backend stub ignores ``PYTHONPATH``), ``mac_config`` (JSON
``MacConfig.to_dict()``) plus ``mac_window`` / ``mac_band`` / ``mac_tau`` / ``mac_enabled``
for reading, ``max_batch_size``, ``block_size``, ``device``, ``torch_num_threads``.
"""
from __future__ import annotations

import json
import os
import shutil
import site
import sys
from pathlib import Path

from macattn.methods.mac.config import MacConfig

from macattn.runtime.engine_dir import read_engine_dir

__all__ = ["default_sys_path", "write_model_repository"]

_INPUTS = [("input_ids", "TYPE_INT64", -1, False), ("max_new_tokens", "TYPE_INT32", 1, False),
           ("end_id", "TYPE_INT32", 1, True), ("temperature", "TYPE_FP32", 1, True),
           ("top_k", "TYPE_INT32", 1, True), ("top_p", "TYPE_FP32", 1, True),
           ("random_seed", "TYPE_INT64", 1, True),
           ("rag_lengths", "TYPE_INT32", -1, True)]   # A3 chunked prompt, see a3_assembly.split_rag_prompt


def default_sys_path() -> list[str]:
    """The running interpreter's site-packages directories (their ``.pth`` files, e.g. an
    editable install's finder, are processed by ``model.py`` through ``site.addsitedir``)."""
    dirs = list(site.getsitepackages())
    if site.ENABLE_USER_SITE:
        dirs.append(site.getusersitepackages())
    dirs += [p for p in sys.path if p.endswith(("site-packages", "dist-packages"))]
    out: list[str] = []
    for d in dirs:
        if os.path.isdir(d) and d not in out:
            out.append(d)
    return out


def _pb_string(s: str) -> str:
    """A protobuf text-format string literal (non-printable / non-ASCII bytes as octal escapes)."""
    body = []
    for byte in s.encode("utf-8"):
        ch = chr(byte)
        if ch in '\\"':
            body.append("\\" + ch)
        elif 32 <= byte < 127:
            body.append(ch)
        else:
            body.append(f"\\{byte:03o}")
    return '"' + "".join(body) + '"'


def _config_pbtxt(name: str, *, decoupled: bool, params: dict[str, str]) -> str:
    lines = [f"name: {_pb_string(name)}", 'backend: "python"', "max_batch_size: 0"]
    if decoupled:
        lines.append("model_transaction_policy { decoupled: true }")
    lines.append("input [")
    lines.append(",\n".join(
        f"  {{ name: {_pb_string(n)} data_type: {t} dims: [ {d} ]{' optional: true' if opt else ''} }}"
        for n, t, d, opt in _INPUTS))
    lines.append("]")
    lines.append('output [\n  { name: "output_ids" data_type: TYPE_INT64 dims: [ -1 ] }\n]')
    lines.append("instance_group [ { count: 1 kind: KIND_CPU } ]")
    for k, v in params.items():
        lines.append(f"parameters {{ key: {_pb_string(k)} value: {{ string_value: {_pb_string(v)} }} }}")
    return "\n".join(lines) + "\n"


def write_model_repository(engine_dir: str | Path, out: str | Path, *, name: str = "macattn",
                           mac_config: MacConfig | None = None, max_batch_size: int = 8, block_size: int = 16,
                           device: str = "cpu", torch_num_threads: int = 0, sys_path: list[str] | None = None,
                           sync_model: bool = True) -> list[Path]:
    """Write the repository; returns the model directories. ``mac_config`` None = the engine's."""
    engine_dir = Path(engine_dir).resolve()
    manifest = read_engine_dir(engine_dir)          # fails early on a bad engine dir
    mac = mac_config or manifest.mac_config
    for label, val in (("max_batch_size", max_batch_size), ("block_size", block_size)):
        if isinstance(val, bool) or not isinstance(val, int) or val < 1:
            raise ValueError(f"{label} must be an int >= 1, got {val!r}")
    if not name or not all(c.isalnum() or c in "_-" for c in name):
        raise ValueError(f"name must be non-empty and use only letters, digits, '_' and '-', got {name!r}")
    params = {
        "engine_dir": str(engine_dir),
        "sys_path": json.dumps(sys_path if sys_path is not None else default_sys_path()),
        "mac_config": json.dumps(mac.to_dict(), sort_keys=True),
        "mac_window": str(mac.window), "mac_band": str(mac.band), "mac_tau": repr(mac.tau),
        "mac_enabled": str(mac.enabled).lower(),
        "max_batch_size": str(max_batch_size), "block_size": str(block_size), "device": device,
        "torch_num_threads": str(int(torch_num_threads)),
    }
    out = Path(out)
    src = Path(__file__).with_name("triton_model.py")
    written = []
    for model_name, decoupled in [(name, True)] + ([(f"{name}_sync", False)] if sync_model else []):
        d = out / model_name
        (d / "1").mkdir(parents=True, exist_ok=True)
        (d / "config.pbtxt").write_text(_config_pbtxt(model_name, decoupled=decoupled, params=params))
        shutil.copyfile(src, d / "1" / "model.py")
        written.append(d)
    return written
