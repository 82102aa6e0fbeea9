"""The engine directory layout shared with ``macattn build``:

    DIR/manifest.json   {"family": ..., "hf_config": {...}, "mac_config": MacConfig.to_dict(), ...}
    DIR/hf/             transformers ``save_pretrained`` weights + config
    DIR/decode.onnx, DIR/prefill.onnx   (exported graphs; not read by the CPU runtime)

Reading is tolerant: unknown keys are ignored, the MAC config may sit under
``mac_config`` or ``mac`` and may carry fields this version does not know (dropped with
their names kept in ``EngineManifest.ignored``); every field this version knows is read
(``MacConfig.from_dict``).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path

from macattn.methods.mac.config import MacConfig

__all__ = ["EngineManifest", "read_engine_dir", "write_engine_dir"]

_MAC_FIELDS = tuple(f.name for f in fields(MacConfig))


@dataclass(frozen=True)
class EngineManifest:
    path: Path
    family: str | None
    mac_config: MacConfig
    hf_dir: Path
    raw: dict = field(repr=False, default_factory=dict)
    ignored: tuple = ()


def read_engine_dir(path: str | Path) -> EngineManifest:
    path = Path(path)
    mf = path / "manifest.json"
    if not mf.is_file():
        raise FileNotFoundError(f"{path} is not an engine directory: {mf} is missing")
    raw = json.loads(mf.read_text())
    if not isinstance(raw, dict):
        raise ValueError(f"{mf} must hold a JSON object")
    hf_dir = path / "hf"
    if not (hf_dir / "config.json").is_file():
        raise FileNotFoundError(f"{path} has no transformers weights: {hf_dir / 'config.json'} is missing")
    mac_raw = raw.get("mac_config", raw.get("mac"))
    ignored: tuple = ()
    if mac_raw is None:
        mac = MacConfig()
    else:
        if not isinstance(mac_raw, dict):
            raise ValueError(f"{mf}: mac_config must be an object, got {type(mac_raw).__name__}")
        ignored = tuple(sorted(set(mac_raw) - set(_MAC_FIELDS)))
        mac = MacConfig.from_dict({k: v for k, v in mac_raw.items() if k in _MAC_FIELDS})
    family = raw.get("family", raw.get("model_family"))
    return EngineManifest(path, family, mac, hf_dir, raw, ignored)


def write_engine_dir(model, mac_config: MacConfig, path: str | Path, *, family: str | None = None,
                     extra: dict | None = None) -> Path:
    """Write the manifest and ``hf/`` weights of ``model`` (no ONNX graphs; ``macattn build``
    adds those). Used by tests and by ``ModelRunner`` users without the exporter."""
    path = Path(path)
    (path / "hf").mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path / "hf")
    family = family or model.config.model_type
    manifest = {"format": "macattn-engine", "version": 1, "family": family,
                "architecture": type(model).__name__, "hf_config": model.config.to_dict(),
                "mac_config": mac_config.to_dict(), **(extra or {})}
    (path / "manifest.json").write_text(json.dumps(manifest, indent=2, default=str) + "\n")
    return path
