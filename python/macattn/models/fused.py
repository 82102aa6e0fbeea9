"""A bound LLaMA / Qwen2 / Mistral model's forward with fused weights (issue: the decode step at
the memory-bandwidth floor).

``FusedForward(model)`` takes the weights of a bound ``*ForCausalLM`` at load and keeps, per
layer, Q/K/V as one projection ``[(Hq + 2 Hkv) d, D]`` (biases concatenated for Qwen2) and
gate/up as one ``[2 I, D]``; RMSNorm is applied together with the residual add
(``add_rms_norm``). It computes what the transformers model computes — embedding, per layer
norm → QKV → RoPE → KV update → the bound method's attention → O → residual → norm → gate/up →
SiLU·mul → down → residual, final norm, logits of the last position — with fewer, larger GEMMs
(one launch instead of three and of two per layer), holding one copy of the weights. The attention call is the bound model's
(``macattn.models.attention``), so every method and its per-call ``StepContext`` work unchanged;
the KV cache argument is the same ``past_key_values`` view the transformers forward takes.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from macattn.models.architectures import check_supported
from macattn.models.attention import attention_forward

__all__ = ["FusedForward", "add_rms_norm", "rms_norm"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LLaMA RMSNorm: fp32 statistics, the result cast back before the weight."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``r = x + residual``; returns ``(rms_norm(r), r)`` (one pass for a fusing compiler)."""
    r = x + residual
    return rms_norm(r, weight, eps), r


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class _FusedLayer(nn.Module):
    """One decoder layer's weights, fused (the originals are left in the model untouched)."""

    def __init__(self, layer) -> None:
        super().__init__()
        attn, mlp = layer.self_attn, layer.mlp
        self.attn = attn            # the attention module: layer_idx, scaling, the binding
        self.head_dim = attn.head_dim
        self.q_size = attn.q_proj.out_features
        self.kv_size = attn.k_proj.out_features
        projs = (attn.q_proj, attn.k_proj, attn.v_proj)
        with torch.no_grad():
            self.qkv_weight = nn.Parameter(torch.cat([p.weight for p in projs]), requires_grad=False)
            has_bias = attn.q_proj.bias is not None
            self.qkv_bias = (nn.Parameter(torch.cat([p.bias for p in projs]), requires_grad=False)
                             if has_bias else None)
            self.gate_up_weight = nn.Parameter(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),
                                               requires_grad=False)
        # the originals become views into the fused tensors: one copy of the weights, and the
        # transformers modules (prefill through the model's own forward, export) still see them
        sizes = (self.q_size, self.kv_size, self.kv_size)
        for proj, w in zip(projs, self.qkv_weight.split(sizes)):
            proj.weight = nn.Parameter(w, requires_grad=False)
        if self.qkv_bias is not None:
            for proj, b in zip(projs, self.qkv_bias.split(sizes)):
                proj.bias = nn.Parameter(b, requires_grad=False)
        inter = mlp.gate_proj.out_features
        mlp.gate_proj.weight = nn.Parameter(self.gate_up_weight[:inter], requires_grad=False)
        mlp.up_proj.weight = nn.Parameter(self.gate_up_weight[inter:], requires_grad=False)
        self.o_proj, self.down_proj, self.act = attn.o_proj, mlp.down_proj, mlp.act_fn
        self.ln1, self.ln2 = layer.input_layernorm, layer.post_attention_layernorm
        self.intermediate = mlp.gate_proj.out_features

    def attention(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention_mask,
                  past_key_values) -> torch.Tensor:
        """h ``[B, T, D]`` (normed) -> attention output after ``o_proj`` ``[B, T, D]``."""
        B, T, _ = h.shape
        d = self.head_dim
        qkv = F.linear(h, self.qkv_weight, self.qkv_bias)
        q_pre, k, v = qkv.split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        q = q_pre.view(B, T, -1, d).transpose(1, 2)
        k = k.view(B, T, -1, d).transpose(1, 2)
        v = v.view(B, T, -1, d).transpose(1, 2)
        c, s = cos.unsqueeze(1), sin.unsqueeze(1)
        q, k = q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, self.attn.layer_idx)
        binding = getattr(self.attn, "_macattn", None)
        if binding is None:
            raise ValueError("FusedForward runs a bound model (macattn.models.attention.bind)")
        if binding.method.capabilities.needs_pre_rope_query:
            binding.q_pre[self.attn.layer_idx] = q_pre
        out, _ = attention_forward(self.attn, q, k, v, attention_mask, scaling=self.attn.scaling)
        return self.o_proj(out.reshape(B, T, -1))

    def mlp(self, h: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(h, self.gate_up_weight).split(self.intermediate, dim=-1)
        return self.down_proj(self.act(gate) * up)


class FusedForward(nn.Module):
    """``forward(input_ids [B, T], position_ids [B, T], attention_mask, past_key_values)`` ->
    logits ``[B, V]`` of the last position, in the model's dtype promoted as transformers does.

    model: a bound (``macattn.models.attention.bind``) LLaMA / Qwen2 / Mistral ``*ForCausalLM``;
    its modules are shared (embedding, norms, O / down projections, LM head); Q/K/V and gate/up are
    concatenated once and the model's own projection weights become views into them (no second copy).
    """

    def __init__(self, model) -> None:
        super().__init__()
        check_supported(model)
        inner = model.model
        self.embed, self.rotary, self.norm, self.lm_head = inner.embed_tokens, inner.rotary_emb, inner.norm, model.lm_head
        self.layers = nn.ModuleList(_FusedLayer(layer) for layer in inner.layers[: model.config.num_hidden_layers])

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask=None,
                past_key_values=None) -> torch.Tensor:
        hidden = self.embed(input_ids)
        cos, sin = self.rotary(hidden, position_ids)
        layers = self.layers
        h = rms_norm(hidden, layers[0].ln1.weight, layers[0].ln1.variance_epsilon)
        residual = hidden
        for i, layer in enumerate(layers):
            a = layer.attention(h, cos, sin, attention_mask, past_key_values)
            h, residual = add_rms_norm(a, residual, layer.ln2.weight, layer.ln2.variance_epsilon)
            m = layer.mlp(h)
            nxt = layers[i + 1].ln1 if i + 1 < len(layers) else self.norm
            h, residual = add_rms_norm(m, residual, nxt.weight, nxt.variance_epsilon)
        return self.lm_head(h[:, -1])
