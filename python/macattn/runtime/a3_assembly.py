"""A3 assembly: the prefill of a RAG prompt ``[system, chunk_1 … chunk_n, question]`` from
stored chunk KV (docs/spec.md §4; selection math in ``macattn.methods.a3.reference``).

Steps (``fuse_prefix`` then ``prefill_question``):

1. the system prompt runs normally at positions ``0 .. s-1`` (its K/V are exact);
2. **position recovery**: each chunk's stored pre-RoPE keys get RoPE at the chunk's real
   positions in the prompt; values are used as stored;
3. **selection** of ``round(rho * N)`` document tokens by the configured ``FusionMethod``
   (A3: the question's layer-0 attention, which is exact here because layer-0 keys depend
   on the token alone, so it needs no recomputation of anything);
4. **recomputation**: the selected tokens run through every layer at their real positions,
   attending to the fused cache (causally); their K/V overwrite the reused ones in each
   layer. Layer 0's output of a selected token is computed over exact layer-0 K/V, so this
   equals "layer 0 fully, then the selected tokens through the remaining layers";
5. the question runs normally over the fused cache and gives the first token's logits.

``FULL_RECOMPUTE`` is an ordinary prefill of the whole prompt; ``FULL_REUSE`` selects
nothing. With ``rho = 1`` every document token is recomputed and the result equals full
recompute up to float rounding (tested on LLaMA / Qwen2 / Mistral).

The model runs through transformers' own modules; the only thing supplied is
``past_key_values`` (``FusedCache``, which writes the call's K/V at given positions and
returns the whole visible prefix) plus explicit ``position_ids`` and a 4-D boolean mask.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Callable

import torch

from macattn.methods.a3.config import A3Config, FusionMethod
from macattn.methods.a3.reference import (question_attention_scores, recompute_budget, sink_selection, top_tokens, value_deviation_scores)
from macattn.models.attention import plain_attention, run_capturing
from macattn.models.transformers_api import CACHE_KWARG

from macattn.runtime.chunk_store import ChunkKVStore, _ids_tensor, precompute_chunk_kv

__all__ = ["RagPrompt", "FusedCache", "FusionResult", "fuse_prefix", "prefill_question", "fused_generate",
           "decode_after_prefill", "chunk_kv_source"]


@dataclass
class RagPrompt:
    """Token ids (1-D int): ``system`` (may be empty), ``chunks`` (document chunks, each
    non-empty), ``question`` (non-empty). The prompt is their concatenation in that order."""

    system: torch.Tensor
    chunks: list[torch.Tensor]
    question: torch.Tensor

    def __post_init__(self) -> None:
        self.system = torch.as_tensor(self.system, dtype=torch.int64).reshape(-1)
        if not isinstance(self.chunks, (list, tuple)):
            raise TypeError(f"chunks must be a list of 1-D token id tensors, got {type(self.chunks).__name__}")
        self.chunks = [_ids_tensor(c) for c in self.chunks]
        self.question = _ids_tensor(self.question)

    @property
    def num_prefix(self) -> int:
        """System + document tokens (``P``)."""
        return self.system.numel() + sum(c.numel() for c in self.chunks)

    @property
    def doc_positions(self) -> torch.Tensor:
        return torch.arange(self.system.numel(), self.num_prefix)

    def tokens(self) -> torch.Tensor:
        return torch.cat([self.system, *self.chunks, self.question])


class FusedCache:
    """Per-layer K/V buffers ``k[l]``, ``v[l]`` ``[1, Hkv, capacity, d]`` (post-RoPE keys) of
    one prompt. Before each forward the caller sets ``write_pos [n]`` (positions of the call's
    tokens) and ``visible`` (keys/values returned to the attention: positions ``0 .. visible-1``)."""

    def __init__(self, *, num_layers: int, num_kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, device) -> None:
        shape = (1, num_kv_heads, capacity, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.write_pos: torch.Tensor | None = None
        self.visible = 0

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.visible - (0 if self.write_pos is None else self.write_pos.numel())

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        self.k[layer_idx][:, :, self.write_pos] = key.to(self.k[layer_idx].dtype)
        self.v[layer_idx][:, :, self.write_pos] = value.to(self.v[layer_idx].dtype)
        return self.k[layer_idx][:, :, :self.visible], self.v[layer_idx][:, :, :self.visible]


@dataclass
class FusionResult:
    """cache: the prompt's fused K/V (``visible`` = tokens so far). selected: ``[k]`` int64
    positions of the recomputed document tokens. logits: ``[V]`` fp32 of the last prompt token
    (None until ``prefill_question``)."""

    prompt: RagPrompt
    config: A3Config
    cache: FusedCache
    selected: torch.Tensor
    logits: torch.Tensor | None = None
    stats: dict = field(default_factory=dict)


def _rope_fns(model):
    attn = model.model.layers[0].self_attn
    return sys.modules[type(attn).__module__].apply_rotary_pos_emb, attn.scaling


def _device(model):
    return next(model.parameters()).device


def _forward(model, cache: FusedCache, ids: torch.Tensor, positions: torch.Tensor, visible: int,
             logits: bool = False):
    """Run ``ids`` at ``positions`` over ``cache`` (keys ``0 .. visible-1``, causal by position)."""
    dev = _device(model)
    ids, positions = ids.to(dev), positions.to(dev)
    cache.write_pos, cache.visible = positions, visible
    mask = (torch.arange(visible, device=dev).view(1, -1) <= positions.view(-1, 1)).view(1, 1, -1, visible)
    kw = {"input_ids": ids.view(1, -1), "position_ids": positions.view(1, -1), "attention_mask": mask,
          CACHE_KWARG: cache, "use_cache": True}
    if logits:
        return model(**kw, logits_to_keep=1).logits[0, -1].float()
    return model.model(**kw)


def chunk_kv_source(model, store: ChunkKVStore | None) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """``ids -> (k_pre_rope, v)`` ``[L, T, Hkv, d]``: from ``store`` (computed and stored on a miss)
    or computed on the spot."""
    if store is None:
        return lambda ids: precompute_chunk_kv(model, ids)
    return lambda ids: store.get_or_compute(model, ids)


def _alloc(model, capacity: int) -> FusedCache:
    hf = model.config
    d = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    return FusedCache(num_layers=hf.num_hidden_layers, num_kv_heads=hf.num_key_value_heads, head_dim=d,
                      capacity=capacity, dtype=next(model.parameters()).dtype, device=_device(model))


@torch.inference_mode()
def fuse_prefix(model, prompt: RagPrompt, config: A3Config, *, chunk_kv=None, extra_capacity: int = 0) -> FusionResult:
    """Steps 1-4: the fused K/V of ``system + chunks`` (``cache.visible = P`` after the call).

    model: LLaMA / Qwen2 / Mistral ``*ForCausalLM`` (a MAC-patched one runs its original
    attention here). chunk_kv: ``ids -> (k_pre_rope, v)`` (``chunk_kv_source``); default
    computes each chunk on the spot. The cache holds ``P + len(question) + extra_capacity`` positions.
    For ``FULL_RECOMPUTE`` nothing is done here (the whole prompt runs in ``prefill_question``).
    """
    if not isinstance(config, A3Config):
        raise TypeError(f"config must be an A3Config, got {type(config).__name__}")
    P, Q = prompt.num_prefix, prompt.question.numel()
    cache = _alloc(model, P + Q + extra_capacity)
    result = FusionResult(prompt, config, cache, torch.zeros(0, dtype=torch.int64))
    if config.method is FusionMethod.FULL_RECOMPUTE:
        return result
    chunk_kv = chunk_kv or chunk_kv_source(model, None)
    dev = _device(model)
    apply_rope, scale = _rope_fns(model)
    s = prompt.system.numel()
    with plain_attention(model):
        if s:
            _forward(model, cache, prompt.system, torch.arange(s), s)
        # position recovery
        offset = s
        for ids in prompt.chunks:
            k_pre, v = chunk_kv(ids)
            T = ids.numel()
            if k_pre.shape[:2] != (len(cache.k), T):
                raise ValueError(f"chunk KV must be [num_layers={len(cache.k)}, T={T}, Hkv, d], got {tuple(k_pre.shape)}")
            pos = torch.arange(offset, offset + T, device=dev)
            k_pre, v = k_pre.to(dev, cache.k[0].dtype), v.to(dev, cache.v[0].dtype)
            cos, sin = model.model.rotary_emb(v[0].transpose(0, 1).unsqueeze(0), pos.view(1, -1))
            for layer in range(len(cache.k)):
                kl = k_pre[layer].transpose(0, 1).unsqueeze(0)                      # [1, Hkv, T, d]
                cache.k[layer][:, :, offset:offset + T] = apply_rope(kl, kl, cos, sin)[1]
                cache.v[layer][:, :, offset:offset + T] = v[layer].transpose(0, 1).unsqueeze(0)
            offset += T
        cache.visible = P
        selected = _select(model, prompt, config, cache, apply_rope, scale)
        if selected.numel():
            ids = prompt.tokens()[selected]
            _forward(model, cache, ids, selected, P)
    cache.write_pos, cache.visible = None, P
    result.selected = selected
    result.stats["recomputed"] = int(selected.numel())
    return result


def _select(model, prompt: RagPrompt, config: A3Config, cache: FusedCache, apply_rope, scale) -> torch.Tensor:
    doc = prompt.doc_positions
    N = doc.numel()
    method = config.method
    if method is FusionMethod.FULL_REUSE or N == 0:
        return torch.zeros(0, dtype=torch.int64)
    budget = recompute_budget(config.rho, N)
    if method is FusionMethod.SINK:
        return doc[sink_selection([c.numel() for c in prompt.chunks], config.rho)]
    if budget == 0:
        return torch.zeros(0, dtype=torch.int64)
    if budget == N:
        return doc
    P, Q = prompt.num_prefix, prompt.question.numel()
    layers = model.model.layers
    if method is FusionMethod.A3:
        qpos = torch.arange(P, P + Q)
        captured = run_capturing(lambda: _forward(model, cache, prompt.question, qpos, P + Q),
                                 {"q": layers[0].self_attn.q_proj}, stop=layers[0])
        d = cache.k[0].shape[-1]
        q = captured["q"].view(1, Q, -1, d).transpose(1, 2)                               # [1, Hq, Q, d]
        cos, sin = model.model.rotary_emb(q, qpos.view(1, -1).to(q.device))
        q = apply_rope(q, q, cos, sin)[0]
        scores = question_attention_scores(q[0], cache.k[0][0, :, :P + Q], qpos.to(q.device),
                                           doc.to(q.device), scale=scale)
        return doc[top_tokens(scores.cpu(), budget)]
    if method is FusionMethod.CACHEBLEND:
        if len(layers) < 2:
            return doc[:budget]
        v_proj = layers[1].self_attn.v_proj   # layer 0 of every document token is exact and rewrites identical K/V
        captured = run_capturing(lambda: _forward(model, cache, prompt.tokens()[doc], doc, P), {"v": v_proj},
                                 stop=v_proj)
        d = cache.v[1].shape[-1]
        fresh = captured["v"][0].view(N, -1, d)
        reused = cache.v[1][0, :, doc.to(fresh.device)].transpose(0, 1)
        return doc[top_tokens(value_deviation_scores(reused, fresh).cpu(), budget)]
    raise ValueError(f"unknown method {method!r}")


@torch.inference_mode()
def prefill_question(model, result: FusionResult) -> torch.Tensor:
    """Step 5 (standalone, no runtime): run the question over the fused cache; for
    ``FULL_RECOMPUTE`` the whole prompt. Sets and returns ``result.logits`` ``[V]``."""
    prompt, cache = result.prompt, result.cache
    P, Q = prompt.num_prefix, prompt.question.numel()
    if result.config.method is FusionMethod.FULL_RECOMPUTE:
        ids, pos = prompt.tokens(), torch.arange(P + Q)
    else:
        ids, pos = prompt.question, torch.arange(P, P + Q)
    with plain_attention(model):
        result.logits = _forward(model, cache, ids, pos, P + Q, logits=True)
    cache.write_pos = None
    return result.logits


@torch.inference_mode()
def fused_generate(model, prompt: RagPrompt, config: A3Config, *, max_new_tokens: int = 1,
                   chunk_kv=None, forced: list[int] | None = None) -> tuple[list[int], FusionResult]:
    """Greedy decoding after a fused prefill (reference path for tests and the CPU evaluation).
    With ``forced`` (>= ``max_new_tokens - 1`` ids) the token fed after step ``i`` is ``forced[i]``
    (teacher forcing) while the returned tokens stay the model's own argmax.
    Returns ``(tokens [max_new_tokens], result)``."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if forced is not None and len(forced) < max_new_tokens - 1:
        raise ValueError(f"forced must hold >= max_new_tokens - 1 = {max_new_tokens - 1} ids, got {len(forced)}")
    result = fuse_prefix(model, prompt, config, chunk_kv=chunk_kv, extra_capacity=max_new_tokens)
    prefill_question(model, result)
    return decode_after_prefill(model, result, max_new_tokens, forced=forced), result


@torch.inference_mode()
def decode_after_prefill(model, result: FusionResult, max_new_tokens: int = 1, *,
                         forced: list[int] | None = None) -> list[int]:
    """Greedy tokens after ``prefill_question`` ran on ``result`` (its ``logits`` give the first), each
    next one decoded over the fused cache (built with ``extra_capacity >= max_new_tokens``). ``forced``
    as in ``fused_generate``. Returns ``max_new_tokens`` ids."""
    prompt = result.prompt
    tokens = [int(result.logits.argmax())]
    pos = prompt.num_prefix + prompt.question.numel()
    with plain_attention(model):
        for i in range(max_new_tokens - 1):
            nxt = forced[i] if forced is not None else tokens[-1]
            logits = _forward(model, result.cache, torch.tensor([nxt]), torch.tensor([pos]), pos + 1, logits=True)
            tokens.append(int(logits.argmax()))
            pos += 1
    result.cache.write_pos = None
    return tokens


def split_rag_prompt(input_ids, rag_lengths) -> RagPrompt:
    """The serving form of a chunked prompt: ``input_ids [n]`` is ``system + chunk_1 … chunk_k +
    question`` and ``rag_lengths`` is ``[len(system), len(chunk_1), …, len(chunk_k)]`` (the
    question is the remainder, at least one token)."""
    ids = torch.as_tensor(input_ids, dtype=torch.int64).reshape(-1)
    lengths = [int(x) for x in torch.as_tensor(rag_lengths).reshape(-1).tolist()]
    if len(lengths) < 2 or lengths[0] < 0 or any(n < 1 for n in lengths[1:]):
        raise ValueError(f"rag_lengths must be [system >= 0, chunk lengths >= 1 ...] with at least one chunk, "
                         f"got {lengths}")
    if sum(lengths) >= ids.numel():
        raise ValueError(f"rag_lengths sum to {sum(lengths)} but input_ids has {ids.numel()} tokens; "
                         "the question needs at least one")
    parts = list(torch.split(ids, lengths + [ids.numel() - sum(lengths)]))
    return RagPrompt(parts[0], parts[1:-1], parts[-1])
