"""The attention-method interface every method implements (vLLM v1's backend / metadata / impl
split, TensorRT-LLM's sparse-attention algorithms: one folder each, one registry).

A method is an ``AttentionMethod`` subclass in ``macattn/methods/<name>/backend.py``:

* class-level declarations — ``name``, ``config_type`` (its frozen config dataclass) and
  ``capabilities`` (what the engine and the exporters may do with it);
* ``__init__(config, dims, *, num_slots)`` allocates its per-request state, which
  ``slot_states()`` hands to the runtime's slot registry (reset on admission and release);
* ``prefill`` / ``decode`` compute one layer's attention for one model call, given that call's
  ``StepContext`` (the per-step metadata, set in one place by whoever runs the model);
* ``prefill_request`` (optional) replaces the engine's prefill of a whole request (A3's fused
  prefix); a method whose ``capabilities.composes`` is set runs around another method's attention
  (FastMKA's fused K/V inputs).

The transformers integration (``macattn.models.attention``) calls these; nothing else does.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Mapping, Protocol, runtime_checkable

import torch

__all__ = ["Capabilities", "ModelDims", "StepContext", "PerSlotState", "AttentionMethod", "FallbackAttention"]


@dataclass(frozen=True)
class Capabilities:
    """What a method supports; the engine, ``macattn build`` and the plugins check these.

    paged_kv: decode reads the runtime's paged KV pool (False: the method keeps its own KV rows
    in its per-request state and the model runs without a KV cache).
    cuda_graphs: the decode step has no host synchronisation and is captured per batch bucket.
    onnx_export / tensorrt_plugin: an ONNX node and a TensorRT plugin exist for its decode.
    needs_pre_rope_query: the model integration captures ``q_proj``'s output (``q~``) per layer.
    miss_policies: the values of ``miss_policy`` the engine honours (MAC only).
    prefill_only: the method changes how a request's prompt KV is built, not the decode.
    composes: the method runs around another method's attention (FastMKA's fused K/V inputs).
    head_sharded: its per-request state is per head, so a tensor-parallel rank holds (and
    computes) only its heads' share of it (``macattn.models.tensor_parallel``).
    """

    paged_kv: bool = True
    cuda_graphs: bool = False
    onnx_export: bool = False
    tensorrt_plugin: bool = False
    needs_pre_rope_query: bool = False
    miss_policies: tuple[str, ...] = ()
    prefill_only: bool = False
    composes: bool = False
    head_sharded: bool = False


@dataclass(frozen=True)
class ModelDims:
    """The attention shapes of one model: ``L`` layers, ``Hq`` / ``Hkv`` heads of dim ``d``,
    hidden size ``D``; the dtype and device its weights (and so its K/V) live in."""

    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def of(cls, model) -> "ModelDims":
        """Read off a transformers ``*ForCausalLM`` (its config and first parameter)."""
        hf = model.config
        param = next(model.parameters())
        return cls(num_layers=hf.num_hidden_layers, num_q_heads=hf.num_attention_heads,
                   num_kv_heads=hf.num_key_value_heads,
                   head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
                   hidden_size=hf.hidden_size, dtype=param.dtype, device=param.device)


@dataclass(frozen=True)
class StepContext:
    """Per-call metadata (nano-vllm's ``Context``), set in one place by the caller that runs the
    model (``ModelBinding.step``) and read by every layer of that call. Never mutated.

    slots: ``[B]`` int64 state rows of the call's requests; None = the method manages its own
    rows for plain transformers use (``model.generate``).
    positions: ``[B]`` int64 position ``m`` of each request's decode token (requests of
    different lengths, K/V padded to the longest); None = ``cache length - 1`` (unpadded).
    paged: the runtime's per-bucket decode plans (``DecodeBucket``): key/value reaching the
    attention are then the paged pool ``[num_blocks, block_size, Hkv, d]``.
    rings: per-layer MAC ring tensors passed explicitly (graph export) instead of the state's.
    """

    slots: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    paged: Any = None
    rings: Any = None


@runtime_checkable
class PerSlotState(Protocol):
    """Anything with ``num_slots`` rows that can be emptied per slot (registered with the
    runtime's slot registry, which resets a slot on admission and on release)."""

    num_slots: int

    def reset(self, slot: int) -> None: ...


FallbackAttention = Callable[..., tuple[torch.Tensor, Any]]
"""The model's own attention function (transformers' ``AttentionInterface`` signature)."""


class AttentionMethod:
    """Base class of every method (see the module docstring). Subclasses set the class
    attributes and override what they compute; defaults are plain causal attention."""

    name: ClassVar[str]
    config_type: ClassVar[type]
    capabilities: ClassVar[Capabilities] = Capabilities()

    def __init__(self, config: Any, dims: ModelDims, *, num_slots: int) -> None:
        if not isinstance(config, self.config_type):
            raise TypeError(f"config must be a {self.config_type.__name__}, got {type(config).__name__}")
        self.config, self.dims, self.num_slots = config, dims, num_slots

    # --- state ------------------------------------------------------------------------------
    def slot_states(self) -> Mapping[str, PerSlotState]:
        """Per-request state to register with the runtime's slot registry (name -> state)."""
        return {}

    # --- attention (one layer of one model call) ---------------------------------------------
    def prefill(self, module, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                q_pre: torch.Tensor | None, attention_mask, scale: float, step: StepContext,
                fallback: FallbackAttention, **kwargs) -> torch.Tensor:
        """query ``[B, Hq, T, d]`` (T > 1, post-RoPE), key/value ``[B, Hkv, S, d]`` (cache
        included), q_pre ``[B, Hq, T, d]`` or None. Returns ``[B, T, Hq, d]``."""
        out, _ = fallback(module, query, key, value, attention_mask, scaling=scale, **kwargs)
        return out

    def decode(self, module, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               q_pre: torch.Tensor | None, attention_mask, scale: float, step: StepContext,
               fallback: FallbackAttention, **kwargs) -> torch.Tensor:
        """query ``[B, Hq, 1, d]``; key/value as ``prefill`` (or the paged pool with
        ``step.paged``). Returns ``[B, 1, Hq, d]``."""
        out, _ = fallback(module, query, key, value, attention_mask, scaling=scale, **kwargs)
        return out

    def decode_capturable(self) -> bool:
        """Whether this instance's decode (its config included) runs with no host synchronisation,
        so the runtime may capture it (only asked when ``capabilities.cuda_graphs`` is set)."""
        return True

    def check_request(self, prompt_len: int, max_new_tokens: int) -> None:
        """Raise ``ValueError`` naming the limit when a request of this size cannot run (called before it
        is queued); default: every size the runtime admits."""

    def request_metrics(self, slot: int) -> dict[str, float]:
        """Figures of the request in ``slot`` at its end (read before the slot is reset; may read
        the device once)."""
        return {}

    def decoded(self, slots: list[int], positions: list[int]) -> None:
        """Host-side bookkeeping after a decode step of the requests in ``slots`` at ``positions``
        (called by the runtime outside any captured graph; plain ints, no device reads)."""

    # --- optional whole-request hooks ---------------------------------------------------------
    def prefill_request(self, io, seq) -> torch.Tensor | None:
        """Build request ``seq``'s prompt KV through the executor's ``io`` (``PrefillIO``) and
        return the last position's logits ``[V]``; None = the engine's ordinary prefill."""
        return None

    def release(self) -> None:
        """Give back what the method holds outside its slot states (plain-transformers rows)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config!r})"
