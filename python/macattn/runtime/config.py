"""Frozen, validated runtime configuration (batch size, paged KV geometry, device hooks)."""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from macattn.core.validation import check_bool, check_choice, check_float, check_int
from macattn.models.fused import QUANTIZATIONS

__all__ = ["RuntimeConfig", "DEFAULT_CUDA_TOKEN_BUDGET", "DEFAULT_CUDA_PREFILL_TOKENS", "CUDA_CHUNK_QUANTUM",
           "quantized_chunk"]

# Defaults on CUDA, chosen by measurement (benchmarks/notes/serving.md, "Serving at the hardware floor"):
# a step that decodes takes at most this many tokens (vLLM's and SGLang's H100 default too). A prompt stalls
# the running streams for its chunks' time (at 8B shapes on an H100 ~40 ms per 2K tokens), but a long prompt
# in 2K chunks spends ~70 % more time prefilling than in 8K chunks (4 x 32K -> 128: TTFT p50 7.9 vs 6.05 s),
# while 1K-prompt traffic rarely fills even 2K per step ...
DEFAULT_CUDA_TOKEN_BUDGET = 8192
# ... and a step with no running decode (nothing to stall) prefills up to this many: a 32K prompt in one
# call, where cuDNN's square-causal kernel runs (chunks of it take the slower continued path).
DEFAULT_CUDA_PREFILL_TOKENS = 32768
# A prompt chunk that does not end its prompt is a multiple of this many tokens on CUDA (``quantized_chunk``), so
# the chunk shapes of long prompts repeat whatever the number of decodes sharing the step's budget (8192 - 1,
# 8192 - 2, ... would each be new). cuDNN builds an execution plan for every new (queries, keys) shape: ~70 ms, and
# ~1.2 s for the first of its kind, measured inside served 8K chunks on the H100; repeated shapes can be built
# once at start-up (``ModelExecutor.prewarm_graphs``). Costs at most 255 tokens of a step's budget.
CUDA_CHUNK_QUANTUM = 256


def quantized_chunk(tokens: int, quantum: int) -> int:
    """The length of a prompt chunk that does not end its prompt, given ``tokens`` of room: the largest multiple of
    ``quantum`` (``tokens`` itself where the room is less than one quantum)."""
    return tokens // quantum * quantum or tokens


def _positive_int(name: str, value, *, allow_none: bool = False) -> None:
    if not (value is None and allow_none):
        check_int(name, value, 1)


@dataclass(frozen=True)
class RuntimeConfig:
    """How the runtime runs one model.

    max_batch_size: requests decoded together at most = MAC ring slots (``MacState`` rows).
    max_seq_len: prompt + generated tokens per request at most; ``None`` = the model's
        ``max_position_embeddings``.
    block_size: tokens per KV block (paged cache).
    num_blocks: KV blocks in the pool; ``None`` = enough for ``max_batch_size`` requests of
        ``max_seq_len`` tokens.
    device: where weights, KV blocks and rings live (``"cpu"`` runs the reference ops).
    use_cuda_graphs: capture decode steps per batch bucket and replay them (CUDA only; on
        the CPU it raises ``NotImplementedError``). On CUDA decode always runs the whole step per
        batch bucket (``runtime/cuda_decode.py``: the Triton plan over the paged pool, or the
        method's own state); this only chooses graph or eager (eager where the method's decode is
        not capturable). It also captures a packed prefill's work around the attention per token bucket
        up to 2048 tokens (``runtime/prefill_graphs.py``; not under tensor parallelism).
    fused_weights: run the model through ``macattn.models.fused.FusedForward`` (Q/K/V and
        gate/up fused at load, the decode-step kernels between the projections) instead of its
        transformers forward (FastMKA-patched models always run their transformers forward).
    quantization: ``None`` or ``"fp8"`` (weight-only E4M3 projections, one scale per output
        channel, quantised at load; needs ``fused_weights``).
    max_num_batched_tokens: the token budget of one engine step (vLLM's name): the running decodes
        (one token each) plus prompt chunks of the requests being prefilled, packed into one model call,
        so a long prompt never stalls the running streams for more than one budget's prefill (a step whose first
        chunk is the rest of a prompt that fits the budget takes it whole, over the budget by at most its decode
        rows: ``runtime/scheduler.py``); must exceed ``max_batch_size``. ``None`` = ``DEFAULT_CUDA_TOKEN_BUDGET`` on CUDA (chosen by measurement,
        ``benchmarks/notes/serving.md``), whole prompts elsewhere. Prompts that build their KV their own way
        (retrieval-completion, A3's chunked prompts, prefix-store loads) are prefilled whole.
    max_prefill_tokens: the budget of a step in which no request decodes (prompt chunks only, so no
        stream waits on it); at least ``max_num_batched_tokens``. ``None`` = ``DEFAULT_CUDA_PREFILL_TOKENS``
        on CUDA, ``max_num_batched_tokens`` elsewhere.
    enable_prefix_caching: automatic prefix caching (vLLM's flag; ``runtime/block_manager.py``): a request whose
        prompt starts with full KV blocks another request prefilled takes those blocks and prefills only the rest
        (at least the method's ``prefix_recompute_tokens(prompt_len)``, so its state equals a fresh prefill's). ``None`` = on
        where the method supports it (``Capabilities.prefix_caching``, a model without FastMKA), off elsewhere;
        ``True`` where it is not supported raises ``ValueError`` naming the method. Requests that build their KV
        their own way (A3's chunked prompts, prefix-store loads) and requests asking for ``prompt_logprobs`` (every
        position's logits) prefill their whole prompt.
    async_scheduling: launch each engine step before reading the previous step's sampled tokens, so the host's
        work between steps (updating requests, streaming, scheduling, staging inputs) runs while the GPU computes
        (vLLM's ``async_scheduling``, SGLang's overlap scheduler; ``runtime/in_flight.py``): ``LLMEngine.step``
        returns the previous step's outputs. Outputs equal the serial loop's. ``None`` = on exactly on CUDA
        without tensor parallelism (whose workers take each step's tokens from the host); ``True`` under tensor
        parallelism raises ``ValueError``.
    """

    max_batch_size: int = 8
    max_seq_len: int | None = None
    block_size: int = 16
    num_blocks: int | None = None
    device: str = "cpu"
    use_cuda_graphs: bool = False
    fused_weights: bool = True
    quantization: str | None = None
    max_num_batched_tokens: int | None = None
    max_prefill_tokens: int | None = None
    tensor_parallel_size: int = 1
    tp_timeout_s: float = 120.0
    enable_prefix_caching: bool | None = None
    async_scheduling: bool | None = None

    def __post_init__(self) -> None:
        _positive_int("max_batch_size", self.max_batch_size)
        _positive_int("max_seq_len", self.max_seq_len, allow_none=True)
        _positive_int("block_size", self.block_size)
        _positive_int("num_blocks", self.num_blocks, allow_none=True)
        _positive_int("max_num_batched_tokens", self.max_num_batched_tokens, allow_none=True)
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens <= self.max_batch_size:
            raise ValueError(f"max_num_batched_tokens must be > max_batch_size={self.max_batch_size} (a step "
                             f"decodes up to max_batch_size tokens before any prompt chunk), got "
                             f"{self.max_num_batched_tokens}")
        _positive_int("max_prefill_tokens", self.max_prefill_tokens, allow_none=True)
        if (self.max_prefill_tokens is not None and self.max_num_batched_tokens is not None
                and self.max_prefill_tokens < self.max_num_batched_tokens):
            raise ValueError(f"max_prefill_tokens must be >= max_num_batched_tokens={self.max_num_batched_tokens}, "
                             f"got {self.max_prefill_tokens}")
        _positive_int("tensor_parallel_size", self.tensor_parallel_size)
        check_float("tp_timeout_s", self.tp_timeout_s, 0.0, lo_open=True)
        for name in ("use_cuda_graphs", "fused_weights"):
            check_bool(name, getattr(self, name))
        for name in ("enable_prefix_caching", "async_scheduling"):
            if getattr(self, name) is not None:
                check_bool(name, getattr(self, name))
        if self.async_scheduling and self.tensor_parallel_size > 1:
            raise ValueError(f"async_scheduling=True is not available with tensor_parallel_size="
                             f"{self.tensor_parallel_size} (the workers take each step's tokens from the host); pass "
                             "False or None")
        check_choice("quantization", self.quantization, QUANTIZATIONS)
        if self.quantization is not None and not self.fused_weights:
            raise ValueError(f"quantization={self.quantization!r} needs fused_weights=True (the fused forward "
                             "holds the quantised projections)")
        try:
            dev = torch.device(self.device)
        except (RuntimeError, TypeError) as exc:
            raise ValueError(f"device must be a torch device string, got {self.device!r}") from exc
        if self.use_cuda_graphs and dev.type != "cuda":
            raise NotImplementedError(
                "use_cuda_graphs=True needs device='cuda' (CUDA graphs per batch bucket over the "
                "Triton kernels of macattn.plugins); the CPU path runs the reference ops eagerly")
        object.__setattr__(self, "device", str(dev))
        if self.max_prefill_tokens is not None and self.max_num_batched_tokens is None and dev.type != "cuda":
            raise ValueError("max_prefill_tokens needs max_num_batched_tokens off CUDA (without it prompts are "
                             "prefilled whole)")

    def resolved(self, model_max_positions: int) -> "RuntimeConfig":
        """Fill ``max_seq_len`` and ``num_blocks`` from the model's limits."""
        max_seq_len = self.max_seq_len or model_max_positions
        if max_seq_len > model_max_positions:
            raise ValueError(f"max_seq_len={max_seq_len} exceeds the model's max_position_embeddings="
                             f"{model_max_positions}")
        num_blocks = self.num_blocks or self.max_batch_size * -(-max_seq_len // self.block_size)
        budget, prefill = self.max_num_batched_tokens, self.max_prefill_tokens
        if torch.device(self.device).type == "cuda":
            if budget is None:
                budget = max(DEFAULT_CUDA_TOKEN_BUDGET, self.max_batch_size + 1)
            if prefill is None:
                prefill = max(DEFAULT_CUDA_PREFILL_TOKENS, budget)
        if prefill is None:
            prefill = budget
        overlap = self.async_scheduling
        if overlap is None:
            overlap = torch.device(self.device).type == "cuda" and self.tensor_parallel_size == 1
        return replace(self, max_seq_len=max_seq_len, num_blocks=num_blocks, max_num_batched_tokens=budget,
                       max_prefill_tokens=prefill, async_scheduling=overlap)
