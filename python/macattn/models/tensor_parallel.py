"""Tensor-parallel shards of a LLaMA / Qwen2 / Mistral model (Megatron-LM's layout, as vLLM and
TensorRT-LLM shard these families).

Rank ``r`` of ``N`` holds:

* Q/K/V (biases too, Qwen2) and gate/up **column-parallel**: the output rows of its
  ``Hq / N`` query heads, ``Hkv / N`` KV heads and ``I / N`` intermediate channels;
* O and down **row-parallel** (``RowParallelLinear``): the matching input columns; each rank's
  partial product is summed by an all-reduce (the two all-reduces of a layer);
* the embedding and the LM head **vocab-parallel** (``VocabParallelEmbedding``,
  ``ParallelLMHead``): rows ``[r * Vr, (r + 1) * Vr)`` of the vocabulary padded to ``N * Vr``
  (zero rows); the embedding sums the one rank's row by an all-reduce, the LM head all-gathers
  the logits so every rank holds the full ``[.., V]`` for sampling;
* norms and RoPE whole.

The shard is an ordinary transformers model whose config counts the rank's heads
(``num_attention_heads = Hq / N``, ``num_key_value_heads = Hkv / N``, ``intermediate_size = I / N``),
so everything built from the config — the attention method's per-request state (MAC rings,
summaries), the paged KV pool, ``FusedForward`` — holds the rank's heads only, and attention needs
no communication: MAC matches per query head. ``config.vocab_size`` stays the full ``V`` (what the
logits carry).

The collectives come from the runtime (``Collectives``: gloo on the CPU, NCCL on GPUs); nothing
here starts processes.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn

from macattn.core.validation import check_int
from macattn.models.architectures import check_supported

__all__ = ["Collectives", "ShardLayout", "RowParallelLinear", "VocabParallelEmbedding", "ParallelLMHead",
           "shard_state_dict", "build_shard"]


@runtime_checkable
class Collectives(Protocol):
    """The collectives a shard's forward runs, over the ``size`` ranks of one tensor-parallel group."""

    rank: int
    size: int

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the ranks, in place; returns ``t``."""
        ...

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """``[..., n]`` on every rank -> ``[..., size * n]``, rank ``r``'s block at ``[r n, (r + 1) n)``."""
        ...


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


@dataclass(frozen=True)
class ShardLayout:
    """How a model of ``config`` splits over ``size`` ranks: per rank ``num_q_heads`` / ``num_kv_heads``
    heads of ``head_dim``, ``intermediate`` MLP channels, ``vocab_per_rank`` vocabulary rows
    (``size * vocab_per_rank >= vocab_size``, the rest zero padding)."""

    size: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    vocab_size: int
    vocab_per_rank: int

    @classmethod
    def of(cls, config, size: int) -> "ShardLayout":
        """Raise ``ValueError`` naming the parameter unless ``size`` divides the query heads, the KV
        heads and the MLP width (the vocabulary is padded instead)."""
        check_int("tensor_parallel_size", size, 1)
        for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
            value = getattr(config, name)
            if value % size:
                accepted = [n for n in range(1, value + 1) if value % n == 0 and config.num_attention_heads % n == 0
                            and config.num_key_value_heads % n == 0 and config.intermediate_size % n == 0]
                raise ValueError(f"tensor_parallel_size={size} must divide {name}={value} (each rank holds "
                                 f"{name} / tensor_parallel_size); accepted for this model: {accepted}")
        return cls(size=size, num_q_heads=config.num_attention_heads // size,
                   num_kv_heads=config.num_key_value_heads // size, head_dim=_head_dim(config),
                   intermediate=config.intermediate_size // size, vocab_size=config.vocab_size,
                   vocab_per_rank=-(-config.vocab_size // size))

    def shard_config(self, config):
        """A copy of ``config`` counting one rank's heads and MLP channels (``vocab_size`` stays ``V``)."""
        c = copy.deepcopy(config)
        c.num_attention_heads, c.num_key_value_heads = self.num_q_heads, self.num_kv_heads
        c.head_dim, c.intermediate_size = self.head_dim, self.intermediate
        c.tie_word_embeddings = False             # the vocab-parallel modules hold their own slices
        c.tensor_parallel_size = self.size
        return c


class RowParallelLinear(nn.Linear):
    """A row-parallel projection (O, down): ``y = all_reduce(x W_r^T) + b`` with ``W_r`` ``[out, in / N]``
    the rank's input columns (the bias, if any, added once, after the sum)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, comm: Collectives) -> None:
        super().__init__(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.comm = comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.comm.all_reduce(F.linear(x, self.weight).contiguous())
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """weight ``[Vr, D]``: vocabulary rows ``[start, start + Vr)``. ``forward(ids [..]) -> [.., D]``:
    each rank looks up the ids it holds (zeros elsewhere) and the ranks' rows are summed."""

    def __init__(self, weight: torch.Tensor, start: int, comm: Collectives) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.start, self.comm = start, comm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return self.comm.all_reduce(out.contiguous())


class ParallelLMHead(nn.Module):
    """weight ``[Vr, D]`` (the rank's vocabulary rows). ``forward(h [.., D]) -> logits [.., V]``: the
    rank's ``[.., Vr]`` all-gathered, the padding columns dropped."""

    def __init__(self, weight: torch.Tensor, vocab_size: int, comm: Collectives) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.vocab_size, self.comm = vocab_size, comm

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.comm.all_gather(F.linear(h, self.weight).contiguous())[..., : self.vocab_size]


def _rows(t: torch.Tensor, rank: int, n: int) -> torch.Tensor:
    return t[rank * n:(rank + 1) * n]


def _vocab_rows(w: torch.Tensor, layout: ShardLayout, rank: int) -> torch.Tensor:
    n = layout.vocab_per_rank
    part = w[rank * n:(rank + 1) * n]
    if part.shape[0] < n:          # the last ranks' padding rows (never looked up, zero logits dropped)
        part = torch.cat([part, part.new_zeros(n - part.shape[0], *part.shape[1:])])
    return part


def shard_state_dict(state: dict, config, rank: int, size: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s tensors of a full model's ``state_dict()`` (``ShardLayout``); keys unchanged.

    Q/K/V / gate / up (and their biases) keep the rank's output rows, O / down its input columns,
    the embedding and LM head its vocabulary rows (zero-padded). Tensors are sliced copies."""
    layout = ShardLayout.of(config, size)
    q, kv, inter = layout.num_q_heads * layout.head_dim, layout.num_kv_heads * layout.head_dim, layout.intermediate
    out = {}
    for key, t in state.items():
        name = key.rsplit(".", 2)
        proj, kind = (name[-2], name[-1]) if len(name) == 3 else (None, None)
        if key in ("model.embed_tokens.weight", "lm_head.weight"):
            t = _vocab_rows(t, layout, rank)
        elif proj == "q_proj":
            t = _rows(t, rank, q)
        elif proj in ("k_proj", "v_proj"):
            t = _rows(t, rank, kv)
        elif proj in ("gate_proj", "up_proj"):
            t = _rows(t, rank, inter)
        elif proj == "o_proj" and kind == "weight":
            t = t[:, rank * q:(rank + 1) * q]
        elif proj == "down_proj" and kind == "weight":
            t = t[:, rank * inter:(rank + 1) * inter]
        out[key] = t.detach().clone()
    if "lm_head.weight" not in out:       # tied embeddings: the LM head is the embedding
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def build_shard(config, shard: dict[str, torch.Tensor] | None, comm: Collectives, *, device, dtype: torch.dtype,
                seed: int | None = None):
    """Rank ``comm.rank``'s model: a ``*ForCausalLM`` of ``ShardLayout.shard_config(config)`` on ``device``
    in ``dtype`` holding ``shard`` (``shard_state_dict``; None = random weights drawn from ``seed``, for
    benchmarks), with O / down row-parallel and the embedding / LM head vocab-parallel (module doc)."""
    from transformers import AutoModelForCausalLM

    layout = ShardLayout.of(config, comm.size)
    cfg = layout.shard_config(config)
    cfg.vocab_size = layout.vocab_per_rank                 # the rank's rows while the modules are built
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0 if seed is None else seed + comm.rank)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=dtype)
    cfg.vocab_size = layout.vocab_size
    check_supported(model)
    if shard is not None:
        missing, unexpected = model.load_state_dict(shard, strict=False)
        missing = [k for k in missing if not k.endswith("rotary_emb.inv_freq")]
        if missing or unexpected:
            raise ValueError(f"shard does not fit the model: missing {missing[:4]}, unexpected {unexpected[:4]}")
    model = model.eval().requires_grad_(False)
    inner = model.model
    start = comm.rank * layout.vocab_per_rank
    inner.embed_tokens = VocabParallelEmbedding(inner.embed_tokens.weight.data, start, comm)
    model.lm_head = ParallelLMHead(model.lm_head.weight.data, layout.vocab_size, comm)
    for layer in inner.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.o_proj = RowParallelLinear(attn.o_proj.weight.data, _data(attn.o_proj.bias), comm)
        mlp.down_proj = RowParallelLinear(mlp.down_proj.weight.data, _data(mlp.down_proj.bias), comm)
    return model


def _data(p):
    return None if p is None else p.data
