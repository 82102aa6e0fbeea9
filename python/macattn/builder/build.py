"""``macattn build``: patched model -> engine directory (``docs/graph.md`` § Engine directory).

Layout written (read by ``macattn.runtime.ModelRunner.from_dir``)::

    DIR/manifest.json   family, architecture, HF config, graph shapes, op names/versions,
                        MacConfig.to_dict(), files with sha256
    DIR/hf/             transformers save_pretrained (unpatched weights + config)
    DIR/decode.onnx     decode step (MacMatch / MacAttend nodes, domain macattn)
    DIR/prefill.onnx    prefill + ring seeding
    DIR/decode.plan     TensorRT engine, only where ``import tensorrt`` works

Without TensorRT the build stops after the ONNX step (success). TensorRT is never faked.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

from macattn.methods.mac.config import EXPORT_MATCH_MODES, MacConfig

__all__ = ["build_engine_dir", "TRT_MISSING_MESSAGE", "PLUGIN_LIBRARY_ENV", "tensorrt_available", "EXPORT_DTYPES",
           "DEFAULT_EXPORT_DTYPE"]

TRT_MISSING_MESSAGE = ("TensorRT not installed: wrote ONNX + manifest; build the engine on a machine with "
                       "tensorrt>=10.x")
PLUGIN_LIBRARY_ENV = "MACATTN_TRT_PLUGIN_LIBRARY"
FORMAT_VERSION = 1
# dtype of the exported graphs. bf16 is the default: it is the only activation dtype of the plugins'
# kernels (supportsFormatCombination), and TensorRT builds strongly typed (always in 11, STRONGLY_TYPED in
# 10), so an fp32 graph would need casts TensorRT may not insert, one of them in front of each aliased ring.
EXPORT_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
DEFAULT_EXPORT_DTYPE = "bf16"


def tensorrt_available() -> bool:
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        return False
    return True


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _load_model(family: str, hf_dir: str | Path | None, tiny: bool, seed: int):
    from macattn.models.builtin import FAMILIES, build_builtin_model

    if family not in FAMILIES:
        raise ValueError(f"model must be one of {FAMILIES}, got {family!r}")
    if tiny == (hf_dir is not None):
        raise ValueError("give exactly one of hf_dir (--from) and tiny (--tiny)")
    if tiny:
        return build_builtin_model(family, seed=seed)
    from transformers import AutoModelForCausalLM

    hf_dir = Path(hf_dir)
    if not (hf_dir / "config.json").is_file():
        raise ValueError(f"hf_dir must be a transformers model directory with config.json, got {hf_dir}")
    model = AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="sdpa", dtype=torch.float32)
    expected = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}[family]
    if type(model).__name__ != expected:
        raise ValueError(f"--model {family} expects {expected}, but {hf_dir} holds {type(model).__name__}")
    return model.eval()


def build_engine_dir(family: str, out: str | Path, *, mac: MacConfig, hf_dir: str | Path | None = None,
                     tiny: bool = False, seed: int = 0, progress: bool = True, max_batch: int = 8,
                     max_context: int | None = None, dtype: str = DEFAULT_EXPORT_DTYPE, log=print) -> dict:
    """Write the engine directory ``out`` and return the manifest (see the module docstring).

    ``max_batch`` / ``max_context`` bound the TensorRT optimization profiles (context
    defaults to the model's ``max_position_embeddings``). ``dtype`` (``EXPORT_DTYPES``): the graphs'
    model dtype — weights, hidden states, K/V and ``qring`` (``oring`` / ``ring_lse`` and logits stay
    fp32); ``hf/`` keeps the weights as loaded.
    """
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"dtype must be one of {tuple(EXPORT_DTYPES)}, got {dtype!r}")
    from tqdm.auto import tqdm

    from macattn.builder.export import decode_io_names, model_dims, prefill_io_names
    from macattn.builder.onnx_export import check_onnx, export_decode_onnx, export_prefill_onnx
    from macattn.builder.onnx_ops import DOMAIN, DOMAIN_VERSION, MAC_ATTEND, MAC_MATCH
    from macattn.models.attention import patch_model

    if not isinstance(mac, MacConfig):
        raise TypeError(f"mac must be a MacConfig, got {type(mac).__name__}")
    mac.require_engine_support("macattn build (the ONNX decode graph)", match_modes=EXPORT_MATCH_MODES)
    mac.require_from_first_step("macattn build (the ONNX decode graph)")
    out = Path(out)
    stages = ["load model", "save hf/", "export decode.onnx", "export prefill.onnx", "check ONNX",
              "manifest", "TensorRT engine"]
    bar = tqdm(total=len(stages), desc="macattn build", disable=not progress, unit="stage")

    def stage(i):
        bar.set_postfix_str(stages[i])

    stage(0)
    model = _load_model(family, hf_dir, tiny, seed)
    bar.update()
    stage(1)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out / "hf")          # before patching: config keeps the original attention
    model = model.to(EXPORT_DTYPES[dtype])
    bar.update()
    patch_model(model, mac, num_slots=max(2, max_batch))
    stage(2)
    dec = export_decode_onnx(model, out / "decode.onnx")
    bar.update()
    stage(3)
    pre = export_prefill_onnx(model, out / "prefill.onnx")
    bar.update()
    stage(4)
    for exp in (dec, pre):
        check_onnx(exp.path)
    bar.update()
    stage(5)
    dims = model_dims(model)
    windows = [mac.for_layer(l).window for l in range(dims["num_layers"])]
    files = sorted(p for p in out.rglob("*") if p.is_file() and p.name != "manifest.json")
    manifest = {
        "format": "macattn-engine", "version": FORMAT_VERSION, "family": family,
        "architecture": type(model).__name__, "hf_config": json.loads(model.config.to_json_string()),
        "mac_config": mac.to_dict(), "export_dtype": dtype,
        "shapes": {**dims, "windows": windows, "model_dtype": str(next(model.parameters()).dtype),
                   "dynamic_axes": ["batch", "context", "prompt", "num_slots"]},
        "ops": {"domain": DOMAIN, "domain_version": DOMAIN_VERSION,
                "onnx": {"mac_match": MAC_MATCH, "mac_attend": MAC_ATTEND},
                "tensorrt": {"mac_match": "mac::match", "mac_attend": "mac::attend", "plugin_version": "1"},
                "torch": {"mac_match": "macattn::mac_match", "mac_attend": "macattn::mac_attend"}},
        "graphs": {"decode": {"file": "decode.onnx", "inputs": decode_io_names(dims["num_layers"])[0],
                              "outputs": decode_io_names(dims["num_layers"])[1], "custom_nodes": dec.custom_nodes,
                              "opset": dec.opset},
                   "prefill": {"file": "prefill.onnx", "inputs": prefill_io_names(dims["num_layers"])[0],
                               "outputs": prefill_io_names(dims["num_layers"])[1], "opset": pre.opset}},
        "files": [{"path": str(p.relative_to(out)), "bytes": p.stat().st_size, "sha256": _sha256(p)} for p in files],
        "tensorrt": None,
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2, default=str) + "\n")
    bar.update()
    stage(6)
    if not tensorrt_available():
        bar.close()
        log(TRT_MISSING_MESSAGE)
        return manifest
    from macattn.builder.tensorrt_build import build_tensorrt_engines

    manifest["tensorrt"] = build_tensorrt_engines(out, dims, max_batch=max_batch,
                                                  max_context=max_context or model.config.max_position_embeddings,
                                                  plugin_library=os.environ.get(PLUGIN_LIBRARY_ENV))
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2, default=str) + "\n")
    bar.update()
    bar.close()
    return manifest
