"""Write a Triton Inference Server model repository (Python backend) for an engine directory.

Layout written under ``out`` (``name`` defaults to ``macattn``)::

    out/<name>/config.pbtxt        decoupled (streaming over gRPC): one response per token
    out/<name>/1/model.py          this package's ``triton_model.py``
    out/<name>_sync/config.pbtxt   same model, not decoupled: one response with all tokens
    out/<name>_sync/1/model.py     (for HTTP / KServe v2 ``infer`` clients)
    out/preprocessing/             text in (with a tokenizer): TensorRT-LLM backend conventions,
    out/postprocessing/            ``triton_text.py`` run by the same model.py
    out/ensemble/config.pbtxt      text_input -> preprocessing -> <name> -> postprocessing -> text_output

Token-id model inputs: ``input_ids`` INT64 ``[-1]``, ``max_new_tokens`` INT64 ``[1]``; optional
``end_id`` INT64, ``pad_id`` INT32 (accepted; nothing is padded), ``temperature`` FP32, ``top_k``
INT64, ``top_p`` FP32, ``random_seed`` INT64, ``stream`` BOOL (all ``[1]``), ``stop_words`` /
``bad_words`` INT32 ``[2, -1]`` (TensorRT-LLM's word lists; bad words are refused),
``rag_lengths`` INT64 ``[-1]`` (an A3 chunked prompt: ``[len(system), len(chunk_1), …]``,
question = the rest of ``input_ids``; ``docs/a3.md``), ``reuse_prefix`` BOOL ``[1]`` (with the
``completion`` parameter's prefix store: load the prompt's KV instead of prefilling it). Output: ``output_ids`` INT64 ``[-1]`` — the
generated tokens (not the prompt; the end token is not emitted). The decoupled model sends one
response per token, the last one flagged final (an empty final response if the request ends on
``end_id``), or one response with every token when ``stream`` is false.

The ensemble (written when a tokenizer is found: ``tokenizer_dir``, else the engine's ``hf/`` if it
holds one) takes TensorRT-LLM's ensemble inputs ``text_input`` STRING ``[1]``, ``max_tokens``
INT64 ``[1]``; optional ``bad_words`` / ``stop_words`` STRING ``[-1]``, ``end_id`` INT64, ``pad_id``
INT32, ``top_k`` INT64, ``top_p``, ``temperature`` FP32, ``random_seed`` INT64, ``stream`` BOOL; and
returns ``text_output`` STRING ``[-1]``. Triton's ``generate`` (one response) and
``generate_stream`` (``"stream": true``: one per token) endpoints serve it.

The counts and ids a client may send past 2^31 (``max_new_tokens`` / ``max_tokens``, ``end_id``,
``top_k``, ``rag_lengths``) are INT64 (TensorRT-LLM's are INT32): Triton wraps a JSON number into an
INT32 input silently (``max_tokens: 4294967300`` would arrive as 4), while an INT64 reaches the model
whole and is range-checked there (a 400 naming the field). A client that sends INT32 for them gets
Triton's 400 naming the input and the expected type.

Parameters (``config.pbtxt``, written now and read by ``model.py`` at load time): ``engine_args``
(``EngineArgs.to_json()``: the engine the model runs — the same options as ``LLM(...)`` and ``macattn
serve``; ``model`` is the engine's ``hf/``, ``mac`` its MAC config unless given), ``sys_path`` (JSON list of
site-packages directories that ``model.py`` adds itself — the Python backend stub ignores ``PYTHONPATH``),
``torch_num_threads``.
"""
from __future__ import annotations

import json
import os
import shutil
import site
import sys
from pathlib import Path

from dataclasses import replace

from macattn.runtime.engine_args import EngineArgs
from macattn.runtime.engine_dir import read_engine_dir

__all__ = ["default_sys_path", "write_model_repository"]

# (name, type, dims, optional)
# Integers a client may send past 2^31 are INT64: Triton wraps an INT32 silently before the model sees it.
_INPUTS = [("input_ids", "TYPE_INT64", (-1,), False), ("max_new_tokens", "TYPE_INT64", (1,), False),
           ("end_id", "TYPE_INT64", (1,), True), ("pad_id", "TYPE_INT32", (1,), True),
           ("temperature", "TYPE_FP32", (1,), True), ("top_k", "TYPE_INT64", (1,), True),
           ("top_p", "TYPE_FP32", (1,), True), ("random_seed", "TYPE_INT64", (1,), True),
           ("stream", "TYPE_BOOL", (1,), True), ("stop_words", "TYPE_INT32", (2, -1), True),
           ("bad_words", "TYPE_INT32", (2, -1), True),
           ("rag_lengths", "TYPE_INT64", (-1,), True),   # A3 chunked prompt, see a3_assembly.split_rag_prompt
           ("reuse_prefix", "TYPE_BOOL", (1,), True)]    # completion with a prefix store: load the prompt's KV
_OUTPUTS = [("output_ids", "TYPE_INT64", (-1,))]
_PRE_INPUTS = [("QUERY", "TYPE_STRING", (1,), False), ("REQUEST_OUTPUT_LEN", "TYPE_INT64", (1,), False),
               ("BAD_WORDS_DICT", "TYPE_STRING", (-1,), True), ("STOP_WORDS_DICT", "TYPE_STRING", (-1,), True),
               ("END_ID", "TYPE_INT64", (1,), True), ("PAD_ID", "TYPE_INT32", (1,), True),
               ("STREAM", "TYPE_BOOL", (1,), True)]
_PRE_OUTPUTS = [("INPUT_ID", "TYPE_INT64", (-1,)), ("REQUEST_OUTPUT_LEN", "TYPE_INT64", (1,)),
                ("OUT_END_ID", "TYPE_INT64", (1,)), ("OUT_PAD_ID", "TYPE_INT32", (1,)),
                ("STOP_WORDS_IDS", "TYPE_INT32", (2, -1)), ("BAD_WORDS_IDS", "TYPE_INT32", (2, -1)),
                ("OUT_STREAM", "TYPE_BOOL", (1,))]
_POST_INPUTS = [("TOKENS_BATCH", "TYPE_INT64", (-1,), False)]
_POST_OUTPUTS = [("OUTPUT", "TYPE_STRING", (-1,))]
# the ensemble's inputs (TensorRT-LLM's names) and where each goes: (step, step input)
_ENSEMBLE_INPUTS = [("text_input", "TYPE_STRING", (1,), False, "preprocessing", "QUERY"),
                    ("max_tokens", "TYPE_INT64", (1,), False, "preprocessing", "REQUEST_OUTPUT_LEN"),
                    ("bad_words", "TYPE_STRING", (-1,), True, "preprocessing", "BAD_WORDS_DICT"),
                    ("stop_words", "TYPE_STRING", (-1,), True, "preprocessing", "STOP_WORDS_DICT"),
                    ("end_id", "TYPE_INT64", (1,), True, "preprocessing", "END_ID"),
                    ("pad_id", "TYPE_INT32", (1,), True, "preprocessing", "PAD_ID"),
                    ("stream", "TYPE_BOOL", (1,), True, "preprocessing", "STREAM"),
                    ("top_k", "TYPE_INT64", (1,), True, "engine", "top_k"),
                    ("top_p", "TYPE_FP32", (1,), True, "engine", "top_p"),
                    ("temperature", "TYPE_FP32", (1,), True, "engine", "temperature"),
                    ("random_seed", "TYPE_INT64", (1,), True, "engine", "random_seed")]
# preprocessing output -> engine input
_PRE_TO_ENGINE = [("INPUT_ID", "input_ids"), ("REQUEST_OUTPUT_LEN", "max_new_tokens"), ("OUT_END_ID", "end_id"),
                  ("OUT_PAD_ID", "pad_id"), ("STOP_WORDS_IDS", "stop_words"), ("BAD_WORDS_IDS", "bad_words"),
                  ("OUT_STREAM", "stream")]


def default_sys_path() -> list[str]:
    """The directory this ``macattn`` is imported from (first: the models run the code that wrote
    them, also when it comes from ``PYTHONPATH``), then the running interpreter's site-packages
    directories (their ``.pth`` files, e.g. an editable install's finder, are processed by
    ``model.py`` through ``site.addsitedir``)."""
    dirs = [str(Path(__file__).resolve().parents[3])] + list(site.getsitepackages())
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


def _tensors(kind: str, items) -> list[str]:
    body = ",\n".join(f"  {{ name: {_pb_string(n)} data_type: {t} dims: [ {', '.join(map(str, d))} ]"
                      f"{' optional: true' if rest and rest[0] else ''} }}" for n, t, d, *rest in items)
    return [f"{kind} [", body, "]"]


def _config_pbtxt(name: str, *, decoupled: bool, params: dict[str, str], inputs=_INPUTS, outputs=_OUTPUTS) -> str:
    lines = [f"name: {_pb_string(name)}", 'backend: "python"', "max_batch_size: 0"]
    if decoupled:
        lines.append("model_transaction_policy { decoupled: true }")
    lines += _tensors("input", inputs) + _tensors("output", outputs)
    lines.append("instance_group [ { count: 1 kind: KIND_CPU } ]")
    for k, v in params.items():
        lines.append(f"parameters {{ key: {_pb_string(k)} value: {{ string_value: {_pb_string(v)} }} }}")
    return "\n".join(lines) + "\n"


def _ensemble_pbtxt(engine: str) -> str:
    """``text_input`` -> preprocessing -> ``engine`` -> postprocessing -> ``text_output``."""
    def maps(kind, pairs):
        return [f"      {kind} {{ key: {_pb_string(k)} value: {_pb_string(v)} }}" for k, v in pairs]

    steps = [("preprocessing", maps("input_map", [(si, n) for n, *_, step, si in _ENSEMBLE_INPUTS
                                                   if step == "preprocessing"])
              + maps("output_map", [(o, f"_{o}") for o, _ in _PRE_TO_ENGINE])),
             (engine, maps("input_map", [(e, f"_{o}") for o, e in _PRE_TO_ENGINE]
                           + [(si, n) for n, *_, step, si in _ENSEMBLE_INPUTS if step == "engine"])
              + maps("output_map", [("output_ids", "_TOKENS")])),
             ("postprocessing", maps("input_map", [("TOKENS_BATCH", "_TOKENS")])
              + maps("output_map", [("OUTPUT", "text_output")]))]
    lines = ['name: "ensemble"', 'platform: "ensemble"', "max_batch_size: 0"]
    lines += _tensors("input", [(n, t, d, opt) for n, t, d, opt, *_ in _ENSEMBLE_INPUTS])
    lines += _tensors("output", [("text_output", "TYPE_STRING", (-1,))])
    lines.append("ensemble_scheduling {\n  step [")
    lines.append(",\n".join(f"    {{\n      model_name: {_pb_string(m)}\n      model_version: -1\n"
                            + "\n".join(body) + "\n    }" for m, body in steps))
    lines.append("  ]\n}")
    return "\n".join(lines) + "\n"


def _find_tokenizer(tokenizer_dir, hf_dir: Path) -> Path | None:
    if tokenizer_dir is not None:
        path = Path(tokenizer_dir).resolve()
        if not any((path / f).is_file() for f in ("tokenizer_config.json", "tokenizer.json")):
            raise FileNotFoundError(f"tokenizer_dir {path} holds neither tokenizer_config.json nor tokenizer.json")
        return path
    return hf_dir.resolve() if any((hf_dir / f).is_file() for f in ("tokenizer_config.json", "tokenizer.json")) \
        else None


def write_model_repository(engine_dir: str | Path, out: str | Path, *, engine_args: EngineArgs | None = None,
                           name: str = "macattn", torch_num_threads: int = 0, sys_path: list[str] | None = None,
                           sync_model: bool = True, tokenizer_dir: str | Path | None = None) -> list[Path]:
    """Write the repository; returns the model directories. ``engine_args``: the engine the models run
    (``EngineArgs``; None = the defaults) — its ``model`` is set to the engine's ``hf/`` and, for MAC without a
    ``mac`` of its own, its ``mac`` to the engine's MAC config (explicit ``mac_tau`` / ``mac_window`` /
    ``mac_band`` still apply on top); the models read it back as the one ``engine_args`` parameter.
    ``tokenizer_dir``: the text models' tokenizer (None: the engine's ``hf/`` when it holds one; without
    any, only the token-id models are written)."""
    engine_dir = Path(engine_dir).resolve()
    manifest = read_engine_dir(engine_dir)          # fails early on a bad engine dir
    args = engine_args or EngineArgs()
    if not isinstance(args, EngineArgs):
        raise TypeError(f"engine_args must be an EngineArgs, got {type(args).__name__}")
    args = replace(args, model=str(manifest.hf_dir.resolve()),
                   mac=manifest.mac_config.to_dict() if args.method == "mac" and args.mac is None else args.mac)
    if not name or not all(c.isalnum() or c in "_-" for c in name):
        raise ValueError(f"name must be non-empty and use only letters, digits, '_' and '-', got {name!r}")
    params = {
        "engine_args": args.to_json(),
        "sys_path": json.dumps(sys_path if sys_path is not None else default_sys_path()),
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
    tok = _find_tokenizer(tokenizer_dir, manifest.hf_dir)
    if tok is None:
        return written
    for role, ins, outs in (("preprocessing", _PRE_INPUTS, _PRE_OUTPUTS), ("postprocessing", _POST_INPUTS, _POST_OUTPUTS)):
        d = out / role
        (d / "1").mkdir(parents=True, exist_ok=True)
        text_params = {"role": role, "tokenizer_dir": str(tok), "sys_path": params["sys_path"]}
        (d / "config.pbtxt").write_text(_config_pbtxt(role, decoupled=False, params=text_params, inputs=ins,
                                                      outputs=outs))
        shutil.copyfile(src, d / "1" / "model.py")
        written.append(d)
    d = out / "ensemble"
    (d / "1").mkdir(parents=True, exist_ok=True)
    (d / "config.pbtxt").write_text(_ensemble_pbtxt(name))
    written.append(d)
    return written
