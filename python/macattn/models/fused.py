"""A bound LLaMA / Qwen2 / Mistral model's forward with fused weights and fused kernels (issue: the
decode step at the memory-bandwidth floor).

``FusedForward(model)`` takes the weights of a bound ``*ForCausalLM`` at load and keeps, per
layer, Q/K/V as one projection ``[(Hq + 2 Hkv) d, D]`` (biases concatenated for Qwen2) and
gate/up as one ``[2 I, D]``; the model's own projection weights become views into them (one copy).
Between the projections run the decode-step kernels of ``macattn.plugins.decode_step`` (Triton
on CUDA, their plain-torch references elsewhere): RMSNorm fused with the residual add, SiLU·mul,
and — when the KV view is a paged pool taking one token per request (``PagedAppend``, the GPU
decode step) or a packed prefill's tokens to their pool rows (``PackedAppend``) — RoPE of the query
and key heads with the key/value append to the pool in one launch. Per layer that is norm, QKV GEMM, RoPE+append, the method's attention, O GEMM, add+norm,
gate/up GEMM, SiLU·mul, down GEMM. A tensor-parallel shard (``macattn.models.tensor_parallel``) runs
the same, its O and down outputs all-reduced over the ranks.

It computes what the transformers model computes, with transformers' rounding: embedding, per
layer norm -> QKV -> RoPE -> KV update -> the bound method's attention -> O -> residual -> norm ->
gate/up -> SiLU·mul -> down -> residual, final norm, logits of the last position. The attention
call is the bound model's (``macattn.models.attention``), so every method and its per-call
``StepContext`` work unchanged.

``quantization="fp8"``: the four projections of every layer hold FP8 (E4M3) weights with one
scale per output channel (``macattn.plugins.fp8_linear``), quantised here at load from the
checkpoint's weights; decode (<= 16 rows) runs the FP8 GEMV, prefill the dequantised weights. The
embedding, norms and LM head stay in the model's dtype. The model's own bf16 projection weights
are kept (other tools run the transformers forward).
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn

from macattn.models.architectures import check_supported
from macattn.models.attention import attention_forward
from macattn.models.tensor_parallel import RowParallelLinear
from macattn.plugins.decode_step import DecodeStepKernels, kernels_for
from macattn.plugins.decode_step.reference import rotate_half

__all__ = ["FusedForward", "PackedAppend", "PagedAppend", "QUANTIZATIONS"]

QUANTIZATIONS = (None, "fp8")      # weight-only formats FusedForward takes


@runtime_checkable
class PagedAppend(Protocol):
    """A KV view that appends one token per request to a paged pool (the runtime's GPU decode view).

    write_rows ``[B]`` int64: each request's pool row for this step's token; ``pool(layer)``: the
    layer's flat pools ``(k, v)`` ``[P, Hkv, d]``; ``pages(layer)``: what the attention reads."""

    write_rows: torch.Tensor

    def pool(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]: ...

    def pages(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]: ...


@runtime_checkable
class PackedAppend(Protocol):
    """A KV view that writes a packed prefill call's ``N`` tokens (one row, ``B = 1``) to pool ``rows [N]``
    int64 (the runtime's prefill view); ``pool(layer)``: the layer's flat pools ``(k, v)`` ``[P, Hkv, d]``."""

    rows: torch.Tensor

    def pool(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]: ...


class _Linear:
    """``y [R, N] = x [R, K] W^T (+ b)``: the weight as given (``F.linear``) or FP8 weight-only."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, quantization: str | None) -> None:
        self.bias = bias
        self.weight = weight if quantization is None else None
        if quantization == "fp8":
            from macattn.plugins.fp8_linear import fp8_linear, fp8_linear_reference, quantize_fp8_weight

            self.wq, self.scale = quantize_fp8_weight(weight)
            # the Triton GEMV on CUDA, its reference elsewhere: chosen once, by the weights' device
            self._fp8 = fp8_linear if weight.is_cuda else fp8_linear_reference

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight is not None:
            return F.linear(x, self.weight, self.bias)
        return self._fp8(x, self.wq, self.scale, self.bias)

    def tensors(self) -> list[torch.Tensor]:
        """The tensors this projection reads (for byte counts)."""
        own = [self.weight] if self.weight is not None else [self.wq, self.scale]
        return own + ([self.bias] if self.bias is not None else [])


class _AllReduced:
    """A row-parallel projection of a tensor-parallel shard (``models.tensor_parallel``): the rank's partial
    product, summed over the ranks by the module's collectives."""

    def __init__(self, linear: _Linear, comm) -> None:
        self.linear, self.comm = linear, comm

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.comm.all_reduce(self.linear(x).contiguous())

    def tensors(self) -> list[torch.Tensor]:
        return self.linear.tensors()


def _row_parallel(linear: _Linear, module) -> _Linear | _AllReduced:
    """``linear`` (the weights of ``module``), all-reduced when ``module`` is row-parallel."""
    return _AllReduced(linear, module.comm) if isinstance(module, RowParallelLinear) else linear


def _concat(parts: list[torch.Tensor]) -> torch.Tensor:
    """``torch.cat(parts)`` along dim 0 — or, when the parts already lie back to back in one storage
    (a model fused by an earlier ``FusedForward``), the view of that region: no second copy."""
    first = parts[0]
    row = first[0].numel() if first.dim() > 1 else 1
    offset, chained = first.storage_offset(), True
    for p in parts:
        chained &= (p.is_contiguous() and p.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
                    and p.storage_offset() == offset and p.shape[1:] == first.shape[1:])
        offset += p.numel()
    if not chained:
        return torch.cat(parts)
    shape = (sum(p.shape[0] for p in parts), *first.shape[1:])
    return first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(), shape,
                                   (row, 1) if first.dim() > 1 else (1,))


class _FusedLayer(nn.Module):
    """One decoder layer's weights, fused (the model's projections become views into them)."""

    def __init__(self, layer, quantization: str | None) -> None:
        super().__init__()
        attn, mlp = layer.self_attn, layer.mlp
        self.attn = attn            # the attention module: layer_idx, scaling, the binding
        self.head_dim = attn.head_dim
        self.q_size = attn.q_proj.out_features
        self.kv_size = attn.k_proj.out_features
        self.num_q_heads, self.num_kv_heads = self.q_size // self.head_dim, self.kv_size // self.head_dim
        projs = (attn.q_proj, attn.k_proj, attn.v_proj)
        with torch.no_grad():
            self.qkv_weight = nn.Parameter(_concat([p.weight for p in projs]), requires_grad=False)
            has_bias = attn.q_proj.bias is not None
            self.qkv_bias = (nn.Parameter(_concat([p.bias for p in projs]), requires_grad=False)
                             if has_bias else None)
            self.gate_up_weight = nn.Parameter(_concat([mlp.gate_proj.weight, mlp.up_proj.weight]),
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
        if mlp.gate_proj.bias is not None or attn.o_proj.bias is not None or mlp.down_proj.bias is not None:
            raise ValueError("FusedForward takes LLaMA-style MLP / O projections without biases")
        self.qkv = _Linear(self.qkv_weight, self.qkv_bias, quantization)
        self.gate_up = _Linear(self.gate_up_weight, None, quantization)
        self.o = _row_parallel(_Linear(attn.o_proj.weight, None, quantization), attn.o_proj)
        self.down = _row_parallel(_Linear(mlp.down_proj.weight, None, quantization), mlp.down_proj)
        self.ln1, self.ln2 = layer.input_layernorm, layer.post_attention_layernorm

    def project(self, h: torch.Tensor, B: int, T: int, cos: torch.Tensor, sin: torch.Tensor, kv,
                kernels: DecodeStepKernels) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """h ``[B T, D]`` (normed) -> ``(q [B, Hq, T, d], k, v [B, Hkv, S, d], q_pre [B, T, Hq d])``: the QKV
        projection, RoPE and the KV update (``k, v``: what the attention reads; ``q_pre``: pre-RoPE)."""
        d, idx = self.head_dim, self.attn.layer_idx
        qkv = self.qkv(h)
        q_pre = qkv[:, :self.q_size].view(B, T, self.q_size)
        if T == 1 and isinstance(kv, PagedAppend):
            k_pool, v_pool = kv.pool(idx)
            q = kernels.rope_append(qkv, cos.reshape(B, d), sin.reshape(B, d), k_pool, v_pool, kv.write_rows,
                                    self.num_q_heads, self.num_kv_heads).unsqueeze(2)
            k, v = kv.pages(idx)
        elif B == 1 and isinstance(kv, PackedAppend) and (pools := kv.pool(idx))[0].dtype == qkv.dtype:
            # RoPE + append of all N tokens in one launch, then the call's keys / values read back from
            # their rows: [1, H, N, d] views of token-major tensors (the layout flash / cuDNN read)
            k_pool, v_pool = pools
            q = kernels.rope_append(qkv, cos.reshape(T, d), sin.reshape(T, d), k_pool, v_pool, kv.rows,
                                    self.num_q_heads, self.num_kv_heads).transpose(0, 1).unsqueeze(0)
            k = k_pool.index_select(0, kv.rows).transpose(0, 1).unsqueeze(0)
            v = v_pool.index_select(0, kv.rows).transpose(0, 1).unsqueeze(0)
        else:
            q, k, v = qkv.view(B, T, -1).split((self.q_size, self.kv_size, self.kv_size), dim=-1)
            q, k, v = (t.reshape(B, T, -1, d).transpose(1, 2) for t in (q, k, v))
            c, s = cos.unsqueeze(1), sin.unsqueeze(1)
            q, k = q * c + rotate_half(q) * s, k * c + rotate_half(k) * s
            if kv is not None:
                k, v = kv.update(k, v, idx)
        return q, k, v, q_pre

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pre: torch.Tensor,
               attention_mask) -> torch.Tensor:
        """The bound method's attention of ``project``'s outputs -> ``[B T, Hq d]`` (before the O projection)."""
        binding = getattr(self.attn, "_macattn", None)
        if binding is None:
            raise ValueError("FusedForward runs a bound model (macattn.models.attention.bind)")
        if binding.method.capabilities.needs_pre_rope_query:
            binding.q_pre[self.attn.layer_idx] = q_pre
        out, _ = attention_forward(self.attn, q, k, v, attention_mask, scaling=self.attn.scaling)
        return out.reshape(q.shape[0] * q.shape[2], -1)

    def mlp(self, h: torch.Tensor, kernels: DecodeStepKernels) -> torch.Tensor:
        return self.down(kernels.silu_mul(self.gate_up(h)))

    def tensors(self) -> list[torch.Tensor]:
        norms = [self.ln1.weight, self.ln2.weight]
        return norms + [t for p in (self.qkv, self.o, self.gate_up, self.down) for t in p.tensors()]


class FusedForward(nn.Module):
    """``forward(input_ids [B, T], position_ids [B, T], attention_mask, past_key_values, logits_at)`` ->
    logits ``[B, V]`` of the last position, in the model's dtype promoted as transformers does.

    model: a bound (``macattn.models.attention.bind``) LLaMA / Qwen2 / Mistral ``*ForCausalLM``;
    its modules are shared (embedding, norms, LM head); Q/K/V and gate/up are concatenated once and
    the model's own projection weights become views into them. quantization: one of
    ``QUANTIZATIONS`` (module doc). The kernels are picked for the device the weights are on.
    """

    def __init__(self, model, quantization: str | None = None) -> None:
        super().__init__()
        check_supported(model)
        if getattr(model, "_mka_ctx", None) is not None:
            raise ValueError("FusedForward does not run FastMKA-patched models (their K/V come from the "
                             "route-fused op, not from fused Q/K/V weights)")
        if quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
        self.quantization = quantization
        inner = model.model
        self.embed, self.rotary, self.norm, self.lm_head = inner.embed_tokens, inner.rotary_emb, inner.norm, model.lm_head
        self.layers = nn.ModuleList(_FusedLayer(layer, quantization)
                                    for layer in inner.layers[: model.config.num_hidden_layers])
        self.kernels = kernels_for(self.lm_head.weight.device)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask=None,
                past_key_values=None, logits_at: torch.Tensor | None = None) -> torch.Tensor:
        """``logits_at [n]`` int64 (indices into the ``B * T`` tokens): the logits ``[n, V]`` of those
        tokens (a packed prefill's last token per request) instead of each row's last position."""
        B, T = input_ids.shape
        h, residual, cos, sin = self.begin(input_ids, position_ids)
        for i, layer in enumerate(self.layers):
            q, k, v, q_pre = layer.project(h, B, T, cos, sin, past_key_values, self.kernels)
            h, residual = self.finish_layer(i, layer.attend(q, k, v, q_pre, attention_mask), residual)
        return self.logits(h, B, T, logits_at)

    # --- the pieces of ``forward`` (``runtime.prefill_graphs`` captures all but the attention) ---------------
    def begin(self, input_ids: torch.Tensor, position_ids: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``input_ids / position_ids [B, T]`` -> ``(h [B T, D] normed for layer 0, residual [B T, D], cos, sin)``."""
        B, T = input_ids.shape
        hidden = self.embed(input_ids)
        cos, sin = self.rotary(hidden, position_ids)
        first = self.layers[0].ln1
        h, residual = self.kernels.add_rms_norm(hidden.view(B * T, -1), None, first.weight, first.variance_epsilon)
        return h, residual, cos, sin

    def finish_layer(self, i: int, attn_out: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``i`` after its attention: ``attn_out [B T, Hq d]`` -> O projection, residual, MLP, residual ->
        ``(h, residual)``, ``h`` normed for the next layer (the final norm after the last)."""
        k, layers = self.kernels, self.layers
        layer = layers[i]
        h, residual = k.add_rms_norm(layer.o(attn_out), residual, layer.ln2.weight, layer.ln2.variance_epsilon)
        nxt = layers[i + 1].ln1 if i + 1 < len(layers) else self.norm
        return k.add_rms_norm(layer.mlp(h, k), residual, nxt.weight, nxt.variance_epsilon)

    def logits(self, h: torch.Tensor, B: int, T: int, logits_at: torch.Tensor | None = None) -> torch.Tensor:
        """The LM head over final-normed ``h [B T, D]``: each row's last position, or the ``logits_at`` tokens."""
        if logits_at is not None:
            return self.lm_head(h.index_select(0, logits_at))
        return self.lm_head(h.view(B, T, -1)[:, -1])

    @property
    def sharded(self) -> bool:
        """Whether this is a tensor-parallel shard (its O / down projections all-reduce over the ranks)."""
        return any(isinstance(layer.o, _AllReduced) for layer in self.layers)

    def weight_bytes(self) -> int:
        """Bytes a decode step streams from the weights: the layers' projections and norms, the final
        norm and the LM head (the embedding: one row per token, not counted)."""
        tensors = [t for layer in self.layers for t in layer.tensors()] + [self.norm.weight, self.lm_head.weight]
        return sum(t.numel() * t.element_size() for t in tensors)
