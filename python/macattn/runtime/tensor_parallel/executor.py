"""Rank 0's executor of a tensor-parallel engine (``TensorParallelExecutor``): what ``LLMEngine`` calls on
a ``ModelExecutor``, each model call broadcast to the workers of its ``TensorParallelGroup`` first; and
what is refused before any process starts (package doc)."""
from __future__ import annotations

import copy
import weakref
from typing import Callable

import torch

from macattn.methods.registry import method_class
from macattn.models.tensor_parallel import ShardLayout, shard_state_dict
from macattn.runtime.config import RuntimeConfig
from macattn.runtime.executor import ModelExecutor
from macattn.runtime.sequence import PrefillChunk, Sequence
from macattn.runtime.tensor_parallel.comm import rank_function, rank_functions
from macattn.runtime.tensor_parallel.group import TensorParallelGroup
from macattn.runtime.tensor_parallel.worker import build_rank

__all__ = ["TensorParallelExecutor", "RandomWeights", "rank_devices", "check_shardable", "refuse_chunked_prompts"]


class RandomWeights:
    """A model source for benchmarks: every rank draws its shard of a ``config`` model at random in
    ``dtype`` (seeded per rank), so no process ever holds the whole model. ``.config`` as a model's."""

    def __init__(self, config, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> None:
        self.config, self.dtype, self.seed = config, dtype, seed


def rank_devices(device: str, size: int) -> list[str]:
    """Rank ``r``'s device: ``"cpu"`` for all, or the ``r``-th CUDA device from ``device``'s index.
    Raises ``ValueError`` naming ``tensor_parallel_size`` and the accepted range when fewer are visible."""
    dev = torch.device(device)
    if dev.type == "cpu":
        return ["cpu"] * size
    if dev.type != "cuda":
        raise ValueError(f"tensor parallelism runs on 'cpu' (gloo) or 'cuda' (NCCL) devices, got {device!r}")
    first = dev.index or 0
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if first + size > visible:
        raise ValueError(f"tensor_parallel_size={size} needs CUDA devices {first}..{first + size - 1}, but "
                         f"{visible} are visible (accepted from cuda:{first}: 1..{max(visible - first, 0)})")
    return [f"cuda:{first + r}" for r in range(size)]


def _wire(seq: Sequence) -> Sequence:
    """What a worker keeps of ``seq``: a copy without the rank-0-only fields."""
    w = copy.copy(seq)
    w.output, w.block_table, w.metrics, w.rag = list(seq.output), list(seq.block_table), {}, None
    return w


class _WorkerSlots:
    """A per-slot state registered with the engine's slot registry on rank 0: a reset queues the same
    reset for every worker's state (``TensorParallelGroup.enqueue``)."""

    def __init__(self, executor: "TensorParallelExecutor") -> None:
        self._ex = executor
        self.num_slots = executor.num_slots

    def reset(self, slot: int) -> None:
        self._ex._mirrored.pop(slot, None)
        self._ex.group.enqueue(self._ex.engine_id, "reset", slot)


def check_shardable(model, spec, size: int) -> ShardLayout:
    """Raise, before any process starts, what a tensor-parallel engine cannot run: a method whose state
    is not sharded with its heads, a FastMKA-patched model, heads not divisible by ``size``."""
    cls = method_class(spec.name)
    if not cls.capabilities.head_sharded:
        from macattn.methods.registry import METHODS

        ok = [n for n, c in METHODS.items() if c.capabilities.head_sharded]
        raise NotImplementedError(f"method={spec.name!r} cannot run with tensor_parallel_size={size}: its "
                                  f"per-request state is not sharded with the heads yet (accepted: {ok})")
    if getattr(model, "_mka_ctx", None) is not None:
        raise NotImplementedError(f"FastMKA-patched models cannot run with tensor_parallel_size={size}: FastMKA's "
                                  "session summary and route-fused K/V are not sharded with the heads yet")
    return ShardLayout.of(model.config, size)


def refuse_chunked_prompts(size: int) -> None:
    """A3's chunked prompts are not sharded: raise ``NotImplementedError`` saying so."""
    raise NotImplementedError(f"A3 chunked prompts (documents=...) cannot run with tensor_parallel_size={size}: "
                              "the fused prefix and the chunk KV store are not sharded with the heads yet")


class TensorParallelExecutor:
    """Rank 0's executor of a tensor-parallel engine: what ``LLMEngine`` calls on a ``ModelExecutor``
    (``decode_step``, ``prefill_chunks``, ``sample``, ``slot_states``, ``request_metrics``,
    ``reserve_scratch``, ``blocks``, ...), each model call broadcast to the workers first. ``local``: the
    ``ModelExecutor`` of shard 0 (other attributes are read from it).

    model: the full ``*ForCausalLM`` (rank 0 slices it and sends each worker its shard) or
    ``RandomWeights`` (each rank draws its own). spec: ``engine.MethodSpec``. config: resolved.
    """

    def __init__(self, model, spec, config: RuntimeConfig) -> None:
        size = config.tensor_parallel_size
        check_shardable(model, spec, size)
        devices = rank_devices(config.device, size)
        self.config = config
        self.group = TensorParallelGroup.get(size, devices, config.tp_timeout_s)
        self.engine_id = self.group.new_engine_id()
        self._mirrored: dict[int, int] = {}         # slot -> request id the workers hold a copy of
        hf = model.config
        random = isinstance(model, RandomWeights)
        dtype = model.dtype if random else next(model.parameters()).dtype
        state = None if random else model.state_dict()
        seed = model.seed if random else None
        build = (hf, spec, config, devices, dtype, seed, state is not None)   # last: rank 0 sends the shards

        def local():
            if state is not None:
                for r in range(1, size):
                    self.group.control.send(shard_state_dict(state, hf, r, size), r)
            return build_rank(0, self.group.comm, build, None if state is None else shard_state_dict(state, hf, 0, size))

        self.local: ModelExecutor = self.group.run(self.engine_id, "build", build, local)
        self._finalizer = weakref.finalize(self, self.group.enqueue, self.engine_id, "drop")

    def __getattr__(self, name: str):
        if name == "local":            # not built (a failed construction)
            raise AttributeError(name)
        return getattr(self.local, name)

    @property
    def size(self) -> int:
        return self.group.size

    def slot_states(self) -> dict:
        return {**self.local.slot_states(), "tensor_parallel_workers": _WorkerSlots(self)}

    def reserve_scratch(self, slot: int) -> None:
        self.local.reserve_scratch(slot)
        self.group.enqueue(self.engine_id, "scratch", slot)

    def _wires(self, seqs: list[Sequence]) -> dict[int, Sequence]:
        """Copies of the requests the workers do not hold yet."""
        out = {}
        for s in seqs:
            if self._mirrored.get(s.slot) != s.request_id:
                out[s.request_id] = _wire(s)
                self._mirrored[s.slot] = s.request_id
        return out

    def prefill_chunks(self, chunks: list[PrefillChunk]) -> list:
        for c in chunks:
            if c.seq.rag is not None:
                refuse_chunked_prompts(self.size)
        wires = self._wires([c.seq for c in chunks])
        rows = [(c.seq.request_id, c.start, c.end) for c in chunks]
        return self.group.run(self.engine_id, "prefill", (rows, wires), lambda: self.local.prefill_chunks(chunks))

    def fuses(self, decodes: list[Sequence], chunks: list[PrefillChunk]) -> bool:
        """Rank 0's ``ModelExecutor.fuses`` (every rank runs the same method and settings)."""
        return self.local.fuses(decodes, chunks)

    def mixed_step(self, decodes: list[Sequence], chunks: list[PrefillChunk], feed=None
                   ) -> tuple[torch.Tensor, list]:
        """``ModelExecutor.mixed_step`` on every rank: the workers get the decode rows' last tokens from the host,
        as for ``decode_step``, and the chunks as for ``prefill_chunks``."""
        if feed is not None or any(s.num_pending for s in decodes):
            raise RuntimeError("a tensor-parallel mixed step needs every request's last token on the host")
        wires = self._wires(list(decodes) + [c.seq for c in chunks])
        rows = ([(s.request_id, len(s.output), s.output[-1]) for s in decodes],
                [(c.seq.request_id, c.start, c.end) for c in chunks])
        return self.group.run(self.engine_id, "mixed", (*rows, wires), lambda: self.local.mixed_step(decodes, chunks))

    def decode_step(self, seqs: list[Sequence]) -> tuple[list[int], torch.Tensor]:
        rows = [(s.request_id, len(s.output), s.output[-1]) for s in seqs]
        return self.group.run(self.engine_id, "decode", (rows, self._wires(seqs)),
                              lambda: self.local.decode_step(seqs))

    def decode_tokens(self, seqs: list[Sequence], feed=None) -> tuple[torch.Tensor, torch.Tensor]:
        """``decode_step`` as tensors. No ``feed``: the workers take each request's last token from the host
        (``RuntimeConfig`` refuses async scheduling under tensor parallelism)."""
        if feed is not None or any(s.num_pending for s in seqs):
            raise RuntimeError("a tensor-parallel decode step needs every request's last token on the host")
        tokens, logits = self.decode_step(seqs)
        return torch.tensor(tokens, dtype=torch.int64), logits

    def decode(self, seqs: list[Sequence]) -> torch.Tensor:
        return self.decode_step(seqs)[1]

    def sample(self, seqs: list[Sequence], logits: torch.Tensor) -> list[int]:
        return self.local.sample(seqs, logits)

    def sample_on_device(self, seqs: list[Sequence], logits: torch.Tensor) -> torch.Tensor:
        return self.local.sample_on_device(seqs, logits)

    def run_on_ranks(self, fn: Callable, *args) -> list:
        """``[fn(executor_r, *args) for every rank r]``: ``fn`` (a module-level function registered with
        ``comm.rank_function`` before the group started: it is pickled by name, and workers resolve only those)
        runs on every rank with that rank's ``ModelExecutor``; results come back in rank order."""
        if (fn.__module__, fn.__qualname__) not in rank_functions():
            raise ValueError(f"fn must be registered with macattn.runtime.tensor_parallel.comm.rank_function "
                             f"(workers resolve no other function), got {fn.__module__}.{fn.__qualname__}")

        def local():
            return self.group.control.gather(fn(self.local, *args))

        return self.group.run(self.engine_id, "run", (fn, args), local)

    def prewarm_graphs(self) -> list[dict[str, list[int]]]:
        """Every rank captures its CUDA graphs together (``ModelExecutor.prewarm_graphs``): a decode bucket's
        capture runs the step's all-reduces, which rank 0 alone would wait on forever. Per rank, in rank order."""
        return self.run_on_ranks(_prewarm_graphs)

    def request_metrics(self, slot: int) -> dict[str, float]:
        """The request's figures over every rank's heads: each rank's ``request_metrics_part``, combined
        by the method (``combine_request_metrics``)."""
        return self.local.method.combine_request_metrics(self.run_on_ranks(_request_metrics_part, slot))

    def close(self) -> None:
        """Release this engine's shards on the workers (queued for the group's next message)."""
        self._finalizer()


@rank_function
def _request_metrics_part(executor: ModelExecutor, slot: int):
    """A rank's share of the figures of the request in ``slot`` (``AttentionMethod.request_metrics_part``)."""
    return executor.method.request_metrics_part(slot)


@rank_function
def _prewarm_graphs(executor: ModelExecutor) -> dict[str, list[int]]:
    """A rank's ``ModelExecutor.prewarm_graphs`` (its buckets' captures, the collectives inside them in step)."""
    return executor.prewarm_graphs()
