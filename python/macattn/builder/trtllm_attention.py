"""MAC inside TensorRT-LLM's decoder graph: the extra network I/O and the ``Attention`` subclass.

Two halves:

* Pure functions, tested without TensorRT-LLM: :func:`mac_network_io` (per MAC layer the ring
  inputs/outputs, dtypes, shapes and dimension ranges; the per-step inputs shared by all
  layers), :func:`dim_range` (that spec as TRT-LLM's ``Tensor(dim_range=...)`` argument),
  :func:`rope_tables` (the rotary table the graph uses to rotate the pre-RoPE query) and
  :func:`plugin_fields` / :func:`layer_plugin_fields` (the plugins' attributes per layer, which
  ``trtllm_build`` re-exports).
* :func:`make_mac_attention`, which defines the subclass of ``tensorrt_llm.layers.Attention``
  whose ``forward`` inserts ``mac::match`` / ``mac::attend``. Written against TRT-LLM sources
  (see ``docs/tensorrt.md`` "TensorRT-LLM" for the files and commits read) and **never built or
  run**: TensorRT-LLM cannot be installed in this workplace.

What the patched network computes, per MAC-enabled layer (docs/spec.md §1, ``docs/graph.md``):
TRT-LLM's own ``gpt_attention`` plugin runs first, for every token, unchanged (context phase,
KV-cache write of the new token, RoPE). Then, for the ``G`` generation tokens listed in the
step input ``mac_rows``, the layer takes the pre-RoPE query from the fused ``qkv`` (the first
``Hq * d`` columns, as TRT-LLM splits it), rotates it with :func:`rope_tables` for ``q``,
gathers those requests' K/V rows from the plugin's ``present_key_value``, calls
``mac::match`` then ``mac::attend`` and scatters the ``G`` outputs over the plugin's context
rows before the ``dense`` projection. Context-phase tokens and MAC-disabled layers keep
TRT-LLM's output. ``G = 0`` (a context-only step) leaves the network's output equal to
TRT-LLM's and the rings untouched.

What TRT-LLM's own runtime does NOT do: it does not know these inputs. ``GenerationSession`` /
the executor would not feed ``mac_rows``, ``mac_positions``, ``mac_slots`` or the rings, nor
keep the rings between steps, so the engine must be driven by a runtime that binds them
(ours, or a TRT-LLM runtime extension) — the ring outputs alias the ring inputs (bind one
buffer to each ``name`` / ``name.out`` pair).

KV layout assumed: the **contiguous** (non-paged) KV cache, ``present_key_value`` of shape
``[B, 2, Hkv, T, d]`` per layer, post-RoPE K, in the model dtype (no int8/fp8 KV). In paged
mode the gpt_attention plugin's KV lives in TRT-LLM's block pool addressed by
``kv_cache_block_pointers`` / ``kv_cache_block_offsets`` and no contiguous per-layer K/V
tensor exists in the graph, so
``mac::attend`` cannot be handed it: the forward refuses paged KV at build time (build with
TRT-LLM's contiguous KV option). Contiguous KV in TRT-LLM means static batching, where the
generation token of request ``b`` is token row ``b``: ``mac_rows`` indexes both the token
dimension and the KV batch dimension.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from macattn.methods.mac.config import MacConfig
from macattn.plugins.trt_compat import python_id, split_id

__all__ = ["create_plugin", "global_layer_index", "RING_NAMES", "STEP_INPUTS", "IOTensor", "RingIO", "MacNetworkIO", "mac_network_io", "dim_range",
           "rope_tables", "make_mac_attention", "MATCH_ID", "ATTEND_ID", "plugin_fields", "layer_plugin_fields"]

MATCH_ID, ATTEND_ID = python_id("match"), python_id("attend")

RING_NAMES = ("qring", "oring", "ring_lse", "ring_pos")
# Per-step inputs shared by every MAC layer: (name, dtype). G = generation tokens this step.
STEP_INPUTS = (("mac_rows", torch.int32), ("mac_positions", torch.int64), ("mac_slots", torch.int64))
_MODEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _pos_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value


@dataclass(frozen=True)
class IOTensor:
    """One network tensor: ``shape`` has ``-1`` where ``dims`` names a dynamic dimension;
    ``ranges[i]`` is ``(min, opt, max)`` of dimension ``i`` (``(n, n, n)`` when static)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    dims: tuple[str, ...]
    ranges: tuple[tuple[int, int, int], ...]


@dataclass(frozen=True)
class RingIO:
    """One layer's ring pair: network input ``inp`` and output ``out`` (``<name>.<layer>.out``),
    same shape and dtype; ``mac::attend`` aliases ``out`` to ``inp``."""

    layer: int
    ring: str
    inp: IOTensor
    out: IOTensor


@dataclass(frozen=True)
class MacNetworkIO:
    """Extra I/O of the patched network: step inputs, then per MAC layer its four rings in
    ``RING_NAMES`` order. Disabled layers have no rings."""

    step_inputs: tuple[IOTensor, ...]
    rings: tuple[RingIO, ...]

    def layer_rings(self, layer: int) -> dict[str, RingIO]:
        return {r.ring: r for r in self.rings if r.layer == layer}

    @property
    def inputs(self) -> tuple[IOTensor, ...]:
        return self.step_inputs + tuple(r.inp for r in self.rings)

    @property
    def outputs(self) -> tuple[IOTensor, ...]:
        return tuple(r.out for r in self.rings)


def mac_network_io(cfg: MacConfig, num_layers: int, *, max_batch: int, num_heads: int, head_dim: int,
                   dtype: torch.dtype, max_slots: int | None = None) -> MacNetworkIO:
    """The extra inputs/outputs of the MAC-patched TRT-LLM network.

    Step inputs: ``mac_rows [G] int32`` (token row = KV batch row of each generation token),
    ``mac_positions [G] int64`` (its position ``m``: the KV row the gpt_attention plugin just
    wrote), ``mac_slots [G] int64`` (its ring row). ``G`` ranges over ``[0, max_batch]``.

    Rings of MAC layer ``l`` with window ``K = cfg.for_layer(l).window`` (``docs/graph.md``):
    ``qring.l [S, Hq, K, d]`` in the model ``dtype``, ``oring.l [S, Hq, K, d]`` float32,
    ``ring_lse.l [S, Hq, K]`` float32, ``ring_pos.l [S, K]`` int64, each with an output
    ``<name>.l.out`` of the same shape and dtype; ``S`` (``num_slots``) ranges over
    ``[1, max_slots]`` (default ``max_batch``). ``num_heads`` is ``Hq`` of one tensor-parallel
    rank, ``head_dim`` is ``d``.
    """
    if not isinstance(cfg, MacConfig):
        raise TypeError(f"cfg must be a MacConfig, got {type(cfg).__name__}")
    cfg.require_from_first_step("the TensorRT-LLM attention swap")
    _pos_int("num_layers", num_layers)
    _pos_int("max_batch", max_batch)
    _pos_int("num_heads", num_heads)
    _pos_int("head_dim", head_dim)
    max_slots = max_batch if max_slots is None else _pos_int("max_slots", max_slots)
    if max_slots < max_batch:
        raise ValueError(f"max_slots must be >= max_batch ({max_batch}): each generation token owns a ring row, "
                         f"got {max_slots}")
    if dtype not in _MODEL_DTYPES:
        raise TypeError(f"dtype must be float32/float16/bfloat16 (the model dtype), got {dtype}")
    g = (0, max(1, max_batch // 2), max_batch)
    s = (1, max_batch, max_slots)
    step = tuple(IOTensor(name, dt, (-1,), ("mac_tokens",), (g,)) for name, dt in STEP_INPUTS)
    rings = []
    for layer in range(num_layers):
        p = cfg.for_layer(layer)
        if not p.enabled:
            continue
        K, H, d = p.window, num_heads, head_dim
        # TRT-LLM keeps one range per dimension name across the network: layers may differ (per-layer
        # windows), so each layer's static dims carry the layer index
        h, w, dd = f"heads.{layer}", f"window.{layer}", f"head_dim.{layer}"
        specs = {"qring": (dtype, (H, K, d), (h, w, dd)),
                 "oring": (torch.float32, (H, K, d), (h, w, dd)),
                 "ring_lse": (torch.float32, (H, K), (h, w)),
                 "ring_pos": (torch.int64, (K,), (w,))}
        for ring in RING_NAMES:
            dt, static, names = specs[ring]
            shape = (-1, *static)
            dims = ("num_slots", *names)
            ranges = (s, *((n, n, n) for n in static))
            rings.append(RingIO(layer, ring, IOTensor(f"{ring}.{layer}", dt, shape, dims, ranges),
                                IOTensor(f"{ring}.{layer}.out", dt, shape, dims, ranges)))
    return MacNetworkIO(step, tuple(rings))


def dim_range(t: IOTensor, num_profiles: int) -> OrderedDict:
    """``t`` as TRT-LLM's ``Tensor(dim_range=...)``: ``{dim name: [per profile]}``, each entry
    ``[min, opt, max]`` for a dynamic dimension, the size for a static one, repeated over the
    network's ``num_profiles`` optimization profiles (TRT-LLM requires every input to list the
    same number of profiles)."""
    _pos_int("num_profiles", num_profiles)
    out = OrderedDict()
    for size, name, rng in zip(t.shape, t.dims, t.ranges):
        out[name] = [list(rng) if size == -1 else size] * num_profiles
    return out


def rope_tables(head_dim: int, max_positions: int, base: float, scale: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """``(cos, sin_signed)`` float32 ``[max_positions, head_dim]`` for the rotate-half RoPE of
    LLaMA / Qwen2 / Mistral (what TRT-LLM's gpt_attention applies with ``rope_gpt_neox``),
    with linear position scaling ``pos / scale``.

    ``rope(q)[m] = q * cos[m] + swap_halves(q) * sin_signed[m]`` where ``swap_halves`` exchanges
    the two halves of the last dimension and ``sin_signed = [-sin, sin]`` carries rotate-half's
    sign, so the graph needs only slices, a concat and elementwise ops.
    """
    _pos_int("head_dim", head_dim)
    _pos_int("max_positions", max_positions)
    if head_dim % 2:
        raise ValueError(f"head_dim must be even for rotary embedding, got {head_dim}")
    if not (isinstance(base, (int, float)) and math.isfinite(base) and base > 1.0):
        raise ValueError(f"base must be a finite float > 1, got {base!r}")
    if not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale >= 1.0):
        raise ValueError(f"scale must be a finite float >= 1 (linear RoPE scaling), got {scale!r}")
    inv_freq = 1.0 / (float(base) ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    ang = np.outer(np.arange(max_positions, dtype=np.float64) / float(scale), inv_freq)
    cos, sin = np.cos(ang), np.sin(ang)
    return (np.concatenate([cos, cos], axis=1).astype(np.float32),
            np.concatenate([-sin, sin], axis=1).astype(np.float32))


def plugin_fields(cfg, head_dim: int) -> dict[str, dict[str, float | int]]:
    """Plugin attributes for one layer: ``{"mac_py::match": {band, tau}, "mac_py::attend": {band, scale}}``.

    Names match ``plugins/mac/match_plugin.py`` and ``plugins/mac/attend_plugin.py``; ``scale`` is
    the softmax scale ``1/sqrt(head_dim)``. ``window`` is not an attribute: it is the ring's
    ``K`` dimension.
    """
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 1:
        raise ValueError(f"head_dim must be an int >= 1, got {head_dim!r}")
    if cfg.match_scale:
        raise ValueError("match_scale (the calibrated threshold) is not in the TensorRT-LLM attention swap, whose "
                         "graph feeds the plugin the raw pre-RoPE query; accepted: match_scale=() (the paper's rule)")
    # field order = the plugins' registration order: upstream's AOT plugin passes attributes positionally
    return {MATCH_ID: {"band": int(cfg.band), "tau": float(cfg.tau)},
            ATTEND_ID: {"band": int(cfg.band), "scale": float(head_dim) ** -0.5}}


def layer_plugin_fields(cfg: MacConfig, num_layers: int, head_dim: int) -> list[dict | None]:
    """Per-layer :func:`plugin_fields`; ``None`` where the layer has MAC disabled (plain attention)."""
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"num_layers must be an int >= 1, got {num_layers!r}")
    out = []
    for layer in range(num_layers):
        p = cfg.for_layer(layer)
        out.append(plugin_fields(p, head_dim) if p.enabled else None)
    return out


def create_plugin(trt, creator, plugin_id: str, fields: dict, *, aot: bool = True):
    """A BUILD-phase plugin of ``plugin_id`` from ``creator`` with ``fields`` (int -> INT32, float -> FLOAT32).

    The Python plugins' creators (``IPluginCreatorV3Quick``, what ``register_all`` puts in the registry) take
    ``create_plugin(name, namespace, fields, phase, request)``; ``request`` = ``STRICT_AOT`` (``aot``) or
    ``STRICT_JIT``: they define both impls and refuse to choose without one. A native ``IPluginCreatorV3One``
    (``libmacattn_trt.so``) takes ``create_plugin(name, fields, phase)``. ``fields`` must be in registration
    order (``band`` first): upstream's AOT plugin hands attributes to ``aot_impl`` positionally."""
    namespace, name = split_id(plugin_id)
    pf = []
    for key, val in fields.items():
        if isinstance(val, int):
            pf.append(trt.PluginField(key, np.array([val], np.int32), trt.PluginFieldType.INT32))
        else:
            pf.append(trt.PluginField(key, np.array([val], np.float32), trt.PluginFieldType.FLOAT32))
    fc = trt.PluginFieldCollection(pf)
    if isinstance(creator, trt.IPluginCreatorV3Quick):
        Q = trt.QuickPluginCreationRequest
        return creator.create_plugin(name, namespace, fc, trt.TensorRTPhase.BUILD, Q.STRICT_AOT if aot else Q.STRICT_JIT)
    return creator.create_plugin(name, fc, trt.TensorRTPhase.BUILD)


def global_layer_index(local_layer_idx: int, first_layer: int) -> int:
    """The model-wide layer index of a TRT-LLM ``Attention`` whose ``local_layer_idx`` counts from the first
    layer ``first_layer`` of its pipeline stage (``Mapping.pp_layers(num_layers)[0]``; 0 without pipeline
    parallelism)."""
    for name, v in (("local_layer_idx", local_layer_idx), ("first_layer", first_layer)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{name} must be an int >= 0, got {v!r}")
    return first_layer + local_layer_idx


def make_mac_attention(base, cfg: MacConfig, creators: dict, *, max_batch: int, first_layer: int = 0):
    """Subclass of TRT-LLM's ``Attention`` (``base``) inserting the MAC plugins; see the module
    docstring for the graph. ``creators`` maps ``MATCH_ID`` / ``ATTEND_ID`` (``"mac_py::match"`` /
    ``"mac_py::attend"``, what ``register_all`` registers) to their creators from TensorRT's registry; ``max_batch`` is the build's
    ``--max_batch_size`` (bounds ``G`` and ``S``). Needs ``tensorrt`` and ``tensorrt_llm``.
    Written against TRT-LLM sources, never built or run here.
    """
    _pos_int("max_batch", max_batch)
    cfg.require_from_first_step("the TensorRT-LLM attention swap")
    import tensorrt as trt
    from tensorrt_llm import functional as F
    from tensorrt_llm._common import default_net, default_trtnet
    from tensorrt_llm.layers import attention as attention_mod

    to_trt = {torch.float32: trt.float32, torch.float16: trt.float16, torch.bfloat16: trt.bfloat16,
              torch.int32: trt.int32, torch.int64: trt.int64}
    from_trt = {v: k for k, v in to_trt.items()}

    def _add_plugin(pid: str, fields: dict, inputs: Sequence) -> list:
        plugin = create_plugin(trt, creators[pid], pid, fields, aot=True)
        layer = default_trtnet().add_plugin_v3([t.trt_tensor for t in inputs], [], plugin)
        return [F._create_tensor(layer.get_output(i), layer) for i in range(layer.num_outputs)]

    def _network_input(t: IOTensor):
        net = default_net()
        known = getattr(net, "_macattn_inputs", None)
        if known is None:
            known = net._macattn_inputs = {}
        if t.name not in known:
            # every TRT-LLM input lists the same number of optimization profiles
            profiles = max(1, max((len(x.profiles) for x in net.get_inputs()), default=1))
            known[t.name] = F.Tensor(name=t.name, dtype=to_trt[t.dtype], shape=list(t.shape),
                                     dim_range=dim_range(t, profiles))
        return known[t.name]

    def _rope_constants(d: int, max_pos: int, rope_base: float, scale: float):
        # one [max_pos, d] pair per network, shared by all layers (it is large at 128K positions)
        net = default_net()
        cache = getattr(net, "_macattn_rope", None)
        if cache is None:
            cache = net._macattn_rope = {}
        key = (d, max_pos, rope_base, scale)
        if key not in cache:
            cache[key] = tuple(F.constant(t) for t in rope_tables(d, max_pos, rope_base, scale))
        return cache[key]

    class MacAttention(base):
        mac_config = cfg
        _built_layers = [0]   # fallback layer counter for Attention versions without a layer index

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            local = getattr(self, "local_layer_idx", getattr(self, "layer_idx", None))
            if local is None:
                local = MacAttention._built_layers[0]
                MacAttention._built_layers[0] += 1
            # local_layer_idx counts within this pipeline stage: the config is per global layer
            self.mac_layer = global_layer_index(int(local), first_layer)
            self.mac_fields = (plugin_fields(cfg.for_layer(self.mac_layer), self.attention_head_size)
                               if cfg.for_layer(self.mac_layer).enabled else None)

        def forward(self, hidden_states, *args, **kwargs):
            if self.mac_fields is None:
                return super().forward(hidden_states, *args, **kwargs)
            self._mac_check()
            original = attention_mod.gpt_attention

            def gpt_attention_with_mac(*a, **kw):
                context, present = original(*a, **kw)
                qkv = kw.get("qkv", kw.get("tensor", a[0] if a else None))
                return self._mac_merge(qkv, context, present), present

            attention_mod.gpt_attention = gpt_attention_with_mac
            try:
                return super().forward(hidden_states, *args, **kwargs)
            finally:
                attention_mod.gpt_attention = original

        def _mac_check(self):
            pc = default_net().plugin_config
            if not pc.gpt_attention_plugin:
                raise ValueError("MAC needs TRT-LLM's gpt_attention plugin (it writes the KV cache and applies RoPE)")
            kv_type = str(getattr(pc, "kv_cache_type", "")).lower()
            if getattr(pc, "paged_kv_cache", False) or "paged" in kv_type:
                raise ValueError("MAC reads the layer's contiguous K/V (present_key_value [B, 2, Hkv, T, d]); "
                                 "TRT-LLM's paged KV cache exposes no such tensor: build with contiguous KV")
            if self.quant_mode.has_kv_cache_quant():
                raise ValueError("MAC needs the KV cache in the model dtype (no int8/fp8 KV cache)")
            if getattr(self, "q_scaling", 1) != 1:
                raise ValueError(f"MAC's softmax scale is 1/sqrt(head_dim); this layer has q_scaling={self.q_scaling}")
            if not self.position_embedding_type.is_rope() or self.rotary_embedding_dim != self.attention_head_size:
                raise ValueError("MAC needs full-width rotary embedding (LLaMA / Qwen2 / Mistral)")
            scale_type = str(self.rotary_embedding_scale_type).split(".")[-1].lower()
            if scale_type not in ("none", "linear"):
                raise ValueError(f"RoPE scaling {scale_type!r} is not supported by the MAC query rotation "
                                 "(none / linear only)")

        def _mac_merge(self, qkv, context, present):
            if present is None:
                raise ValueError("gpt_attention returned no present_key_value (paged KV?): MAC needs contiguous KV")
            H, Hkv, d = self.num_attention_heads, self.num_attention_kv_heads, self.attention_head_size
            model_dtype = from_trt[context.dtype]
            io = mac_network_io(cfg, self.mac_layer + 1, max_batch=max_batch, num_heads=H, head_dim=d,
                                dtype=model_dtype)
            rows, positions, slots = (_network_input(t) for t in io.step_inputs)
            rings = io.layer_rings(self.mac_layer)
            qring, oring, ring_lse, ring_pos = (_network_input(rings[n].inp) for n in RING_NAMES)

            # pre-RoPE query of the G generation tokens: first H*d columns of the fused qkv
            qkv2 = qkv.view(F.concat([-1, F.shape(qkv, qkv.rank() - 1)]))
            q_pre = F.index_select(qkv2, 0, rows)
            q_pre = F.slice(q_pre, F.concat([0, 0]), F.concat([F.shape(q_pre, 0), H * d]))
            q_pre = q_pre.view(F.concat([F.shape(q_pre, 0), H, d]))
            # post-RoPE query (what the gpt_attention plugin uses internally and does not output)
            linear = "linear" in str(self.rotary_embedding_scale_type).lower()
            scale = float(self.rotary_embedding_scale) if linear else 1.0
            cos, sin_s = _rope_constants(d, int(self.max_position_embeddings), float(self.rotary_embedding_base), scale)
            pos32 = F.cast(positions, "int32")
            cos_m = F.index_select(cos, 0, pos32).view(F.concat([F.shape(pos32, 0), 1, d]))
            sin_m = F.index_select(sin_s, 0, pos32).view(F.concat([F.shape(pos32, 0), 1, d]))
            q32 = F.cast(q_pre, "float32")
            lo, hi = F.split(q32, [d // 2, d // 2], dim=2)
            q = F.cast(q32 * cos_m + F.concat([hi, lo], dim=2) * sin_m, context.dtype)
            # K/V rows of those requests from the contiguous cache [B, 2, Hkv, T, d]
            kv = F.index_select(present, 0, rows)
            k, v = F.split(kv, 1, dim=1)
            kv_shape = F.concat([F.shape(kv, 0), Hkv, F.shape(kv, 3), d])
            k, v = k.view(kv_shape), v.view(kv_shape)

            match_pos, _dist = _add_plugin(MATCH_ID, self.mac_fields[MATCH_ID],
                                           [q_pre, qring, ring_lse, ring_pos, slots, positions])
            out, *ring_outs = _add_plugin(ATTEND_ID, self.mac_fields[ATTEND_ID],
                                          [q, q_pre, k, v, positions, match_pos, slots, qring, oring, ring_lse,
                                           ring_pos])
            for name, t in zip(RING_NAMES, ring_outs):
                spec = rings[name].out
                t.mark_output(spec.name, to_trt[spec.dtype])

            # MAC rows replace the plugin's rows for the generation tokens; others stay TRT-LLM's
            ctx2 = context.view(F.concat([-1, H * d]))
            upd = out.view(F.concat([F.shape(out, 0), H * d]))
            idx = F.unsqueeze(rows, 1)
            layer = default_trtnet().add_scatter(ctx2.trt_tensor, idx.trt_tensor, upd.trt_tensor, trt.ScatterMode.ND)
            merged = F._create_tensor(layer.get_output(0), layer)
            return merged.view(F.shape(context))

    return MacAttention
