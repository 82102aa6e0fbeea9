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
  (FastMKA's fused K/V inputs);
* the GPU decode hooks (sglang's attention-backend CUDA-graph state, vLLM v1's
  ``AttentionMetadataBuilder``): ``decode_plans`` builds the method's ``DecodePlans`` of one batch
  bucket (read by its ``decode`` through ``StepContext.paged``), ``decode_graph_key`` adds to the key of
  the captured variant a step replays, ``record_decode_step`` appends device work to the captured step,
  ``decode_step_done`` runs on the host after it; ``request_metrics_part`` / ``combine_request_metrics``
  merge a request's figures over tensor-parallel ranks; ``default_config`` / ``engine_config`` give the
  config the engine runs it with. The runtime names no method: it calls these.

The transformers integration (``macattn.models.attention``) calls ``prefill`` / ``decode``; the
runtime calls the rest.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Hashable, Mapping, Protocol, Sequence, runtime_checkable

import torch

__all__ = ["Capabilities", "ModelDims", "StepContext", "PerSlotState", "AttentionMethod", "FallbackAttention",
           "DecodeGeometry", "DecodeRows", "DecodePlans", "FullDecodePlans"]


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
    prefix_caching: a request may start from cached KV blocks of a shared prompt prefix and prefill only
    the rest (``RuntimeConfig.enable_prefix_caching``): its prefill-time state then equals a fresh
    prefill's provided the last ``prefix_recompute_tokens(prompt_len)`` prompt tokens are computed. A method without it
    is refused by name when prefix caching is asked for.
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
    prefix_caching: bool = False


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
    paged: the bound method's ``DecodePlans`` of the runtime's GPU decode bucket (``decode_plans``):
    key/value reaching the attention are then the paged pool ``[num_blocks, block_size, Hkv, d]``.
    rings: per-layer MAC ring tensors passed explicitly (graph export) instead of the state's.
    prefill: the runtime's packed prefill (``macattn.core.ragged.RaggedPrefill``): the call's tokens
    are several requests' prompt chunks back to back (``B = 1``); key/value reaching the attention are
    the call's own tokens, and earlier chunks' K/V come from the paged pool through it.
    """

    slots: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    paged: DecodePlans | None = None
    rings: Any = None
    prefill: Any = None


@runtime_checkable
class PerSlotState(Protocol):
    """Anything with ``num_slots`` rows that can be emptied per slot (registered with the
    runtime's slot registry, which resets a slot on admission and on release). Optionally
    ``copy(src, dst)``: copy slot ``src``'s rows into slot ``dst`` (a forked request, ``n > 1``, continues
    from its parent's state; the engine refuses ``n > 1`` over a state without it)."""

    num_slots: int

    def reset(self, slot: int) -> None: ...


@dataclass(frozen=True)
class DecodeGeometry:
    """What one batch bucket of the runtime's GPU decode (``runtime/cuda_decode.py``) is made for:
    ``batch_size`` rows ``nb`` (padding rows included), positions ``m < max_context``, the paged KV
    pool's ``page_size``, the (rank's) ``num_q_heads`` / ``num_kv_heads`` of ``head_dim``, the query
    and KV ``dtype``, the ``device``."""

    batch_size: int
    max_context: int
    page_size: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device


@dataclass(frozen=True, eq=False)
class DecodeRows:
    """A batch bucket's static device tensors, rewritten by the runtime before every step (one copy)
    and read by its captured step: a ``DecodePlans`` keeps these references, never copies.

    positions ``[nb]`` int64: each row's decode position ``m`` (0 on padding rows);
    slots ``[nb]`` int64: the rows' per-request state slots (padding: the runtime's scratch slot);
    valid ``[nb]`` fp64: 1 on a request's row, 0 on padding (weights of per-step statistics);
    page_table ``[nb, max_pages]`` int32: each row's KV block ids (padding: the scratch block);
    scratch_slot: the runtime's scratch state slot (padding rows' ``slots``), never handed to a request: what a
    step writes there no request reads.
    """

    positions: torch.Tensor
    slots: torch.Tensor
    valid: torch.Tensor
    page_table: torch.Tensor
    scratch_slot: int


class DecodePlans:
    """A method's decode metadata for one batch bucket of the runtime's GPU decode (``StepContext.paged``).

    Made once per bucket by ``AttentionMethod.decode_plans``, outside any graph capture (scratch
    allocated, launch parameters picked there), then read by every layer's ``decode`` in every step of
    the bucket, eager or captured (once per variant) and replayed: what it launches neither synchronises
    with the host nor takes host values per step; the step's values come from ``rows``.

    The calls the methods make (a subclass implements those its method calls): key/value reaching
    ``decode`` are the paged pool ``k_pages / v_pages`` ``[num_blocks, page_size, Hkv, d]``; ``q`` /
    ``q_pre`` ``[nb, Hq, d]`` the layer's post-RoPE / pre-RoPE query; ``positions`` / ``slots`` ``[nb]``
    int64 (``rows``'). Both return ``[nb, Hq, d]`` in ``q``'s dtype.
    """

    def __init__(self, geometry: DecodeGeometry, rows: DecodeRows) -> None:
        self.geometry, self.rows = geometry, rows
        # the method's decode_graph_key of the step being run, set by the runtime before every step (eager,
        # captured or replayed): a variant's launches may differ (MAC before min_context: no match)
        self.variant: Hashable = None

    @property
    def page_table(self) -> torch.Tensor:
        """``[nb, max_pages]`` int32 (``rows.page_table``)."""
        return self.rows.page_table

    def make_plan(self, *, window: int = 1, band: int = 0, tau: float | None = None, **kwargs):
        """A ``MacDecodePlan`` (``plugins/mac/decode_plan.py``: split-KV attention over the paged pool, with
        the match stages when ``tau`` is set; None: attend-only, ``run_full``) for this bucket's
        geometry; ``kwargs``: its other constructor arguments."""
        from macattn.plugins.mac.decode_plan import MacDecodePlan

        g = self.geometry
        return MacDecodePlan(batch_size=g.batch_size, max_context=g.max_context, num_q_heads=g.num_q_heads,
                             num_kv_heads=g.num_kv_heads, head_dim=g.head_dim, window=window, band=band, tau=tau,
                             page_size=g.page_size, q_dtype=g.dtype, device=g.device, **kwargs)

    def attend_full(self, q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
                    positions: torch.Tensor) -> torch.Tensor:
        """Full attention of every row over its positions ``[0, m]``."""
        raise NotImplementedError(f"{type(self).__name__} has no full-attention call")

    def attend(self, layer: int, params: Any, q: torch.Tensor, q_pre: torch.Tensor, k_pages: torch.Tensor,
               v_pages: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, rings: Any,
               sring: torch.Tensor | None = None) -> torch.Tensor:
        """The method's own attention of ``layer`` under its per-layer ``params``, reading and updating
        its per-request state of the rows' ``slots``: ``rings`` (the layer's state tensors) and ``sring``
        (an optional extra one) — MAC: match against the ring, attend, append to the ring."""
        raise NotImplementedError(f"{type(self).__name__} is attend-only: the method calls attend_full")


class FullDecodePlans(DecodePlans):
    """The attend-only plans (``AttentionMethod.decode_plans``' default: the full-attention method's):
    one ``MacDecodePlan`` without a match stage; ``attend_full`` for every layer."""

    def __init__(self, geometry: DecodeGeometry, rows: DecodeRows) -> None:
        super().__init__(geometry, rows)
        self.plan = self.make_plan()

    def attend_full(self, q, k_pages, v_pages, positions):
        return self.plan.run_full(q, k_pages, v_pages, positions, page_table=self.page_table, check=False)


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

    @classmethod
    def default_config(cls) -> Any:
        """The config the engine runs this method with when given none (default: ``config_type()``)."""
        return cls.config_type()

    @classmethod
    def engine_config(cls, config: Any = None) -> Any:
        """The config the engine runs this method with: ``config``, or ``default_config()`` when None.
        Raises ``ValueError`` naming what the engine cannot run (before anything is built); default:
        every config."""
        return cls.default_config() if config is None else config

    # --- state ------------------------------------------------------------------------------
    def slot_states(self) -> Mapping[str, PerSlotState]:
        """Per-request state to register with the runtime's slot registry (name -> state)."""
        return {}

    # --- attention (one layer of one model call) ---------------------------------------------
    def prefill(self, module, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                q_pre: torch.Tensor | None, attention_mask, scale: float, step: StepContext,
                fallback: FallbackAttention, **kwargs) -> torch.Tensor:
        """query ``[B, Hq, T, d]`` (T > 1, post-RoPE), key/value ``[B, Hkv, S, d]`` (cache
        included), q_pre ``[B, Hq, T, d]`` or None. Returns ``[B, T, Hq, d]``. Under a packed prefill
        (``step.prefill``: ``B = 1``, T >= 1, key/value this call's tokens) the plan's causal attention."""
        if step.prefill is not None:
            return step.prefill.attend(layer, query, key, value, scale)
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

    def prefix_recompute_tokens(self, prompt_len: int) -> int:
        """With ``capabilities.prefix_caching``: how many of a ``prompt_len``-token prompt's last tokens a
        prefix-cache hit must still prefill so the per-request state the prefill seeds equals a fresh prefill's
        (a hit is cut back to whole blocks before them). Default 0: the method seeds nothing from the prompt."""
        return 0

    def check_request(self, prompt_len: int, max_new_tokens: int) -> None:
        """Raise ``ValueError`` naming the limit when a request of this size cannot run (called before it
        is queued); default: every size the runtime admits."""

    def request_metrics(self, slot: int) -> dict[str, float]:
        """Figures of the request in ``slot`` at its end (read before the slot is reset; may read
        the device once)."""
        return {}

    def request_metrics_part(self, slot: int) -> Any:
        """This instance's share of ``request_metrics(slot)`` in a tensor-parallel group (a rank holds its
        heads' share of a head-sharded state): picklable, sent to rank 0, which combines every rank's
        (``combine_request_metrics``). Default: ``request_metrics(slot)``."""
        return self.request_metrics(slot)

    def combine_request_metrics(self, parts: list) -> dict[str, float]:
        """The request's figures from every rank's ``request_metrics_part`` (rank order: rank 0's
        first). Default: rank 0's."""
        return parts[0]

    def decoded(self, slots: list[int], positions: list[int]) -> None:
        """Host-side bookkeeping after a decode step of the requests in ``slots`` at ``positions``
        (called by the runtime outside any captured graph; plain ints, no device reads)."""

    # --- the runtime's GPU decode, per batch bucket --------------------------------------------
    def decode_plans(self, geometry: DecodeGeometry, rows: DecodeRows) -> DecodePlans:
        """The decode metadata of one batch bucket (``StepContext.paged`` of its steps), made once per
        bucket outside any capture (sglang's ``init_cuda_graph_state`` and capture-time metadata for that
        batch size; nothing runs per replay: the plans read ``rows`` on the device). Asked only when
        ``capabilities.paged_kv`` is set. Default: ``FullDecodePlans`` (``attend_full``)."""
        return FullDecodePlans(geometry, rows)

    def decode_graph_key(self, positions: Sequence[int]) -> Hashable:
        """This instance's part of the key of the captured variant a decode step replays, read on the
        host before every step from the step's decode ``positions`` (host ints, one per request) and its
        static settings (MAC: ``collect_diagnostics``, and whether any row has reached ``min_context``); each
        distinct value is captured once per bucket, set as the plans' ``variant`` before the step runs and
        handed to ``record_decode_step``. Default: None (one variant)."""
        return None

    def decode_in_full(self, positions: Sequence[int]) -> bool:
        """Whether this instance's decode of rows at ``positions`` (host ints) is plain causal attention over
        each row's ``[0, m]`` in the paged pool that reads and writes none of its per-request state (the K/V
        aside): such rows may ride a packed prefill call (``core.ragged.DecodeTail``, the runtime's one-forward
        mixed step) instead of a decode step of their own; the runtime then calls ``decoded`` and
        ``decode_step_done`` for them as after that step. Default: False."""
        return False

    def decode_graph_keys(self) -> tuple[Hashable, ...]:
        """Every value ``decode_graph_key`` takes under the current settings (the runtime captures each at
        start-up). Default: the key of an empty step."""
        return (self.decode_graph_key(()),)

    def record_decode_step(self, plans: DecodePlans | None, key: Hashable) -> None:
        """Device work at the end of a decode step (after the layers and the sampler), inside the
        bucket's captured graph of variant ``key`` (``decode_graph_key``): stream-ordered tensor ops only,
        no host synchronisation, reading ``plans`` (None: a method that keeps its own KV) and updating
        the method's state; padding rows have ``plans.rows.valid == 0``. Default: nothing."""

    def decode_step_done(self, plans: DecodePlans | None, batch_size: int) -> None:
        """Host-side, after a GPU decode step of the bucket of ``plans`` was launched (replayed or eager; its
        tokens are not read back yet) and ``decoded`` ran: the step's requests are the first ``batch_size``
        rows. Views of the plans' buffers, no device reads. Default: nothing."""

    # --- optional whole-request hooks ---------------------------------------------------------
    def prefill_request(self, io, seq) -> torch.Tensor | None:
        """Build request ``seq``'s prompt KV through the executor's ``io`` (``PrefillIO``) and
        return the last position's logits ``[V]``; None = the engine's ordinary prefill."""
        return None

    def release(self) -> None:
        """Give back what the method holds outside its slot states (plain-transformers rows)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config!r})"
