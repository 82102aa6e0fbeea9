"""The in-flight batching engine: validate and queue requests, step, stream tokens.

``LLMEngine.add_request`` validates a request completely before it is queued (a bad
request raises ``ValueError`` / ``TypeError`` naming the parameter and touches nothing
else); ``step`` decodes the running batch, prefills newly admitted requests and returns
one ``StepOutput`` per request that produced a token or finished. Not thread-safe: one
thread drives an engine (the Triton model drives it from its own loop thread).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Callable

import torch

from macattn.methods.base import AttentionMethod, ModelDims
from macattn.methods.mac.backend import MacAttention
from macattn.methods.mac.config import MacConfig
from macattn.methods.registry import method_class

from macattn.runtime.config import RuntimeConfig
from macattn.runtime.executor import ModelExecutor
from macattn.runtime.sampling import SamplingParams
from macattn.runtime.scheduler import Scheduler
from macattn.runtime.sequence import Sequence
from macattn.runtime.slots import SlotStates

__all__ = ["MethodSpec", "StepOutput", "LLMEngine", "check_input_ids"]


@dataclass(frozen=True)
class MethodSpec:
    """An attention method by registry name and its configuration: ``mac_config`` (MAC's),
    ``method_config`` (another method's; None = its config type's defaults), ``kwargs`` (its other
    constructor arguments). A tensor-parallel group sends it to every rank, which builds the method
    for its own heads (``factory``)."""

    name: str
    mac_config: MacConfig
    method_config: object = None
    kwargs: dict = field(default_factory=dict)

    def factory(self, dims: ModelDims, config: RuntimeConfig) -> Callable[[int], AttentionMethod]:
        """``num_slots -> AttentionMethod`` for a model of ``dims`` under ``config`` (resolved). A method
        whose constructor takes ``max_seq_len`` gets the runtime's."""
        cls = method_class(self.name)
        kwargs = dict(self.kwargs)
        if "max_seq_len" in inspect.signature(cls.__init__).parameters:
            kwargs = {"max_seq_len": config.max_seq_len, **kwargs}
        if cls is MacAttention:
            if self.method_config is not None:
                raise ValueError("pass MAC's config as mac_config, not method_config")
            method_config = self.mac_config
        else:
            method_config = self.method_config if self.method_config is not None else cls.config_type()
        return lambda num_slots: cls(method_config, dims, num_slots=num_slots, **kwargs)


@dataclass(frozen=True)
class StepOutput:
    """token: the id generated for ``request_id`` this step (None if it only finished). logits: the
    ``[V]`` row it was sampled from, on the engine's device."""

    request_id: int
    token: int | None
    finished: bool
    finish_reason: str | None = None
    logits: torch.Tensor | None = None


def check_input_ids(input_ids, *, vocab_size: int, name: str = "input_ids") -> list[int]:
    """A 1-D integer tensor / sequence of ints in ``[0, vocab_size)`` with >= 1 token -> ``list[int]``."""
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
            raise TypeError(f"{name} must be an integer tensor (int32/int64), got dtype {input_ids.dtype}")
        if input_ids.dim() == 2 and input_ids.shape[0] == 1:
            input_ids = input_ids[0]
        if input_ids.dim() != 1:
            raise ValueError(f"{name} must be 1-D [seq_len], got shape {tuple(input_ids.shape)}")
        ids = input_ids.tolist()
    elif isinstance(input_ids, (list, tuple)):
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in input_ids):
            raise TypeError(f"{name} must be a sequence of ints or an integer tensor")
        ids = list(input_ids)
    else:
        raise TypeError(f"{name} must be an integer tensor or a list of ints, got {type(input_ids).__name__}")
    if not ids:
        raise ValueError(f"{name} is empty: a prompt needs at least one token")
    lo, hi = min(ids), max(ids)
    if lo < 0 or hi >= vocab_size:
        raise ValueError(f"{name} must lie in [0, {vocab_size - 1}] (vocab_size={vocab_size}), got [{lo}, {hi}]")
    return ids


class LLMEngine:
    """model: a LLaMA / Qwen2 / Mistral ``*ForCausalLM``.

    method: the attention method, by registry name (``macattn.methods.registry``) or as a
    factory ``num_slots -> AttentionMethod``; default ``"mac"`` with ``mac_config`` (None = MAC
    disabled: every step runs full attention through the same ops). ``method_config`` is the
    named method's config (default: its config type's defaults); ``method_kwargs`` its other
    constructor arguments (e.g. retrieval-completion's ``maps``). A method whose constructor takes
    ``max_seq_len`` gets the runtime's.
    """

    def __init__(self, model, mac_config: MacConfig | None = None, config: RuntimeConfig | None = None, *,
                 method: str | Callable[[int], AttentionMethod] = "mac", method_config=None,
                 method_kwargs: dict | None = None) -> None:
        config = (config or RuntimeConfig()).resolved(model.config.max_position_embeddings)
        self.config = config
        self.mac_config = mac_config if mac_config is not None else MacConfig(enabled=False)
        self.mac_config.require_engine_support("ModelRunner")
        if config.tensor_parallel_size > 1:       # rank 0 of a tensor-parallel group; workers hold the other shards
            from macattn.runtime.tensor_parallel import TensorParallelExecutor

            if callable(method):
                raise ValueError("tensor_parallel_size > 1 takes the method by registry name (every rank builds "
                                 "its own for its heads), not a factory")
            self.executor = TensorParallelExecutor(model, MethodSpec(method, self.mac_config, method_config,
                                                                     method_kwargs or {}), config)
        else:
            factory = (method if callable(method) else
                       MethodSpec(method, self.mac_config, method_config, method_kwargs or {}).factory(
                           ModelDims.of(model.to(config.device)), config))
            self.executor = ModelExecutor(model, factory, config)
        self.method = self.executor.method
        self.slot_states = SlotStates(self.executor.num_slots)
        for name, state in self.executor.slot_states().items():
            self.slot_states.register(name, state)
        if self.executor.decoder is not None:    # the padding rows' scratch, never a request's
            self.executor.reserve_scratch(self.slot_states.acquire())
        self.scheduler = Scheduler(self.slot_states, self.executor.blocks,
                                   on_finish=lambda seq: seq.metrics.update(self.executor.request_metrics(seq.slot)))
        self.vocab_size = model.config.vocab_size
        self.requests: dict[int, Sequence] = {}

    def close(self) -> None:
        """Release what the engine holds outside this process (a tensor-parallel group's shards)."""
        self.executor.close()

    @property
    def mac_state(self):
        """The MAC rings (``MacState``) when the method is MAC, else None."""
        return getattr(self.method, "state", None) if isinstance(self.method, MacAttention) else None

    @property
    def model(self):
        return self.executor.model

    # --- requests -------------------------------------------------------------------------
    def make_request(self, input_ids, sampling: SamplingParams | None = None, *, reuse_prefix: bool = False,
                     **sampling_kwargs) -> Sequence:
        """Validate and build a request without queueing it (raises on any bad parameter). ``reuse_prefix``:
        load the prompt's KV from the method's prefix store (and persist it there when absent); only a
        method with a store takes it."""
        if sampling is None:
            sampling = SamplingParams(**sampling_kwargs)
        elif sampling_kwargs:
            raise TypeError("pass either sampling or keyword sampling parameters, not both")
        if not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        ids = check_input_ids(input_ids, vocab_size=self.vocab_size)
        total = len(ids) + sampling.max_new_tokens
        if total > self.config.max_seq_len:
            raise ValueError(f"input_ids too long: {len(ids)} prompt tokens + max_new_tokens="
                             f"{sampling.max_new_tokens} = {total} > max_seq_len={self.config.max_seq_len}")
        blocks = self.executor.blocks
        if blocks.blocks_needed(total) > blocks.num_blocks:
            raise ValueError(f"input_ids too long: {total} tokens need {blocks.blocks_needed(total)} KV blocks, "
                             f"the pool has {blocks.num_blocks}")
        self.method.check_request(len(ids), sampling.max_new_tokens)
        if not isinstance(reuse_prefix, bool):
            raise TypeError(f"reuse_prefix must be a bool, got {type(reuse_prefix).__name__}")
        if reuse_prefix and getattr(self.method, "store", None) is None:
            raise ValueError(f"reuse_prefix=True needs a method with a prefix store; {self.method.name!r} has none")
        return Sequence(prompt=ids, sampling=sampling, seed=sampling.make_seed(), reuse_prefix=reuse_prefix)

    def add_request(self, input_ids, sampling: SamplingParams | None = None, **sampling_kwargs) -> int:
        """Validate and queue one request; returns its request id. Raises ``ValueError`` /
        ``TypeError`` naming the bad parameter (nothing is queued then)."""
        seq = self.make_request(input_ids, sampling, **sampling_kwargs)
        self.submit(seq)
        return seq.request_id

    def submit(self, seq: Sequence) -> None:
        self.requests[seq.request_id] = seq
        self.scheduler.add(seq)

    def abort(self, request_id: int) -> None:
        seq = self.requests.get(request_id)
        if seq is not None and not seq.finished:
            self.scheduler.finish(seq, "aborted")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def pop_finished(self, request_id: int) -> Sequence:
        seq = self.requests.pop(request_id)
        if not seq.finished:
            self.requests[request_id] = seq
            raise ValueError(f"request {request_id} has not finished")
        return seq

    # --- one step -------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """Decode every running request that has a token, then prefill: new admissions whole, or with
        ``RuntimeConfig.prefill_chunk`` at most that many prompt tokens across the requests being
        prefilled (admission order); a request's first token comes with its prompt's last chunk."""
        outputs: list[StepOutput] = []
        batch = self.scheduler.decode_batch()
        if batch:
            tokens, logits = self.executor.decode_step(batch)
            for seq, token, row in zip(batch, tokens, logits):
                outputs.append(self._append(seq, token, row))
        self.scheduler.admit()
        budget = self.config.prefill_chunk
        for seq in self.scheduler.prefilling():
            if budget is not None and budget <= 0:
                break
            logits, used = self.executor.prefill_part(seq, budget)
            budget = None if budget is None else budget - used
            if logits is not None:
                outputs.append(self._append(seq, self.executor.sample([seq], logits[None])[0], logits))
        return outputs

    def _append(self, seq: Sequence, token: int, logits: torch.Tensor) -> StepOutput:
        """Record ``token`` (sampled from ``logits [V]``) for ``seq``; finish it on end_id / length."""
        if seq.sampling.end_id is not None and token == seq.sampling.end_id:
            self.scheduler.finish(seq, "end_id")
            return StepOutput(seq.request_id, None, True, "end_id", logits)
        seq.output.append(token)
        if len(seq.output) >= seq.sampling.max_new_tokens:
            self.scheduler.finish(seq, "length")
            return StepOutput(seq.request_id, token, True, "length", logits)
        return StepOutput(seq.request_id, token, False, None, logits)

    def run_to_completion(self) -> None:
        while self.has_unfinished():
            self.step()
