"""The in-flight batching engine: validate and queue requests, step, stream tokens.

``LLMEngine.add_request`` validates a request completely before it is queued (a bad
request raises ``ValueError`` / ``TypeError`` naming the parameter and touches nothing
else); ``step`` decodes the running batch, prefills newly admitted requests and returns
one ``StepOutput`` per request that produced a token or finished (with async scheduling, the previous step's:
``runtime/in_flight.py``). Not thread-safe: one
thread drives an engine (the Triton model drives it from its own loop thread).

``add_request(..., n=k)`` samples one prompt ``k`` times: the prompt is prefilled once, then ``k - 1``
forks start from it (sharing its full prompt KV blocks, a copy of its per-slot states), fork ``i`` with
seed ``seed + i`` — each sequence equals an independent request with that ``random_seed``.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Callable

import torch

from macattn.core.validation import all_ints
from macattn.methods.base import AttentionMethod, ModelDims
from macattn.methods.registry import method_class

from macattn.runtime.config import RuntimeConfig
from macattn.runtime.executor import ModelExecutor
from macattn.runtime.in_flight import InFlightStep
from macattn.runtime.prefix_cache import PrefixCacheStats
from macattn.runtime.sampling import MAX_SEED, SamplingConfig
from macattn.runtime.scheduler import ScheduledStep, Scheduler
from macattn.runtime.sequence import Sequence
from macattn.runtime.slots import SlotStates

__all__ = ["MethodSpec", "StepOutput", "LLMEngine", "check_input_ids", "MAC_CONFIG_METHOD"]

MAC_CONFIG_METHOD = "mac"
"""The registry name of the engine's default method: the one its ``mac_config`` argument configures."""


@dataclass(frozen=True)
class MethodSpec:
    """An attention method by registry name, its ``config`` (None = the class's ``default_config()``)
    and ``kwargs`` (its other constructor arguments). A tensor-parallel group sends it to every rank,
    which builds the method for its own heads (``factory``)."""

    name: str
    config: object = None
    kwargs: dict = field(default_factory=dict)

    @classmethod
    def of(cls, name: str, mac_config, method_config=None, kwargs: dict | None = None) -> "MethodSpec":
        """The engine's arguments as a spec: ``mac_config`` is the config of the method registered as
        ``MAC_CONFIG_METHOD`` (which then takes no ``method_config``) and ignored for any other, whose
        config is ``method_config``."""
        if name == MAC_CONFIG_METHOD:
            if method_config is not None:
                raise ValueError(f"method={name!r} takes its config as mac_config, not method_config")
            method_config = mac_config
        return cls(name, method_config, dict(kwargs or {}))

    def factory(self, dims: ModelDims, config: RuntimeConfig) -> Callable[[int], AttentionMethod]:
        """``num_slots -> AttentionMethod`` for a model of ``dims`` under ``config`` (resolved), with the
        method class's ``engine_config(self.config)``. A method whose constructor takes ``max_seq_len``
        gets the runtime's."""
        cls = method_class(self.name)
        kwargs = dict(self.kwargs)
        if "max_seq_len" in inspect.signature(cls.__init__).parameters:
            kwargs = {"max_seq_len": config.max_seq_len, **kwargs}
        method_config = cls.engine_config(self.config)
        return lambda num_slots: cls(method_config, dims, num_slots=num_slots, **kwargs)


@dataclass(frozen=True)
class StepOutput:
    """token: the id generated for ``request_id`` this step (None if it only finished). finish_reason:
    ``"length"``, ``"end_id"`` (the end token, not emitted), ``"stop_token_id"`` (a ``stop_token_ids`` token:
    emitted, it is ``token``), ``"aborted"`` or ``"error"`` (serving this request raised: ``error`` names it;
    ``LLMEngine.fail``). logits: the ``[V]`` row it was sampled from (before any
    penalty or bias), on the engine's device. prompt_logprobs: with ``SamplingConfig.prompt_logprobs``, on
    the request's first token (the step its prompt completes), one entry per prompt position: None for
    position 0, else ``{prompt token id: logprob, then the top-k ids: logprob}`` (the same list for every
    fork of a prompt)."""

    request_id: int
    token: int | None
    finished: bool
    finish_reason: str | None = None
    logits: torch.Tensor | None = None
    prompt_logprobs: list | None = None
    error: str | None = None


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
        if not all_ints(input_ids):
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
    factory ``num_slots -> AttentionMethod``; default ``"mac"`` (``MAC_CONFIG_METHOD``) with
    ``mac_config`` (a ``MacConfig``, checked for what the engine runs whatever the method; None = MAC
    disabled: every step runs full attention through the same ops; the class's ``engine_config``).
    ``method_config`` is another named method's config (default: the class's ``default_config()``);
    ``method_kwargs`` its other constructor arguments (e.g. retrieval-completion's ``maps``). A method
    whose constructor takes ``max_seq_len`` gets the runtime's.
    """

    def __init__(self, model, mac_config=None, config: RuntimeConfig | None = None, *,
                 method: str | Callable[[int], AttentionMethod] = MAC_CONFIG_METHOD, method_config=None,
                 method_kwargs: dict | None = None) -> None:
        config = (config or RuntimeConfig()).resolved(model.config.max_position_embeddings)
        self.config = config
        self.mac_config = method_class(MAC_CONFIG_METHOD).engine_config(mac_config)
        if config.tensor_parallel_size > 1:       # rank 0 of a tensor-parallel group; workers hold the other shards
            from macattn.runtime.tensor_parallel import TensorParallelExecutor

            if callable(method):
                raise ValueError("tensor_parallel_size > 1 takes the method by registry name (every rank builds "
                                 "its own for its heads), not a factory")
            self.executor = TensorParallelExecutor(model, MethodSpec.of(method, self.mac_config, method_config,
                                                                        method_kwargs), config)
        else:
            factory = (method if callable(method) else
                       MethodSpec.of(method, self.mac_config, method_config, method_kwargs).factory(
                           ModelDims.of(model.to(config.device)), config))
            self.executor = ModelExecutor(model, factory, config)
        self.method = self.executor.method
        self.slot_states = SlotStates(self.executor.num_slots)
        for name, state in self.executor.slot_states().items():
            self.slot_states.register(name, state)
        if self.executor.decoder is not None:    # the padding rows' scratch, never a request's
            self.executor.reserve_scratch(self.slot_states.acquire())
        caching = self.executor.prefix_caching
        self.scheduler = Scheduler(self.slot_states, self.executor.blocks, on_finish=self._finished,
                                   max_num_batched_tokens=config.max_num_batched_tokens,
                                   max_prefill_tokens=config.max_prefill_tokens, packs=self.executor.packs,
                                   prefix_recompute=self.executor.prefix_recompute_tokens if caching else None,
                                   chunk_quantum=self.executor.chunk_quantum)
        self.vocab_size = model.config.vocab_size
        self.requests: dict[int, Sequence] = {}
        self._in_flight: InFlightStep | None = None      # async scheduling: the step launched, tokens not read

    def _finished(self, seq: Sequence) -> None:
        """A running request's figures as it ends: the method's (read before its slot is reset) and, with prefix
        caching, ``num_cached_tokens`` (vLLM's name: prompt tokens served from cached KV blocks)."""
        seq.metrics.update(self.executor.request_metrics(seq.slot))
        if self.prefix_caching:
            seq.metrics["num_cached_tokens"] = seq.num_cached_tokens

    @property
    def prefix_caching(self) -> bool:
        """Whether automatic prefix caching runs (``RuntimeConfig.enable_prefix_caching``, resolved)."""
        return self.executor.prefix_caching

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        """The prefix cache's counters (``queries`` / ``hits`` in prompt tokens; zeros with caching off)."""
        return self.executor.blocks.stats

    @property
    def prefix_cache_queries(self) -> int:
        """vLLM's ``prefix_cache_queries``: prompt tokens of the requests admitted with a cache lookup."""
        return self.prefix_cache_stats.queries

    @property
    def prefix_cache_hits(self) -> int:
        """vLLM's ``prefix_cache_hits``: prompt tokens served from cached KV blocks (not prefilled)."""
        return self.prefix_cache_stats.hits

    def close(self) -> None:
        """Release what the engine holds: its device memory (``ModelExecutor.close``) or a tensor-parallel
        group's shards. The engine runs nothing after."""
        self.executor.close()

    def method_state(self, name: str):
        """The bound method's per-request state registered as ``name`` (``AttentionMethod.slot_states``),
        None if it has none."""
        return self.method.slot_states().get(name)

    @property
    def mac_state(self):
        """MAC's rings (``MacState``, its slot state ``"mac"``) when the method is MAC, else None."""
        return self.method_state("mac")

    @property
    def model(self):
        return self.executor.model

    # --- requests -------------------------------------------------------------------------
    def make_request(self, input_ids, sampling: SamplingConfig | None = None, *, reuse_prefix: bool = False,
                     n: int = 1, **sampling_kwargs) -> Sequence:
        """Validate and build a request without queueing it (raises on any bad parameter). ``reuse_prefix``:
        load the prompt's KV from the method's prefix store (and persist it there when absent); only a
        method with a store takes it. ``n``: sequences sampled from the prompt; the returned request (index
        0) carries the other ``n - 1`` in ``forks`` (request ids assigned now, seeds ``seed + i``); ``submit``
        queues them all."""
        if sampling is None:
            sampling = SamplingConfig(**sampling_kwargs)
        elif sampling_kwargs:
            raise TypeError("pass either sampling or keyword sampling parameters, not both")
        if not isinstance(sampling, SamplingConfig):
            raise TypeError(f"sampling must be a SamplingConfig, got {type(sampling).__name__}")
        ids = check_input_ids(input_ids, vocab_size=self.vocab_size)
        self._check_token_ids(sampling)
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
        if reuse_prefix and sampling.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs is not available with reuse_prefix=True (the prompt's KV is loaded, "
                             "not computed)")
        self._check_n(n, len(ids), total)
        seq = Sequence(prompt=ids, sampling=sampling, seed=sampling.make_seed(), reuse_prefix=reuse_prefix)
        seq.forks = [Sequence(prompt=ids, sampling=sampling, seed=(seq.seed + i) % (MAX_SEED + 1),
                              reuse_prefix=reuse_prefix, index=i, parent=seq) for i in range(1, n)]
        return seq

    def _check_token_ids(self, sampling: SamplingConfig) -> None:
        """The token ids and top-k of ``sampling`` against the vocabulary (``ValueError`` naming the field)."""
        V = self.vocab_size
        for name, ids in (("logit_bias", [t for t, _ in sampling.logit_bias]),
                          ("stop_token_ids", sampling.stop_token_ids)):
            bad = [t for t in ids if not 0 <= t < V]
            if bad:
                raise ValueError(f"{name} token ids must lie in [0, {V - 1}] (vocab_size={V}), got {bad}")
        # an end_id outside the vocabulary is never generated (accepted as before), but min_tokens bans it
        if sampling.min_tokens and sampling.end_id is not None and not 0 <= sampling.end_id < V:
            raise ValueError(f"end_id must lie in [0, {V - 1}] (vocab_size={V}) with min_tokens > 0, "
                             f"got {sampling.end_id}")
        if sampling.prompt_logprobs is not None and sampling.prompt_logprobs > V:
            raise ValueError(f"prompt_logprobs must be an int in [0, vocab_size={V}], got {sampling.prompt_logprobs}")

    def _check_n(self, n, prompt_len: int, total: int) -> None:
        """``n`` sequences of one prompt fit the engine (slots, KV blocks) and every per-slot state can be
        copied to a fork."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be an int >= 1, got {n!r}")
        if n == 1:
            return
        if self.config.tensor_parallel_size > 1:
            raise NotImplementedError(f"n={n} > 1 cannot run with tensor_parallel_size="
                                      f"{self.config.tensor_parallel_size} yet: a fork's state and KV are copied on "
                                      "rank 0 only")
        slots = self.slot_states.num_slots - (self.executor.scratch_slot is not None)
        if n > slots:
            raise ValueError(f"n={n} > the {slots} request slots (max_batch_size): the sequences of one prompt run "
                             "together")
        missing = self.slot_states.uncopyable()
        if missing:
            raise ValueError(f"n={n} > 1 is not supported with method {self.method.name!r}: its per-slot states "
                             f"{missing} cannot be copied to a fork")
        blocks = self.executor.blocks
        need = blocks.blocks_needed(total)
        need += (n - 1) * (need - blocks.shared_blocks(prompt_len))
        if need > blocks.num_blocks:
            raise ValueError(f"n={n}: the {n} sequences need {need} KV blocks together, the pool has "
                             f"{blocks.num_blocks}")

    def add_request(self, input_ids, sampling: SamplingConfig | None = None, *, n: int | None = None,
                    **sampling_kwargs) -> int | list[int]:
        """Validate and queue one request; returns its request id — or, given ``n``, the request ids of the
        ``n`` sequences sampled from the prompt (``make_request``), index order. Raises ``ValueError`` /
        ``TypeError`` naming the bad parameter (nothing is queued then)."""
        seq = self.make_request(input_ids, sampling, n=1 if n is None else n, **sampling_kwargs)
        self.submit(seq)
        return seq.request_id if n is None else [seq.request_id] + [f.request_id for f in seq.forks]

    def submit(self, seq: Sequence) -> None:
        """Queue ``seq`` (and its forks: they are admitted with it and start from its prompt)."""
        self.requests[seq.request_id] = seq
        for f in seq.forks:
            self.requests[f.request_id] = f
        self.scheduler.add(seq)

    def abort(self, request_id: int) -> None:
        seq = self.requests.get(request_id)
        if seq is not None and not seq.finished:
            self.scheduler.finish(seq, "aborted")

    def fail(self, seq: Sequence, exc: BaseException) -> StepOutput:
        """End ``seq`` (and its unstarted forks) because serving it raised ``exc``: its slot, KV blocks and
        method state are freed as for any finish; the other requests go on."""
        if not seq.finished:
            self.scheduler.finish(seq, "error")
        return StepOutput(seq.request_id, None, True, "error", error=f"{type(exc).__name__}: {exc}")

    def has_unfinished(self) -> bool:
        """Whether a request waits, runs, or has a step in flight whose outputs ``step`` has not returned."""
        return self.scheduler.has_unfinished() or self._in_flight is not None

    def pop_finished(self, request_id: int) -> Sequence:
        seq = self.requests.pop(request_id)
        if not seq.finished:
            self.requests[request_id] = seq
            raise ValueError(f"request {request_id} has not finished")
        return seq

    # --- one step -------------------------------------------------------------------------
    @property
    def async_scheduling(self) -> bool:
        """Whether ``step`` launches a step before reading the one before (``RuntimeConfig.async_scheduling``)."""
        return self.config.async_scheduling

    def step(self, *, sync: bool = False) -> list[StepOutput]:
        """One step: schedule (``Scheduler.schedule``: decodes, then prompt chunks up to
        ``RuntimeConfig.max_num_batched_tokens``), launch (the decode batch, then the prompt chunks packed
        into one model call — or the decode rows inside that call, ``_launch`` — sampled on the device), read
        the tokens and update (append or finish). A request's first token comes with its prompt's last chunk.
        Returns one ``StepOutput`` per request that produced a token or finished.

        With async scheduling (``runtime/in_flight.py``) the step is launched before the previous step's tokens
        are read, and the outputs returned are the previous step's (the last step's come with the next call,
        while ``has_unfinished``). ``sync``: read the step in flight first and run this one serially (a caller
        that must see every token before the next step is scheduled, e.g. bad words spanning tokens)."""
        if not self.async_scheduling or sync:
            return self._read(self._take_in_flight()) + self.execute(self.scheduler.schedule())
        scheduled = self.scheduler.schedule()
        launched = self._launch(scheduled) if scheduled else None
        outputs = self._read(self._take_in_flight())
        self._in_flight = launched
        return outputs

    def execute(self, scheduled: ScheduledStep) -> list[StepOutput]:
        """Run one scheduled step (``Scheduler.schedule``'s) and update its requests (``step`` less the
        scheduling; serially: its tokens are read before it returns)."""
        return self._read(self._launch(scheduled))

    def _take_in_flight(self) -> InFlightStep | None:
        step, self._in_flight = self._in_flight, None
        return step

    def _launch(self, scheduled: ScheduledStep) -> InFlightStep:
        """Run ``scheduled``'s model calls and sampling without reading the tokens back; every sampled request
        gets a pending token. Decode rows that attend in full beside prompt chunks ride the chunks' packed call
        (``ModelExecutor.fuses`` / ``mixed_step``) and are sampled with the prompts' first tokens; otherwise the
        decode batch is its own call. A failed call ends its requests at once (``InFlightStep.early``); a failed
        fused call is run again as its two calls."""
        early: list[StepOutput] = []
        sampled: list[tuple[Sequence, torch.Tensor]] = []
        tokens: list[torch.Tensor] = []
        feed = None if self._in_flight is None else self._in_flight.feed()
        decodes, chunks = list(scheduled.decodes), list(scheduled.prefills)
        fused = self.executor.fuses(decodes, chunks)
        if decodes and not fused:
            self._decode(decodes, feed, early, sampled, tokens)
        if chunks:
            done: list[tuple[Sequence, torch.Tensor]] = []
            try:
                if fused:
                    logits, rows = self.executor.mixed_step(decodes, chunks, feed)
                    done += zip(decodes, logits)
                else:
                    rows = self.executor.prefill_chunks(chunks)
            except Exception as exc:   # noqa: BLE001 - the running requests go on; the prefills: _prefill_alone
                if fused:
                    self._decode(decodes, feed, early, sampled, tokens)
                rows = self._prefill_alone(chunks, exc, early)
            for c in chunks:
                self.scheduler.commit(c)
            for c, row in zip(chunks, rows):
                if row is not None:     # the prompt is prefilled: its forks start from it, sampled from its logits
                    try:
                        done += [(c.seq, row)] + [(f, row) for f in self.scheduler.fork(c.seq, self.executor.fork_kv)]
                    except Exception as exc:   # noqa: BLE001
                        early.append(self.fail(c.seq, exc))
            if done:
                logits = torch.stack([row for _, row in done])
                try:
                    tokens.append(self.executor.sample_on_device([seq for seq, _ in done], logits))
                except Exception as exc:   # noqa: BLE001
                    early += [self.fail(seq, exc) for seq, _ in done]
                else:
                    sampled += zip([seq for seq, _ in done], logits)
        for seq, _ in sampled:
            seq.num_pending += 1
        device = tokens[0].device if tokens else torch.device("cpu")
        return InFlightStep(sampled, torch.cat(tokens) if tokens else torch.empty(0, dtype=torch.int64, device=device),
                            early)

    def _decode(self, batch: list[Sequence], feed, early: list[StepOutput], sampled: list, tokens: list) -> None:
        """The decode batch as its own call (sampled inside it); a failure ends its requests."""
        try:
            got, logits = self.executor.decode_tokens(batch, feed)
        except Exception as exc:   # noqa: BLE001 - the batch's call failed: its requests end, the prefills go on
            early += [self.fail(seq, exc) for seq in batch]
        else:
            sampled += zip(batch, logits)
            tokens.append(got)

    def _read(self, step: InFlightStep | None) -> list[StepOutput]:
        """Read ``step``'s tokens (waits for its GPU work) and update its requests: append or finish. A request
        that ended while the token was computed (its previous token ended it, or it was aborted) drops it."""
        if step is None:
            return []
        outputs = list(step.early)
        for (seq, row), token in zip(step.sampled, step.tokens_on_host()):
            seq.num_pending -= 1
            if not seq.finished:
                outputs.append(self._append_or_fail(seq, token, row))
        return outputs

    def _prefill_alone(self, chunks: list, exc: Exception, outputs: list[StepOutput]) -> list:
        """After the prefill of ``chunks`` raised ``exc``: a prompt's first computed chunk (from position 0, or
        from the end of its cached prefix; nothing was written for it but its own rows, which a rerun rewrites) is
        prefilled again alone (the faulty request raises again and ends alone); any other chunk's request ends
        (its state may hold part of the failed call). Returns the rows ``prefill_chunks`` would have."""
        rows = []
        for c in chunks:
            cause = exc
            if len(chunks) > 1 and c.start == c.seq.num_cached_tokens == c.seq.num_prefilled:
                try:
                    rows += self.executor.prefill_chunks([c])
                    continue
                except Exception as own:   # noqa: BLE001
                    cause = own
            outputs.append(self.fail(c.seq, cause))
            rows.append(None)
        return rows

    def _append_or_fail(self, seq: Sequence, token: int, logits: torch.Tensor) -> StepOutput:
        try:
            return self._append(seq, token, logits)
        except Exception as exc:   # noqa: BLE001 - this request ends, the others keep their token
            return self.fail(seq, exc)

    def _append(self, seq: Sequence, token: int, logits: torch.Tensor) -> StepOutput:
        """Record ``token`` (sampled from ``logits [V]``) for ``seq``; finish it on end_id / a stop token id /
        length. The request's first token carries its prompt log-probabilities (when asked)."""
        first = not seq.output and seq.sampling.prompt_logprobs is not None
        extra = {"prompt_logprobs": seq.prompt_logprobs} if first else {}
        if seq.sampling.end_id is not None and token == seq.sampling.end_id:
            self.scheduler.finish(seq, "end_id")
            return StepOutput(seq.request_id, None, True, "end_id", logits, **extra)
        seq.output.append(token)
        reason = ("stop_token_id" if token in seq.sampling.stop_token_ids else
                  "length" if len(seq.output) >= seq.sampling.max_new_tokens else None)
        if reason is not None:
            self.scheduler.finish(seq, reason)
        return StepOutput(seq.request_id, token, reason is not None, reason, logits, **extra)

    def run_to_completion(self) -> None:
        while self.has_unfinished():
            self.step()
