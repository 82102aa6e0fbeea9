"""Decode-step and prefill wrappers of a patched model with every tensor explicit.

These modules are what ``torch.export`` / ``torch.onnx.export`` trace (``docs/graph.md``).
They drive the patched HF model's own submodules (embedding, rotary embedding, decoder
layers, final norm, LM head), so the attention is the patched ``"macattn"`` attention:
decode calls ``torch.ops.macattn.mac_match`` and ``torch.ops.macattn.mac_attend`` once
per layer, prefill runs the model's original attention and seeds the rings.

Flat argument order (``N`` layers; names are the ONNX graph's input names)::

    decode : input_ids [B, 1] int64, positions [B] int64, slots [B] int64,
             then per layer l: key.l, value.l [B, Hkv, T, d] (model dtype),
                               qring.l [S, Hq, K_l, d], oring.l [S, Hq, K_l, d] fp32,
                               ring_lse.l [S, Hq, K_l] fp32, ring_pos.l [S, K_l] int64
    prefill: input_ids [B, L] int64, slots [B] int64, then per layer l the four rings.

Request ``b`` of a decode step owns past keys ``0 .. positions[b] - 1`` (entries at and
past ``positions[b]`` are ignored; ``positions[b] <= T``); its new K/V row is placed at
``positions[b]`` of a ``T + 1`` long view that the ops read. Outputs::

    decode : logits [B, V] fp32, then per layer key.l.new, value.l.new [B, Hkv, 1, d],
             qring.l.out, oring.l.out, ring_lse.l.out, ring_pos.l.out (updated rings),
             match_pos.l [B, Hq] int64 (-1 = miss)
    prefill: logits [B, V] (last prompt token), then per layer key.l, value.l
             [B, Hkv, L, d] (the prompt's cache) and the four seeded rings ``*.out``.
"""
from __future__ import annotations

import torch

from macattn.methods.base import StepContext
from macattn.methods.mac.backend import MacAttention
from macattn.models.attention import ModelBinding, binding_of, is_patched
from macattn.models.transformers_api import CACHE_KWARG

__all__ = ["DecodeStepModule", "PrefillStepModule", "RING_NAMES", "decode_io_names", "prefill_io_names",
           "model_dims"]

RING_NAMES = ("qring", "oring", "ring_lse", "ring_pos")


def model_dims(model) -> dict:
    """``num_layers, num_q_heads, num_kv_heads, head_dim, vocab_size, hidden_size`` of an HF model."""
    hf = model.config
    return dict(num_layers=hf.num_hidden_layers, num_q_heads=hf.num_attention_heads,
                num_kv_heads=hf.num_key_value_heads,
                head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
                vocab_size=hf.vocab_size, hidden_size=hf.hidden_size)


def decode_io_names(num_layers: int) -> tuple[list[str], list[str]]:
    """``(input_names, output_names)`` of the decode graph, in argument / return order."""
    ins = ["input_ids", "positions", "slots"]
    outs = ["logits"]
    for l in range(num_layers):
        ins += [f"key.{l}", f"value.{l}"] + [f"{r}.{l}" for r in RING_NAMES]
        outs += [f"key.{l}.new", f"value.{l}.new"] + [f"{r}.{l}.out" for r in RING_NAMES] + [f"match_pos.{l}"]
    return ins, outs


def prefill_io_names(num_layers: int) -> tuple[list[str], list[str]]:
    """``(input_names, output_names)`` of the prefill graph, in argument / return order."""
    ins = ["input_ids", "slots"]
    outs = ["logits"]
    for l in range(num_layers):
        ins += [f"{r}.{l}" for r in RING_NAMES]
        outs += [f"key.{l}", f"value.{l}"] + [f"{r}.{l}.out" for r in RING_NAMES]
    return ins, outs


class _StepCache:
    """Duck-typed HF cache for one call: ``update`` places the new K/V and keeps them.

    decode (``positions`` given): past ``[B, Hkv, T, d]`` + new ``[B, Hkv, 1, d]`` ->
    ``[B, Hkv, T + 1, d]`` with the new row at ``positions[b]``. prefill (no past): the
    prompt's K/V are returned unchanged.
    """

    def __init__(self, keys=None, values=None, positions=None):
        self.keys, self.values, self.positions = keys, values, positions
        self.new_keys: dict[int, torch.Tensor] = {}
        self.new_values: dict[int, torch.Tensor] = {}

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.new_keys[layer_idx], self.new_values[layer_idx] = key_states, value_states
        if self.keys is None:
            return key_states, value_states
        return (self._place(self.keys[layer_idx], key_states), self._place(self.values[layer_idx], value_states))

    def _place(self, past: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
        B, H, _, d = past.shape
        full = torch.cat([past, torch.zeros_like(row)], dim=2)
        idx = self.positions.view(B, 1, 1, 1).expand(B, H, 1, d)
        return full.scatter(2, idx, row.to(past.dtype))


def _check_patched(model) -> ModelBinding:
    if not is_patched(model) or not isinstance(binding_of(model).method, MacAttention):
        raise ValueError("model must be patched with macattn.models.attention.patch_model first")
    return binding_of(model)


def _run_layers(model, input_ids: torch.Tensor, position_ids: torch.Tensor, cache: _StepCache) -> torch.Tensor:
    """Embedding -> decoder layers -> norm -> LM head of the last token: logits ``[B, V]``."""
    inner = model.model
    hidden = inner.embed_tokens(input_ids)
    pe = inner.rotary_emb(hidden, position_ids)
    for layer in inner.layers[: model.config.num_hidden_layers]:
        hidden = layer(hidden, attention_mask=None, position_ids=position_ids, **{CACHE_KWARG: cache},
                       use_cache=True, position_embeddings=pe)
    hidden = inner.norm(hidden)
    return model.lm_head(hidden[:, -1]).float()


def _split_rings(flat, num_layers: int, per_layer: int, offset: int):
    return [tuple(flat[l * per_layer + offset: l * per_layer + offset + 4]) for l in range(num_layers)]


class DecodeStepModule(torch.nn.Module):
    """One decode step of a patched model with explicit state (see the module docstring).

    ``forward(input_ids, positions, slots, *state)`` with ``state`` the 6 per-layer tensors
    in ``decode_io_names`` order; returns the flat tuple of ``decode_io_names`` outputs.
    The ring inputs are mutated in place (``mac_attend``) and also returned.
    """

    def __init__(self, model):
        super().__init__()
        self.binding = _check_patched(model)
        self.model = model
        self.num_layers = model.config.num_hidden_layers

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, *state: torch.Tensor):
        N = self.num_layers
        if len(state) != 6 * N:
            raise ValueError(f"state must hold 6 tensors per layer ({6 * N}), got {len(state)}")
        if input_ids.dim() != 2 or input_ids.shape[1] != 1:
            raise ValueError(f"input_ids must be [B, 1], got {tuple(input_ids.shape)}")
        keys = [state[6 * l] for l in range(N)]
        values = [state[6 * l + 1] for l in range(N)]
        rings = _split_rings(state, N, 6, 2)
        cache = _StepCache(keys, values, positions)
        with self.binding.step(StepContext(slots=slots, rings=rings, positions=positions)):
            logits = _run_layers(self.model, input_ids, positions.view(-1, 1), cache)
            match = [self.binding.method.last_match_pos.pop(l) for l in range(N)]
        outs = [logits]
        for l in range(N):
            outs += [cache.new_keys[l], cache.new_values[l], *rings[l], match[l]]
        return tuple(outs)


class PrefillStepModule(torch.nn.Module):
    """Prefill of a fresh batch (positions ``0 .. L-1``, no padding) with explicit rings.

    ``forward(input_ids, slots, *rings)`` with 4 ring tensors per layer; returns the flat
    tuple of ``prefill_io_names`` outputs. Rows ``slots`` of the rings are reset and
    seeded in place (and returned).
    """

    def __init__(self, model):
        super().__init__()
        self.binding = _check_patched(model)
        self.model = model
        self.num_layers = model.config.num_hidden_layers

    def forward(self, input_ids: torch.Tensor, slots: torch.Tensor, *ring_state: torch.Tensor):
        N = self.num_layers
        if len(ring_state) != 4 * N:
            raise ValueError(f"ring_state must hold 4 tensors per layer ({4 * N}), got {len(ring_state)}")
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, L], got {tuple(input_ids.shape)}")
        rings = _split_rings(ring_state, N, 4, 0)
        cache = _StepCache()
        position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0).expand_as(input_ids)
        with self.binding.step(StepContext(slots=slots, rings=rings)):
            logits = _run_layers(self.model, input_ids, position_ids, cache)
        outs = [logits]
        for l in range(N):
            outs += [cache.new_keys[l], cache.new_values[l], *rings[l]]
        return tuple(outs)
