"""Frozen, validated configuration for MAC-Attention (docs/spec.md §1).

``MacConfig`` holds the global defaults (window ``K``, band ``r``, threshold ``tau``, the context
``min_context`` from which MAC engages) and optional per-layer overrides; ``MacConfig.for_layer(i)``
resolves the values one layer uses as a ``LayerMacParams``.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Mapping

from macattn.core.validation import check_bool, check_choice, check_float, check_int, check_tau

__all__ = ["LayerMacParams", "MacConfig", "CONTEXT_HEAVY_TAU", "GENERATION_HEAVY_TAU", "MISS_POLICIES",
           "ENGINE_MISS_POLICIES", "MATCH_MODES", "ENGINE_MATCH_MODES", "EXPORT_MATCH_MODES", "MATCH_SKETCHES",
           "MATCH_CANDIDATES", "DEFAULT_CUDA_MIN_CONTEXT"]

CONTEXT_HEAVY_TAU = 0.45
GENERATION_HEAVY_TAU = 0.75
MISS_POLICIES = ("full", "completion")
ENGINE_MISS_POLICIES = ("full",)   # what the engine and the graph export run (the CPU reference: all)
MATCH_MODES = ("exact", "two_stage")
ENGINE_MATCH_MODES = ("exact", "two_stage")   # the runtime (GPU kernels, CPU reference)
EXPORT_MATCH_MODES = ("exact",)    # the ONNX decode graph's MacMatch node
MATCH_SKETCHES = ("fp8", "proj32", "proj16", "proj32_fp8")   # ``macattn.methods.mac.match_sketch``
MATCH_CANDIDATES = (1, 2, 4, 8, 16)   # powers of two: the kernels' candidate lists are register arrays
# The engine's MAC engages from this context on CUDA (``EngineArgs.mac_min_context=None``): the shortest context
# at which the whole decode step of MAC with 90 % of heads hitting is no slower than full attention at B >= 4,
# and with every head hitting at B = 1 (LLaMA-3.1-8B shapes, H100, K = 1024, r = 256;
# benchmarks/results/bench_e2e_crossover_h100.json: at B = 16 full / MAC 90 % 9.25 / 9.69 ms at 4K, 12.04 /
# 10.72 ms at 8K). Below it the match, which reads the whole query ring, costs more than a hit saves.
DEFAULT_CUDA_MIN_CONTEXT = 8192


@dataclass(frozen=True)
class LayerMacParams:
    """The MAC parameters one layer runs with.

    window: ring capacity ``K`` (>= 1); a match must lie in ``[m - K, m - 1]``.
    band:   rectification band ``r`` (>= 0); a hit recomputes ``[p - r + 1, m]``.
    tau:    threshold in [0, 1): hit iff ``||q~_m - q~_p|| < sqrt(2 d) (1 - tau)``.
    enabled: False makes every step a miss (ordinary full attention).
    miss_policy: what a miss computes: ``"full"`` (full attention over ``[0, m]``, the
    paper) or ``"completion"`` (Top-k retrieval + linear-attention completion of the
    prefill's mid region, docs/spec.md §3; see ``macattn.methods.completion.completion_on_miss``). Only the CPU
    reference step and ``macattn eval`` / ``macattn tune`` honour ``"completion"``; the
    runtime and ``macattn build`` reject it (``MacConfig.require_engine_support``).
    match:  ``"exact"`` (the nearest ring entry by bf16 L2 distance, the paper) or ``"two_stage"``: the
    ``match_candidates`` nearest entries under the compressed ring ``match_sketch`` (one of
    ``MATCH_SKETCHES``: E4M3 of the entry, a fixed random projection to 32 / 16 dims, or both), then
    the exact distance of those candidates and the exact threshold — an accepted match always passes
    the exact test. The runtime (the Triton kernels over a sketch ring kept by the append), the CPU
    reference and ``macattn eval`` honour it; the ONNX decode graph (``macattn build``) runs ``"exact"``.
    match_scale: the calibrated threshold (``macattn.core.threshold``): ``()`` (the default) is the paper's
    rule, radius ``sqrt(2 d) (1 - tau)``; otherwise the layer's pre-RoPE query scale ``s`` (> 0), one value
    for the layer or one per query head, and head ``h`` hits iff ``||q~_m - q~_p|| < s_h sqrt(2 d) (1 - tau)``,
    so ``tau`` is the same null false-positive rate in every layer (``macattn.evaluation.calibration``
    estimates it). Every surface honours it (MAC matches ``q~ / s``); the TensorRT-LLM attention swap refuses it.
    """

    window: int = 1024
    band: int = 256
    tau: float = CONTEXT_HEAVY_TAU
    enabled: bool = True
    miss_policy: str = "full"
    match: str = "exact"
    match_sketch: str = "fp8"
    match_candidates: int = 4
    match_scale: tuple = ()

    def __post_init__(self) -> None:
        check_int("window", self.window, 1)
        check_int("band", self.band, 0)
        check_tau("tau", self.tau)
        check_bool("enabled", self.enabled)
        check_choice("miss_policy", self.miss_policy, MISS_POLICIES)
        check_choice("match", self.match, MATCH_MODES)
        check_choice("match_sketch", self.match_sketch, MATCH_SKETCHES)
        check_choice("match_candidates", self.match_candidates, MATCH_CANDIDATES)
        object.__setattr__(self, "tau", float(self.tau))
        object.__setattr__(self, "match_scale", check_match_scale("match_scale", self.match_scale))

    def threshold(self, head_dim: int, head: int = 0) -> float:
        """The L2 acceptance radius ``s_h sqrt(2 d) (1 - tau)`` of query head ``head`` for head dimension ``d``."""
        from macattn.core.threshold import match_threshold   # (torch: not loaded with the config itself)

        s = self.match_scale
        return match_threshold(head_dim, self.tau, s[head if len(s) > 1 else 0] if s else 1.0)

    def match_scales(self, num_heads: int) -> tuple[float, ...] | None:
        """``s_h`` of each of ``num_heads`` query heads, or None for the paper's rule (every ``s_h = 1``).
        Raises ValueError if ``match_scale`` holds neither 1 nor ``num_heads`` values."""
        s = self.match_scale
        if not s:
            return None
        if len(s) not in (1, num_heads):
            raise ValueError(f"match_scale must hold 1 or num_q_heads={num_heads} values, got {len(s)}")
        return s * num_heads if len(s) == 1 else s


def check_match_scale(name: str, value: Any) -> tuple:
    """``value`` as a tuple of floats > 0 (a list, tuple or a single number; ``()`` / None = the paper's rule)."""
    if value is None:
        return ()
    items = (value,) if isinstance(value, (int, float)) and not isinstance(value, bool) else value
    if not isinstance(items, (tuple, list)):
        raise TypeError(f"{name} must be a float > 0 or a list of them (one per layer or per query head), "
                        f"got {type(value).__name__} {value!r}")
    return tuple(check_float(f"{name}[{i}]", x, 0, lo_open=True) for i, x in enumerate(items))


_LAYER_FIELDS = ("window", "band", "tau", "enabled", "miss_policy", "match", "match_sketch", "match_candidates",
                 "match_scale")
# fields a saved file leaves out at their defaults: files and engine manifests keep their old form
_DEFAULTS_LEFT_OUT = {f.name: f.default for f in fields(LayerMacParams)
                      if f.name in ("miss_policy", "match", "match_sketch", "match_candidates", "match_scale")}


@dataclass(frozen=True)
class MacConfig(LayerMacParams):
    """Global MAC parameters plus per-layer overrides.

    min_context: MAC engages at decode positions ``m >= min_context`` (every layer; 0, the default, is the
    paper: every step). A step at ``m < min_context`` attends in full over ``[0, m]`` and leaves the rings as
    they are; a prompt of ``L < min_context`` tokens seeds no ring (its first decode step, ``m = L``, is
    below), so a request that crosses ``min_context`` while decoding starts from an empty ring.
    layer_overrides: mapping ``layer index -> {field: value}`` for any field of ``LayerMacParams``
    (``window``, ``band``, ``tau``, ``enabled``, ``match_scale``, ...). Stored as a sorted tuple of
    ``(layer, ((field, value), ...))`` (values normalised, lists as tuples) so the config stays hashable.
    """

    min_context: int = 0
    layer_overrides: tuple = field(default=())

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("min_context", self.min_context, 0)
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
                resolved = LayerMacParams(**{**self._base_fields(), **fields})
            except (TypeError, ValueError) as exc:
                raise type(exc)(f"layer_overrides[{layer}]: {exc}") from None
            fields = {k: getattr(resolved, k) for k in fields}
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

    def enabled_layers(self, num_layers: int) -> tuple[int, ...]:
        """The layers of a ``num_layers``-layer model with MAC on (``for_layer(i).enabled``), in order."""
        return tuple(layer for layer in range(num_layers) if self.for_layer(layer).enabled)

    def require_engine_support(self, where: str, *, match_modes: tuple[str, ...] = ENGINE_MATCH_MODES) -> None:
        """Raise ``ValueError`` if any layer asks for a miss policy outside ``ENGINE_MISS_POLICIES`` or a
        match outside ``match_modes``: ``where`` (the engine: ``ENGINE_MATCH_MODES``; the ONNX export:
        ``EXPORT_MATCH_MODES``) runs the GPU kernels' full-attention misses only."""
        overridden = [i for i, _ in self.layer_overrides]
        for name, allowed, honoured in (("miss_policy", ENGINE_MISS_POLICIES, "the CPU reference, macattn eval and "
                                                                               "macattn tune"),
                                        ("match", match_modes, "the runtime, the CPU reference and macattn eval")):
            bad = [i for i in overridden if getattr(self.for_layer(i), name) not in allowed]
            value = getattr(self, name)
            if value in allowed and not bad:
                continue
            if value in allowed:
                value, asking = getattr(self.for_layer(bad[0]), name), f"layers {bad}"
            else:
                asking = "every layer without an override" + (f" and layers {bad}" if bad else "")
            raise ValueError(f"{name}={value!r} is honoured by {honoured} only; {where} supports {name} in "
                             f"{allowed} (asking otherwise: {asking})")

    def require_from_first_step(self, where: str) -> None:
        """Raise ``ValueError`` where ``min_context > 0``: ``where`` (the ONNX decode graph, the TensorRT-LLM
        attention swap, the evaluation harness's MAC step) runs MAC at every decode step; the runtime and
        ``MacAttention``'s own decode (``macattn generate``) honour ``min_context``."""
        if self.min_context:
            raise ValueError(f"min_context={self.min_context} is honoured by the runtime (LLM, macattn serve, "
                             f"macattn generate) only; {where} runs MAC from the first decode step: accepted "
                             f"min_context=0")

    def with_match_scales(self, scales) -> "MacConfig":
        """This config with the calibrated threshold: ``scales[l]`` (one value, or one per query head) is layer
        ``l``'s ``match_scale`` (``macattn.evaluation.calibration.calibrate_match_scales`` estimates them)."""
        return self.with_overrides({i: {"match_scale": tuple(float(x) for x in (s if isinstance(s, (list, tuple))
                                                                                  else (s,)))}
                                    for i, s in enumerate(scales)})

    def with_overrides(self, overrides: Mapping[int, Mapping[str, Any]]) -> "MacConfig":
        merged = {idx: dict(f) for idx, f in self.layer_overrides}
        for idx, f in overrides.items():
            merged.setdefault(int(idx), {}).update(f)
        return replace(self, layer_overrides=merged)

    # --- per-layer file (written by `macattn tune`, read by `macattn build` and ModelRunner)
    def engages(self, position):
        """Whether MAC matches at decode position ``m = position`` (``m >= min_context``): an int, or a tensor of
        positions (a bool tensor of the same shape). A prompt of ``L`` tokens seeds its ring iff ``engages(L)``,
        its first decode position. The one statement of the rule."""
        return position >= self.min_context

    def to_dict(self) -> dict:
        d = asdict(self)
        for name, default in {**_DEFAULTS_LEFT_OUT, "min_context": 0}.items():
            if d[name] == default:
                del d[name]
        d["layer_overrides"] = {str(i): {k: list(v) if isinstance(v, tuple) else v for k, v in f}
                                for i, f in self.layer_overrides}
        if "match_scale" in d:
            d["match_scale"] = list(d["match_scale"])
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "MacConfig":
        unknown = set(d) - set(_LAYER_FIELDS) - {"layer_overrides", "min_context"}
        if unknown:
            raise ValueError(f"unknown MacConfig fields {sorted(unknown)}")
        return cls(**d)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "MacConfig":
        return cls.from_dict(json.loads(Path(path).read_text()))
