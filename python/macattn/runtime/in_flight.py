"""Async scheduling (vLLM v1's async scheduling, SGLang's overlap scheduler): a launched step whose sampled tokens
the host reads only after it has launched the next step.

``LLMEngine.step`` with ``RuntimeConfig.async_scheduling`` schedules and launches step ``n + 1`` while step ``n``
runs on the GPU, then reads step ``n``'s tokens (the one host synchronisation per step) and updates its requests:
appends, finishes, streams. A request decoded in step ``n`` is decoded again in step ``n + 1`` before the host knows
its token: the token counts as a position (``Sequence.num_pending``) and step ``n + 1`` takes it from the device
(``TokenFeed``). What the host cannot know in advance costs one wasted row: a request whose step-``n`` token is its
end or stop token also runs in step ``n + 1``, whose token is dropped (its KV write and state updates land before
any later request's, in stream order, so a reused slot or block is rewritten after them). A finish by length is
known in advance (``Scheduler.decode_batch``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
import torch

from macattn.runtime.sequence import Sequence

__all__ = ["TokenFeed", "InFlightStep", "device_index"]


def device_index(values: list[int], device: torch.device) -> torch.Tensor:
    """``values`` as an int64 tensor on ``device``; on CUDA through pinned memory without a host synchronisation
    (a pageable copy would wait for the stream: the step in flight)."""
    t = torch.tensor(values, dtype=torch.int64)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


@dataclass(frozen=True)
class TokenFeed:
    """The tokens of the step in flight, for the next step's inputs: ``tokens [R]`` int64 on the device, ``rows``
    request id -> its row in ``tokens``."""

    tokens: torch.Tensor
    rows: dict[int, int]

    def write(self, ids: torch.Tensor, seqs: list[Sequence]) -> None:
        """Set row ``i`` of ``ids`` (``[B]`` or ``[B, 1]``, contiguous, on the device; ``B >= len(seqs)``) to
        ``seqs[i]``'s pending token, for every request with one (stream-ordered after the host's writes)."""
        dst = [i for i, s in enumerate(seqs) if s.num_pending]
        if not dst:
            return
        missing = [seqs[i].request_id for i in dst if seqs[i].request_id not in self.rows]
        if missing:
            raise RuntimeError(f"requests {missing} have a pending token that is not in the step in flight")
        idx = device_index(dst + [self.rows[seqs[i].request_id] for i in dst], ids.device)
        n = len(dst)
        ids.view(-1).index_copy_(0, idx[:n], self.tokens.index_select(0, idx[n:]))


@dataclass
class InFlightStep:
    """A launched step: ``sampled`` (request, the logits row ``[V]`` its token was sampled from) in the order of
    ``tokens [R]`` (int64, on the device); ``early``: ``StepOutput`` s already known at launch (calls that failed).
    ``read`` starts the tokens' copy to the host at launch; ``tokens_on_host`` waits for it."""

    sampled: list[tuple[Sequence, torch.Tensor]]
    tokens: torch.Tensor
    early: list = field(default_factory=list)
    _host: torch.Tensor | None = None
    _ready: torch.cuda.Event | None = None

    def __post_init__(self) -> None:
        if self.tokens.is_cuda:
            self._host = torch.empty(self.tokens.shape, dtype=self.tokens.dtype, pin_memory=True)
            self._host.copy_(self.tokens, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()
        else:
            self._host = self.tokens

    def feed(self) -> TokenFeed:
        return TokenFeed(self.tokens, {seq.request_id: i for i, (seq, _) in enumerate(self.sampled)})

    def tokens_on_host(self) -> list[int]:
        """The sampled tokens (waits for this step's GPU work)."""
        if self._ready is not None:
            self._ready.synchronize()
        return self._host.tolist()
