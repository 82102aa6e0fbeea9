"""Patch the installed transformers' LLaMA / Qwen2 / Mistral models in place to decode with MAC.

Nothing of transformers' model code is copied. Two hooks are installed:

* a forward hook on every ``self_attn.q_proj`` keeps the pre-RoPE query of the current
  call (the ``q~`` that MAC matches on);
* an attention function registered with transformers' ``AttentionInterface`` under the
  name ``"macattn"``: prefill (more than one query token) runs the model's original
  attention implementation and seeds the rings (SPEC §1.4); decode (one query token)
  calls ``torch.ops.macattn.mac_match`` and ``torch.ops.macattn.mac_attend``.

The model keeps its own KV cache (``past_key_values``). Requests in one call must have
no padding (the runtime batches mixed lengths itself).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Sequence

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, sdpa_mask

from macattn import ops  # noqa: F401  (registers torch.ops.macattn.*)
from macattn.config import MacConfig
from macattn.mac import full_attention_reference, rectified_summaries_reference
from macattn.builder.seeding import seed_rings_
from macattn.runtime.state import MacState

__all__ = ["SUPPORTED_ARCHITECTURES", "MacAttentionContext", "patch_model", "unpatch_model", "is_patched",
           "capture_pre_rope_kv", "plain_attention"]

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
IMPL_NAME = "macattn"


@dataclass
class MacAttentionContext:
    """What the patched attention of one model needs across calls.

    state: the rings (owned here for HF-style use; the runtime passes its own).
    slots: ``[B]`` int64 ring rows of the requests in the current call.
    record_error: when True, every decode step also computes full attention and keeps
    ``||mac - full|| / ||full||`` per layer in ``layer_errors`` (diagnostics only).
    positions: ``[B]`` int64, the per-request position ``m`` of this decode call's token
    (requests of different lengths, K/V padded to the longest); ``None`` derives
    ``m = cache length - 1`` for every request (unpadded batches only).
    runtime_slots: True when a runtime owns slot acquisition (``macattn.runtime``): prefill
    then seeds ``slots`` as set by the caller and never calls ``start_batch``.
    rings: per-layer ``(qring, oring, ring_lse, ring_pos)`` used instead of ``state``'s
    (graph export, ``macattn.builder.export``); prefill then seeds them in place with
    tensor ops only (``macattn.builder.seeding``), so the call traces into one graph.
    collect_diagnostics: False skips ``state.diagnostics`` (host-side accumulation).
    last_match_pos: ``layer -> match_pos [B, Hq]`` int64 of the latest decode call.
    paged: set by the runtime's GPU decode (``macattn.runtime.paged_decode``): key/value
    reaching the attention are the paged pool ``[num_blocks, block_size, Hkv, d]`` and the
    step runs the layer's ``MacDecodePlan`` over ``paged.page_table`` (no host sync, CUDA-graph
    capturable; diagnostics are recorded by the caller after the step).
    """

    config: MacConfig
    state: MacState
    fallback_impl: str
    slots: torch.Tensor | None = None
    record_error: bool = False
    layer_errors: dict[int, list[float]] = field(default_factory=dict)
    q_pre: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)
    positions: torch.Tensor | None = None
    runtime_slots: bool = False
    rings: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] | None = None
    collect_diagnostics: bool = True
    last_match_pos: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)
    paged: object | None = None

    def start_batch(self, batch_size: int) -> None:
        """Release the previous call's slots and take fresh (reset) ones for ``batch_size`` requests."""
        self.end_batch()
        if batch_size > self.state.num_slots:
            raise ValueError(f"batch_size must be <= num_slots={self.state.num_slots}, got {batch_size}")
        self.slots = torch.tensor([self.state.acquire() for _ in range(batch_size)], dtype=torch.int64)

    def end_batch(self) -> None:
        if self.slots is not None:
            for s in self.slots.tolist():
                self.state.release(s)
        self.slots = None


def _mac_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention interface: query ``[B, Hq, T, d]``, key/value ``[B, Hkv, S, d]``
    (cache included); returns ``([B, T, Hq, d], None)``."""
    ctx: MacAttentionContext = module._macattn_ctx
    layer = module.layer_idx
    B, Hq, T, d = query.shape
    S = key.shape[2]
    q_pre = ctx.q_pre.pop(layer).view(B, T, Hq, d).transpose(1, 2)   # [B, Hq, T, d]
    params = ctx.config.for_layer(layer)
    if T > 1:
        fallback = AttentionInterface._global_mapping[ctx.fallback_impl]
        out, weights = fallback(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
        if S == T and layer == 0 and not ctx.runtime_slots:
            ctx.start_batch(B)
        if ctx.slots is None:
            raise RuntimeError("MAC prefill of a continued sequence without a batch; call start_batch first")
        if S == T:   # a fresh prompt: reset and seed whole ring rows with tensor ops (traceable)
            rings = ctx.state.layer(layer) if ctx.rings is None else ctx.rings[layer]
            seed_rings_(rings, ctx.slots.to(query.device), query, q_pre, key, value,
                        band=params.band, scale=scaling)
            return out, weights
        if ctx.rings is not None:
            raise NotImplementedError("graph export supports prefill of a fresh prompt only")
        # a prompt continued in chunks: seed the chunk's positions on top of the ring
        n = min(params.window, T)
        qpos = torch.arange(S - n, S, device=query.device)
        summ = rectified_summaries_reference(query[:, :, T - n:], key, value, qpos, band=params.band, scale=scaling)
        for b, slot in enumerate(ctx.slots.tolist()):
            ctx.state.seed(layer, slot, qpos, q_pre[b, :, T - n:],
                           type(summ)(summ.o[b], summ.lse[b]))
        return out, weights
    if ctx.slots is None or ctx.slots.numel() != B:
        raise RuntimeError(f"MAC decode for a batch of {B} without a matching prefill")
    if ctx.positions is None:
        _check_no_padding(attention_mask)
        positions = torch.full((B,), S - 1, dtype=torch.int64, device=query.device)
    else:
        positions = ctx.positions.to(device=query.device, dtype=torch.int64)
        if positions.shape != (B,):
            raise ValueError(f"MacAttentionContext.positions must be [B]={B}, got {tuple(positions.shape)}")
    slots = ctx.slots.to(query.device)
    q = query[:, :, 0]
    qp = q_pre[:, :, 0]
    rings = ctx.state.layer(layer) if ctx.rings is None else ctx.rings[layer]
    if ctx.paged is not None:
        return ctx.paged.attend(layer, params, q, qp, key, value, positions, slots, rings).unsqueeze(1), None
    if params.enabled:
        match_pos, _ = torch.ops.macattn.mac_match(qp, rings[0], rings[2], rings[3], slots, positions,
                                                    params.band, params.tau)
    else:
        match_pos = torch.full((B, Hq), -1, dtype=torch.int64, device=query.device)
    out = torch.ops.macattn.mac_attend(q, qp, key, value, positions, match_pos, slots, *rings,
                                       params.band, float(scaling))
    ctx.last_match_pos[layer] = match_pos
    if ctx.collect_diagnostics:
        ctx.state.diagnostics.record(layer, match_pos, positions, params.band)
    if ctx.record_error:
        full = full_attention_reference(q, key, value, positions, scale=scaling)
        err = (out.to(full.dtype) - full).norm() / full.norm().clamp(min=1e-30)
        ctx.layer_errors.setdefault(layer, []).append(float(err))
    return out.unsqueeze(1), None


def _check_no_padding(attention_mask) -> None:
    if attention_mask is None:
        return
    allowed = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
    if not bool(allowed.all()):
        raise NotImplementedError("MAC decode through the HF model supports unpadded batches only; "
                                  "use macattn.runtime.ModelRunner for batches of mixed lengths")


def _capture_q_pre(module, inputs, output) -> None:
    attn = module._macattn_parent
    attn._macattn_ctx.q_pre[attn.layer_idx] = output


def _attention_modules(model):
    return [layer.self_attn for layer in model.model.layers]


def is_patched(model) -> bool:
    return getattr(model, "_macattn_ctx", None) is not None


def patch_model(model, config: MacConfig | None = None, *, num_slots: int = 8,
                query_dtype: torch.dtype | None = None) -> MacAttentionContext:
    """Patch ``model`` (an instance of one of ``SUPPORTED_ARCHITECTURES``) in place.

    Returns the context holding the MAC state. The ring query dtype defaults to the
    model's dtype; summaries are kept in fp32.
    """
    arch = type(model).__name__
    if arch not in SUPPORTED_ARCHITECTURES:
        raise TypeError(f"model must be one of {SUPPORTED_ARCHITECTURES}, got {arch}")
    if is_patched(model):
        raise ValueError("model is already patched; call unpatch_model first")
    if config is None:
        config = MacConfig()
    if not isinstance(config, MacConfig):
        raise TypeError(f"config must be a MacConfig, got {type(config).__name__}")
    hf = model.config
    window = getattr(hf, "sliding_window", None)
    if window is not None and getattr(hf, "use_sliding_window", True):
        raise ValueError(f"sliding_window={window}: MAC needs full causal attention layers; "
                         "set config.sliding_window=None")
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    param = next(model.parameters())
    state = MacState.allocate(config, num_layers=hf.num_hidden_layers, num_slots=num_slots,
                              num_q_heads=hf.num_attention_heads, head_dim=head_dim,
                              query_dtype=query_dtype or param.dtype, device=param.device)
    fallback = hf._attn_implementation or "sdpa"
    if fallback not in AttentionInterface._global_mapping:
        fallback = "sdpa"
    ctx = MacAttentionContext(config=config, state=state, fallback_impl=fallback)
    AttentionInterface.register(IMPL_NAME, _mac_attention_forward)
    AttentionMaskInterface.register(IMPL_NAME, ALL_MASK_ATTENTION_FUNCTIONS.get(fallback, sdpa_mask))
    for attn in _attention_modules(model):
        attn._macattn_ctx = ctx
        # plain attribute, not a registered submodule: a module cycle q_proj -> attn -> q_proj
        # breaks named_modules(remove_duplicate=False) (torch.export) and state_dict
        object.__setattr__(attn.q_proj, "_macattn_parent", attn)
        attn._macattn_hook = attn.q_proj.register_forward_hook(_capture_q_pre)
    model._macattn_ctx = ctx
    model._macattn_prev_impl = hf._attn_implementation
    model.set_attn_implementation(IMPL_NAME)
    return ctx


def unpatch_model(model) -> None:
    """Undo ``patch_model``: remove the hooks and restore the original attention implementation."""
    if not is_patched(model):
        raise ValueError("model is not patched")
    for attn in _attention_modules(model):
        attn._macattn_hook.remove()
        del attn._macattn_hook, attn._macattn_ctx, attn.q_proj._macattn_parent
    model.set_attn_implementation(model._macattn_prev_impl)
    model._macattn_ctx.end_batch()
    del model._macattn_ctx, model._macattn_prev_impl


@contextlib.contextmanager
def capture_pre_rope_kv(model):
    """Within the block, every forward of ``model`` records each layer's ``k_proj`` / ``v_proj``
    outputs ``[B, T, Hkv * d]`` (keys before RoPE, values) in the yielded dict
    ``{layer: [k, v]}`` (the latest call wins). LLaMA / Qwen2 / Mistral apply no norm between
    ``k_proj`` and RoPE, so ``k_proj``'s output is the pre-RoPE key (A3 chunk store)."""
    captured: dict[int, list] = {}
    handles = []
    for i, attn in enumerate(_attention_modules(model)):
        captured[i] = [None, None]
        for j, proj in enumerate((attn.k_proj, attn.v_proj)):
            def hook(module, inputs, output, _i=i, _j=j):
                captured[_i][_j] = output
            handles.append(proj.register_forward_hook(hook))
    try:
        yield captured
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def plain_attention(model):
    """Run a patched ``model`` with its original attention (no MAC ring seeding) within the
    block; a no-op on an unpatched model or inside another ``plain_attention`` block."""
    if not is_patched(model) or model.config._attn_implementation != IMPL_NAME:
        yield
        return
    ctx = model._macattn_ctx
    model.set_attn_implementation(ctx.fallback_impl)
    try:
        yield
    finally:
        model.set_attn_implementation(IMPL_NAME)
        ctx.q_pre.clear()
