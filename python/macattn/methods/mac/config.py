"""Frozen, validated configuration for MAC-Attention (SPEC §1).

``MacConfig`` holds the global defaults (window ``K``, band ``r``, threshold ``tau``)
and optional per-layer overrides; ``MacConfig.for_layer(i)`` resolves the values one
layer uses as a ``LayerMacParams``.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping

from macattn.core.threshold import match_threshold
from macattn.core.validation import check_bool, check_choice, check_int, check_tau

__all__ = ["LayerMacParams", "MacConfig", "CONTEXT_HEAVY_TAU", "GENERATION_HEAVY_TAU", "MISS_POLICIES",
           "ENGINE_MISS_POLICIES"]

CONTEXT_HEAVY_TAU = 0.45
GENERATION_HEAVY_TAU = 0.75
MISS_POLICIES = ("full", "completion")
ENGINE_MISS_POLICIES = ("full",)   # what the engine and the graph export run (the CPU reference: all)


@dataclass(frozen=True)
class LayerMacParams:
    """The MAC parameters one layer runs with.

    window: ring capacity ``K`` (>= 1); a match must lie in ``[m - K, m - 1]``.
    band:   rectification band ``r`` (>= 0); a hit recomputes ``[p - r + 1, m]``.
    tau:    threshold in [0, 1): hit iff ``||q~_m - q~_p|| < sqrt(2 d) (1 - tau)``.
    enabled: False makes every step a miss (ordinary full attention).
    miss_policy: what a miss computes: ``"full"`` (full attention over ``[0, m]``, the
    paper) or ``"completion"`` (Top-k retrieval + linear-attention completion of the
    prefill's mid region, SPEC §3; see ``macattn.methods.mac.completion_on_miss``). Only the CPU
    reference step and ``macattn eval`` / ``macattn tune`` honour ``"completion"``; the
    runtime and ``macattn build`` reject it (``MacConfig.require_full_misses``).
    """

    window: int = 1024
    band: int = 256
    tau: float = CONTEXT_HEAVY_TAU
    enabled: bool = True
    miss_policy: str = "full"

    def __post_init__(self) -> None:
        check_int("window", self.window, 1)
        check_int("band", self.band, 0)
        check_tau("tau", self.tau)
        check_bool("enabled", self.enabled)
        check_choice("miss_policy", self.miss_policy, MISS_POLICIES)
        object.__setattr__(self, "tau", float(self.tau))

    def threshold(self, head_dim: int) -> float:
        """The L2 acceptance radius ``sqrt(2 d) (1 - tau)`` for head dimension ``d``."""
        return match_threshold(head_dim, self.tau)


_LAYER_FIELDS = ("window", "band", "tau", "enabled", "miss_policy")


@dataclass(frozen=True)
class MacConfig(LayerMacParams):
    """Global MAC parameters plus per-layer overrides.

    layer_overrides: mapping ``layer index -> {field: value}`` for any of
    ``window``, ``band``, ``tau``, ``enabled``. Stored as a sorted tuple of
    ``(layer, ((field, value), ...))`` so the config stays hashable.
    """

    layer_overrides: tuple = field(default=())

    def __post_init__(self) -> None:
        super().__post_init__()
        raw = self.layer_overrides
        items = tuple(raw.items()) if isinstance(raw, Mapping) else raw
        if not isinstance(items, (tuple, list, type({}.items()))):
            raise TypeError("layer_overrides must be a mapping {layer: {field: value}} "
                            f"or a tuple of pairs, got {type(raw).__name__}")
        normalised = []
        for entry in items:
            if not (isinstance(entry, (tuple, list)) and len(entry) == 2):
                raise TypeError(f"layer_overrides entries must be (layer, fields) pairs, got {entry!r}")
            layer, fields = entry
            if isinstance(layer, str) and layer.isdigit():
                layer = int(layer)
            check_int("layer_overrides layer index", layer, 0)
            try:
                fields = dict(fields.items() if isinstance(fields, Mapping) else fields)
            except (TypeError, ValueError):
                raise TypeError(f"layer_overrides[{layer}] must be a mapping {{field: value}}, "
                                f"got {type(fields).__name__} {fields!r}") from None
            unknown = set(fields) - set(_LAYER_FIELDS)
            if unknown:
                raise ValueError(f"layer_overrides[{layer}] has unknown fields {sorted(unknown)}; "
                                 f"accepted: {list(_LAYER_FIELDS)}")
            # Validate by constructing the resolved layer params (names the bad field).
            try:
                LayerMacParams(**{**self._base_fields(), **fields})
            except (TypeError, ValueError) as exc:
                raise type(exc)(f"layer_overrides[{layer}]: {exc}") from None
            normalised.append((layer, tuple(sorted(fields.items()))))
        layers = [layer for layer, _ in normalised]
        if len(set(layers)) != len(layers):
            raise ValueError(f"layer_overrides names a layer twice: {sorted(layers)}")
        object.__setattr__(self, "layer_overrides", tuple(sorted(normalised)))

    def _base_fields(self) -> dict:
        return {name: getattr(self, name) for name in _LAYER_FIELDS}

    def for_layer(self, layer: int) -> LayerMacParams:
        """Resolved parameters of ``layer`` (global values with its overrides applied)."""
        check_int("layer", layer, 0)
        fields = self._base_fields()
        for idx, override in self.layer_overrides:
            if idx == layer:
                fields.update(dict(override))
        return LayerMacParams(**fields)

    def require_full_misses(self, where: str) -> None:
        """Raise ``ValueError`` if any layer asks for a miss policy outside ``ENGINE_MISS_POLICIES``:
        ``where`` (the engine, the ONNX export) runs full-attention misses only."""
        layers = sorted({0, *(i for i, _ in self.layer_overrides)})
        bad = [i for i in layers if self.for_layer(i).miss_policy not in ENGINE_MISS_POLICIES]
        if self.miss_policy not in ENGINE_MISS_POLICIES or bad:
            raise ValueError(f"miss_policy='completion' is honoured by the CPU reference, macattn eval and macattn "
                             f"tune only; {where} supports miss_policy in {ENGINE_MISS_POLICIES} "
                             f"(layers asking otherwise: {bad or 'all'})")

    def with_overrides(self, overrides: Mapping[int, Mapping[str, Any]]) -> "MacConfig":
        merged = {idx: dict(f) for idx, f in self.layer_overrides}
        for idx, f in overrides.items():
            merged.setdefault(int(idx), {}).update(f)
        return replace(self, layer_overrides=merged)

    # --- per-layer file (written by `macattn tune`, read by `macattn build` and ModelRunner)
    def to_dict(self) -> dict:
        d = asdict(self)
        if d["miss_policy"] == "full":   # the default stays out: files and engine manifests keep their old form
            del d["miss_policy"]
        d["layer_overrides"] = {str(i): dict(f) for i, f in self.layer_overrides}
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "MacConfig":
        unknown = set(d) - set(_LAYER_FIELDS) - {"layer_overrides"}
        if unknown:
            raise ValueError(f"unknown MacConfig fields {sorted(unknown)}")
        return cls(**d)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "MacConfig":
        return cls.from_dict(json.loads(Path(path).read_text()))
