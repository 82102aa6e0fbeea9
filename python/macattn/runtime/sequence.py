"""One request's life in the runtime: prompt, generated tokens, slot, KV block table; the forks of a
request sampled ``n`` times (``LLMEngine.add_request(..., n=)``)."""
from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

from macattn.runtime.sampling import SamplingConfig

__all__ = ["SequenceStatus", "Sequence", "PrefillChunk"]

_ids = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"      # validated, queued, owns nothing
    RUNNING = "running"      # owns a state slot and KV blocks
    FORK_PENDING = "fork_pending"   # a fork admitted with its parent: owns a slot and KV blocks (the parent's
                                    # full prompt blocks shared), starts when the parent's prompt is prefilled
    FINISHED = "finished"    # released everything


@dataclass(eq=False)
class Sequence:
    """prompt: token ids (>= 1). output: generated ids (the end token is not kept).

    ``slot`` (MAC ring row / per-slot state index) and ``block_table`` (KV block ids, one per
    ``block_size`` positions) are set by the scheduler at admission and cleared at finish.

    A request sampled ``n`` times is a parent (``index`` 0, prefilled once) carrying its ``n - 1`` forks in
    ``forks`` until its prompt is prefilled; a fork has ``parent`` set and its own ``index``, seed and
    request id, is admitted with its parent and starts from the parent's prompt (``Scheduler.fork``).
    ``prompt_logprobs`` (with ``SamplingConfig.prompt_logprobs``): per prompt position, None for position
    0, else ``{prompt token: logprob, top-k tokens: logprob}``, filled chunk by chunk (shared by the forks).
    """

    prompt: list[int]
    sampling: SamplingConfig
    request_id: int = field(default_factory=lambda: next(_ids))
    output: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    slot: int | None = None
    block_table: list[int] = field(default_factory=list)
    finish_reason: str | None = None          # "length" | "end_id" | "aborted"
    seed: int = 0                             # sampling seed (``SamplingConfig.make_seed``)
    # A3 fused prefill: (RagPrompt, A3Config, ChunkKVStore | None); see runtime/a3_assembly.py
    rag: tuple | None = field(default=None, repr=False)
    # the attention method's figures of this request, set when it finishes (``request_metrics``)
    metrics: dict = field(default_factory=dict)
    num_prefilled: int = 0                    # prompt tokens whose KV is written (chunked prefill)
    # prefix caching: the hash-chain keys of the full prompt blocks (``BlockManager.prompt_keys``), and the
    # prompt tokens whose KV came from cached blocks at admission (not prefilled)
    block_hashes: tuple[bytes, ...] | None = field(default=None, repr=False)
    num_cached_tokens: int = 0
    # load the prompt's KV from the method's prefix store when there (and persist it when not)
    reuse_prefix: bool = False
    prompt_logprobs: list | None = field(default=None, repr=False)
    index: int = 0                            # which of the n samples of its prompt (0: the parent)
    # tokens sampled on the device that the host has not read yet (async scheduling, ``LLMEngine``): 0 or 1; they
    # count as positions (the next step feeds them from the device) but are not in ``output`` until read
    num_pending: int = 0
    forks: list["Sequence"] = field(default_factory=list, repr=False)   # a parent's forks, until they start
    parent: "Sequence | None" = field(default=None, repr=False)         # a fork's parent

    @property
    def parent_id(self) -> int | None:
        """The request id of the request this one is a fork of (None: not a fork)."""
        return None if self.parent is None else self.parent.request_id

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens, read or pending (positions ``0 .. num_tokens - 1``)."""
        return len(self.prompt) + self.num_generated

    @property
    def num_generated(self) -> int:
        """Tokens generated so far: ``output`` plus the pending one."""
        return len(self.output) + self.num_pending

    @property
    def last_token_on_host(self) -> int:
        """The token the next decode step feeds, as the host knows it: the last of ``output``, or 0 while it is
        pending (the step then takes it from the device: ``runtime/in_flight.TokenFeed``)."""
        return 0 if self.num_pending else self.output[-1]

    @property
    def max_tokens(self) -> int:
        """Positions this request can ever occupy: prompt + max_new_tokens."""
        return len(self.prompt) + self.sampling.max_new_tokens

    @property
    def prefilled(self) -> bool:
        """Whether the prompt is prefilled: a first token was sampled (read or pending)."""
        return self.num_generated > 0

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED


@dataclass(frozen=True)
class PrefillChunk:
    """Prompt positions ``start .. end - 1`` of ``seq`` to prefill in one step (``end - start >= 1``)."""

    seq: Sequence
    start: int
    end: int

    @property
    def num_tokens(self) -> int:
        return self.end - self.start

    @property
    def completes_prompt(self) -> bool:
        return self.end == len(self.seq.prompt)
