"""Tensor parallelism: one model over ``N`` ranks, each a process holding its heads' shard.

``RuntimeConfig(tensor_parallel_size=N)`` (``LLM(..., tensor_parallel_size=N)``,
``ModelRunner.from_hf(..., tp_size=N)``, ``macattn serve --tp N``) makes the engine's executor a
``TensorParallelExecutor``: this process is **rank 0** — it holds shard 0 and runs the engine's one
scheduler — and ranks ``1 .. N-1`` are worker processes (``torch.multiprocessing``, spawn) of a
``TensorParallelGroup``. The shards (``macattn.models.tensor_parallel``: Q/K/V and gate/up
column-parallel, O and down row-parallel with an all-reduce, embedding and LM head vocab-parallel with
a gather for sampling) are ordinary bound models, so every rank runs an unchanged ``ModelExecutor``
(paged KV, the method's per-request state, chunked prefill, on CUDA the per-bucket CUDA graphs) over
its heads; MAC's rings, summaries and KV are each rank's own heads' — MAC matches per query head, so
attention needs no communication.

Per engine operation rank 0 broadcasts the step — the op (build / prefill / decode / run), its
requests (a request's prompt once; then per decode the token fed), and the slot resets and releases
queued since the last one — over a gloo **control group**, then every rank runs the same executor
call; the model's collectives run in the **model group** (NCCL on GPUs, gloo on the CPU). Rank 0
samples from the gathered logits; the workers' sampled tokens are never used (each decode carries the
token rank 0 appended).

Failures never hang: a collective of the model group waits ``RuntimeConfig.tp_timeout_s`` at most (a
dead peer's closed connection ends it at once on gloo; rank 0 watches its workers and aborts the groups
when one dies); a worker whose op or collective fails prints
``macattn tensor-parallel rank r: ...`` and exits; rank 0 then raises ``TensorParallelError`` naming the
rank(s) that died and their exit codes, and stops the others (their connections close; survivors are
terminated after a grace period). Workers die with rank 0 (``PR_SET_PDEATHSIG``, and the control
connection closing). A broken group refuses every later call with the same error.

On GPUs a peer that dies while rank 0 is inside a collective leaves rank 0's stream on an NCCL kernel that
never finishes, and ``ncclCommAbort`` does not release it (measured on two H200s, NCCL 2.28: the abort
itself times out): rank 0's process cannot continue. As torch's own NCCL watchdog does on a collective
timeout, rank 0 then stops its workers, prints ``macattn tensor-parallel: ...`` naming the dead rank and
exits with code ``EXIT_WEDGED`` (70) once the op has not returned for ``_WEDGE_GRACE_S``. A server in
front of the engine is a process to restart; a library user who must survive a lost GPU worker runs the
engine in a child process.

Methods: those whose ``capabilities.head_sharded`` is set (``full``, ``mac``); any other, FastMKA-patched
models and A3 chunked prompts raise ``NotImplementedError`` naming what is not sharded. Worker processes
are spawned: a script that builds a tensor-parallel engine at import time needs the usual
``if __name__ == "__main__":`` guard.
"""
from __future__ import annotations

import atexit
import copy
import ctypes
import datetime
import gc
import itertools
import os
import pickle
import signal
import sys
import threading
import time
import weakref
from dataclasses import replace
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from macattn.methods.base import ModelDims
from macattn.methods.registry import method_class
from macattn.models.attention import unbind
from macattn.models.tensor_parallel import ShardLayout, build_shard, shard_state_dict

from macattn.runtime.config import RuntimeConfig
from macattn.runtime.executor import ModelExecutor
from macattn.runtime.sequence import PrefillChunk, Sequence

__all__ = ["TensorParallelError", "TensorParallelGroup", "TensorParallelExecutor", "RandomWeights",
           "rank_devices", "refuse_chunked_prompts", "shutdown_all"]

_CONTROL_IDLE = datetime.timedelta(days=365)   # a worker waits for the next step as long as rank 0 lives
_INLINE = 8192                                 # control message bytes sent in the first broadcast
_EXIT_OWN_ERROR = 1                            # a worker's own op raised
_EXIT_PEER_GONE = 3                            # a worker lost a peer (its collective failed)
EXIT_WEDGED = 70                               # rank 0: a dead peer left this process's NCCL stream stuck
_WEDGE_GRACE_S = 10.0                          # how long an op in flight may outlive the abort


class TensorParallelError(RuntimeError):
    """A rank of a tensor-parallel group died or failed; the group is stopped."""


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


# --- collectives ---------------------------------------------------------------------------------
class _Collectives:
    """``macattn.models.tensor_parallel.Collectives`` over one process-group backend (gloo / NCCL)."""

    def __init__(self, pg, rank: int, size: int) -> None:
        self.pg, self.rank, self.size = pg, rank, size

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        self.pg.allreduce([t]).wait()
        return t

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        n = t.shape[-1]
        flat = t.reshape(-1, n)
        out = torch.empty(self.size * flat.shape[0], n, dtype=t.dtype, device=t.device)
        self.pg._allgather_base(out, flat).wait()
        return out.view(self.size, -1, n).permute(1, 0, 2).reshape(*t.shape[:-1], self.size * n)


class _Control:
    """Pickled objects over the gloo control group: rank 0 broadcasts, sends shards, gathers results."""

    def __init__(self, pg, rank: int, size: int) -> None:
        self.pg, self.rank, self.size = pg, rank, size

    @staticmethod
    def _encode(obj) -> torch.Tensor:
        return torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)

    def broadcast(self, obj=None):
        """Rank 0's ``obj`` on every rank (the others pass nothing): one broadcast of ``_INLINE`` bytes
        (length + payload) when the pickle fits, the rest in a second one (a prompt's first step)."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        head = torch.zeros(8 + _INLINE, dtype=torch.uint8)
        if self.rank == 0:
            data = self._encode(obj)
            n = data.numel()
            head[:8] = torch.tensor([n], dtype=torch.int64).view(torch.uint8)
            head[8:8 + min(n, _INLINE)] = data[:_INLINE]
        self.pg.broadcast([head], opts).wait()
        n = int(head[:8].view(torch.int64))
        if n > _INLINE:
            rest = data[_INLINE:].clone() if self.rank == 0 else torch.empty(n - _INLINE, dtype=torch.uint8)
            self.pg.broadcast([rest], opts).wait()
        if self.rank == 0:
            return obj
        payload = head[8:8 + n].numpy().tobytes() + (rest.numpy().tobytes() if n > _INLINE else b"")
        return pickle.loads(payload)

    def send(self, obj, dst: int) -> None:
        data = self._encode(obj)
        self.pg.send([torch.tensor([data.numel()], dtype=torch.int64)], dst, 0).wait()
        self.pg.send([data], dst, 1).wait()

    def recv(self, src: int = 0):
        n = torch.zeros(1, dtype=torch.int64)
        self.pg.recv([n], src, 0).wait()
        data = torch.empty(int(n), dtype=torch.uint8)
        self.pg.recv([data], src, 1).wait()
        return pickle.loads(data.numpy().tobytes())

    def gather(self, obj) -> list:
        """Every rank's ``obj``, in rank order (on every rank)."""
        data = self._encode(obj)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.size)]
        self.pg.allgather([sizes], [torch.tensor([data.numel()], dtype=torch.int64)]).wait()
        width = max(int(s) for s in sizes)
        padded = torch.zeros(width, dtype=torch.uint8)
        padded[:data.numel()] = data
        outs = [torch.empty(width, dtype=torch.uint8) for _ in range(self.size)]
        self.pg.allgather([outs], [padded]).wait()
        return [pickle.loads(o[:int(s)].numpy().tobytes()) for o, s in zip(outs, sizes)]


def _process_groups(store, rank: int, size: int, backend: str, timeout_s: float):
    """``(control, model)`` backends: gloo for the control group (idle waits last as long as rank 0
    lives), ``backend`` for the model group with ``timeout_s`` per collective."""
    timeout = datetime.timedelta(seconds=timeout_s)
    ctl = dist.ProcessGroupGloo(dist.PrefixStore("ctl", store), rank, size, timeout)
    ctl.set_timeout(_CONTROL_IDLE)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts.is_high_priority_stream = False
        opts._timeout = timeout
        model = dist.ProcessGroupNCCL(dist.PrefixStore("model", store), rank, size, opts)
    else:
        model = dist.ProcessGroupGloo(dist.PrefixStore("model", store), rank, size, timeout)
    return ctl, model


# --- rank 0's side of a group --------------------------------------------------------------------
class TensorParallelGroup:
    """Rank 0's handle on ``size - 1`` spawned workers (ranks ``1 .. size-1`` on ``devices[1:]``) and the
    control / model groups. One group serves any number of engines (each an engine id on the workers);
    ``TensorParallelGroup.get`` reuses a live one of the same size, devices and timeout."""

    _live: dict[tuple, "TensorParallelGroup"] = {}
    _live_lock = threading.Lock()

    def __init__(self, size: int, devices: list[str], timeout_s: float) -> None:
        self.size, self.devices, self.timeout_s = size, devices, timeout_s
        self.backend = "nccl" if devices[0].startswith("cuda") else "gloo"
        self.lock = threading.RLock()
        self.broken: str | None = None
        self._pending: list[tuple] = []            # (engine id, action, arg) for the workers' next message
        self._pending_lock = threading.Lock()
        self._engine_ids = itertools.count()
        self._in_op = False                          # rank 0 is inside ``run`` (the watch thread reads it)
        self.procs: list = []
        store = dist.TCPStore("127.0.0.1", 0, size, True, timeout=datetime.timedelta(seconds=timeout_s),
                              wait_for_workers=False)
        ctx = mp.get_context("spawn")
        threads = max(1, (os.cpu_count() or 1) // size)
        try:
            for r in range(1, size):
                p = ctx.Process(target=_worker_main, name=f"macattn-tp-rank{r}", daemon=True,
                                args=(r, size, store.port, devices[r], self.backend, timeout_s, os.getpid(), threads))
                p.start()
                self.procs.append(p)
            ctl, model = _process_groups(store, 0, size, self.backend, timeout_s)
        except BaseException as exc:
            self._stop_processes(0.0)
            raise TensorParallelError(f"could not start a tensor-parallel group of {size} ranks: {exc}"
                                      f"{self._dead_summary()}") from exc
        self._store = store
        self.control = _Control(ctl, 0, size)
        self.comm = _Collectives(model, 0, size)
        threading.Thread(target=self._watch, name="macattn-tp-watch", daemon=True).start()

    def _watch(self) -> None:
        """Abort the groups as soon as a worker dies: an op rank 0 has in flight then fails at once instead
        of at the collective timeout (gloo). An NCCL op that still has not returned ``_WEDGE_GRACE_S`` later
        is stuck on the GPU for good: exit (module doc)."""
        while self.broken is None:
            if self._dead():
                for part in (self.comm, self.control):
                    # the NCCL abort can block (module doc): never on this thread
                    threading.Thread(target=_abort_quietly, args=(part,), daemon=True).start()
                if self.backend == "nccl":
                    deadline = time.monotonic() + _WEDGE_GRACE_S
                    while self._in_op and time.monotonic() < deadline:
                        threading.Event().wait(0.1)
                    if self._in_op:
                        self._exit_wedged()
                return
            threading.Event().wait(0.2)

    def _exit_wedged(self) -> None:
        msg = (f"macattn tensor-parallel: the group of {self.size} ranks stopped during a collective"
               f"{self._dead_summary()}; NCCL cannot release this process's GPU stream, so the process exits "
               f"with code {EXIT_WEDGED} (restart it, or run the engine in a child process)")
        print(msg, file=sys.stderr, flush=True)
        for p in self.procs:
            if p.is_alive():
                p.kill()
        os._exit(EXIT_WEDGED)

    @classmethod
    def get(cls, size: int, devices: list[str], timeout_s: float) -> "TensorParallelGroup":
        key = (size, tuple(devices), timeout_s)
        with cls._live_lock:
            group = cls._live.get(key)
            if group is None or group.broken is not None:
                group = cls._live[key] = cls(size, devices, timeout_s)
            return group

    def new_engine_id(self) -> int:
        return next(self._engine_ids)

    def enqueue(self, engine_id: int, action: str, arg=None) -> None:
        """Queue a slot reset / scratch reservation / engine release for the workers' next message (no
        communication now: safe from finalizers and from inside an op)."""
        with self._pending_lock:
            self._pending.append((engine_id, action, arg))

    def run(self, engine_id: int, op: str, args: tuple, local: Callable[[], Any]):
        """Broadcast ``(pending, engine_id, op, args)`` and run ``local()`` (rank 0's share of the op, which
        runs the same collectives as the workers'). Any failure stops the group: ``TensorParallelError``."""
        with self.lock:
            if self.broken is not None:
                raise TensorParallelError(self.broken)
            dead = self._dead()
            if dead:
                raise self._fail(None)
            try:
                with self._pending_lock:
                    pending, self._pending = self._pending, []
                self._in_op = True
                self.control.broadcast((pending, engine_id, op, args))
                return local()
            except BaseException as exc:
                raise self._fail(exc) from exc
            finally:
                self._in_op = False

    # --- failure and shutdown ----------------------------------------------------------------
    def _dead(self) -> list:
        return [(r, p) for r, p in enumerate(self.procs, 1) if not p.is_alive()]

    def _dead_summary(self) -> str:
        dead = self._dead()
        causes = [(r, p) for r, p in dead if p.exitcode != _EXIT_PEER_GONE] or dead
        return "".join(f"; rank {r} (pid {p.pid}) exited with code {p.exitcode}" for r, p in causes)

    def _fail(self, exc: BaseException | None) -> TensorParallelError:
        """Stop the group after ``exc`` (None: a worker was found dead) and return the error to raise."""
        for _ in range(40):                        # a dead peer makes the others exit within moments
            if self._dead():
                break
            threading.Event().wait(0.05)
        dead = self._dead_summary()
        cause = dead[2:] if dead else f"rank 0 failed: {type(exc).__name__}: {exc}"
        self.broken = (f"the tensor-parallel group of {self.size} ranks stopped ({cause}); build a new engine "
                       "to continue")
        self.shutdown(graceful=False)
        return TensorParallelError(self.broken)

    def shutdown(self, graceful: bool = True, timeout_s: float = 10.0) -> None:
        """Stop the workers (a graceful stop message first when the group is healthy), close the groups,
        and terminate any worker still alive after ``timeout_s``. Idempotent."""
        with self.lock:
            if graceful and self.broken is None and not self._dead() and getattr(self, "control", None) is not None:
                try:
                    self.control.broadcast((self._pending, -1, "stop", ()))
                except Exception:
                    pass
            if self.broken is None:
                self.broken = f"the tensor-parallel group of {self.size} ranks was shut down"
            for name in ("control", "comm"):
                part = getattr(self, name, None)
                if part is not None:
                    # closes our connections (a waiting worker's recv ends); an NCCL abort can block: bounded
                    t = threading.Thread(target=_abort_quietly, args=(part,), daemon=True)
                    t.start()
                    t.join(5.0)
                    setattr(self, name, None)
            self._stop_processes(timeout_s)
            with TensorParallelGroup._live_lock:
                for key, group in list(TensorParallelGroup._live.items()):
                    if group is self:
                        del TensorParallelGroup._live[key]

    def _stop_processes(self, timeout_s: float) -> None:
        for p in self.procs:
            p.join(timeout_s)
        for p in self.procs:
            if p.is_alive():
                p.terminate()
                p.join(2.0)
            if p.is_alive():
                p.kill()
                p.join(2.0)


def _abort_quietly(part) -> None:
    try:
        part.pg.abort()
    except Exception:
        pass


def shutdown_all() -> None:
    """Shut down every live tensor-parallel group of this process (also run at exit)."""
    for group in list(TensorParallelGroup._live.values()):
        group.shutdown()


atexit.register(shutdown_all)


# --- rank 0's executor ---------------------------------------------------------------------------
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
            return _build_rank(0, self.group.comm, build, None if state is None else shard_state_dict(state, hf, 0, size))

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

    def decode_step(self, seqs: list[Sequence]) -> tuple[list[int], torch.Tensor]:
        rows = [(s.request_id, len(s.output), s.output[-1]) for s in seqs]
        return self.group.run(self.engine_id, "decode", (rows, self._wires(seqs)),
                              lambda: self.local.decode_step(seqs))

    def decode(self, seqs: list[Sequence]) -> torch.Tensor:
        return self.decode_step(seqs)[1]

    def sample(self, seqs: list[Sequence], logits: torch.Tensor) -> list[int]:
        return self.local.sample(seqs, logits)

    def run_on_ranks(self, fn: Callable, *args) -> list:
        """``[fn(executor_r, *args) for every rank r]``: ``fn`` (a module-level function: it is pickled by
        name) runs on every rank with that rank's ``ModelExecutor``; results come back in rank order."""
        def local():
            return self.group.control.gather(fn(self.local, *args))

        return self.group.run(self.engine_id, "run", (fn, args), local)

    def request_metrics(self, slot: int) -> dict[str, float]:
        """The request's figures over every rank's heads: each rank's ``request_metrics_part``, combined
        by the method (``combine_request_metrics``)."""
        return self.local.method.combine_request_metrics(self.run_on_ranks(_request_metrics_part, slot))

    def close(self) -> None:
        """Release this engine's shards on the workers (queued for the group's next message)."""
        self._finalizer()


def _request_metrics_part(executor: ModelExecutor, slot: int):
    """A rank's share of the figures of the request in ``slot`` (``AttentionMethod.request_metrics_part``)."""
    return executor.method.request_metrics_part(slot)


def _build_rank(rank: int, comm, build: tuple, shard) -> ModelExecutor:
    """Rank ``rank``'s shard of the model (``shard``: its tensors, None = random) bound to its method."""
    hf, spec, config, devices, dtype, seed, _ = build
    model = build_shard(hf, shard, comm, device=devices[rank], dtype=dtype, seed=seed)
    rc = replace(config, device=devices[rank])
    return ModelExecutor(model, spec.factory(ModelDims.of(model), rc), rc)


# --- a worker ------------------------------------------------------------------------------------
def _die_with_parent(parent_pid: int) -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)     # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent_pid:
        os._exit(_EXIT_PEER_GONE)


def _exit(rank: int, what: str, exc: BaseException | None, code: int) -> None:
    detail = "" if exc is None else f": {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    print(f"macattn tensor-parallel rank {rank}: {what}{detail}; exiting", file=sys.stderr, flush=True)
    os._exit(code)


def _comm_error(exc: BaseException) -> bool:
    text = str(exc)
    return isinstance(exc, getattr(dist, "DistError", ())) or any(
        k in text for k in ("Connection closed", "Connection reset", "Timed out", "timed out", "NCCL", "gloo"))


class _WorkerEngine:
    """A worker's share of one engine: its ``ModelExecutor`` and copies of the running requests."""

    def __init__(self, executor: ModelExecutor) -> None:
        self.ex = executor
        self.seqs: dict[int, Sequence] = {}        # request id -> copy
        self.by_slot: dict[int, int] = {}

    def keep(self, wires: dict) -> None:
        for rid, w in wires.items():
            self.seqs[rid] = w
            self.by_slot[w.slot] = rid

    def reset(self, slot: int) -> None:
        for state in self.ex.slot_states().values():
            state.reset(slot)
        rid = self.by_slot.pop(slot, None)
        if rid is not None:
            self.seqs.pop(rid, None)

    def decode(self, rows, wires) -> None:
        self.keep(wires)
        seqs = []
        for rid, n_out, token in rows:
            s = self.seqs[rid]
            if len(s.output) == n_out - 1:
                s.output.append(token)
            if len(s.output) != n_out or s.output[-1] != token:
                raise RuntimeError(f"request {rid}: worker copy out of step with rank 0 ({len(s.output)} vs {n_out} "
                                   "tokens)")
            seqs.append(s)
        self.ex.decode_step(seqs)


def _worker_main(rank: int, size: int, port: int, device: str, backend: str, timeout_s: float, parent_pid: int,
                 threads: int) -> None:
    _die_with_parent(parent_pid)
    torch.set_num_threads(threads)
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    try:
        store = dist.TCPStore("127.0.0.1", port, size, False, timeout=datetime.timedelta(seconds=timeout_s))
        ctl, model = _process_groups(store, rank, size, backend, timeout_s)
    except Exception as exc:
        _exit(rank, "could not join the group", exc, _EXIT_PEER_GONE)
    control, comm = _Control(ctl, rank, size), _Collectives(model, rank, size)
    engines: dict[int, _WorkerEngine] = {}
    while True:
        try:
            pending, eid, op, args = control.broadcast()
        except Exception as exc:
            _exit(rank, "lost rank 0 (the scheduler)", exc, _EXIT_PEER_GONE)
        try:
            for e, action, arg in pending:
                if action == "drop":
                    dropped = engines.pop(e, None)
                    if dropped is not None:
                        unbind(dropped.ex.model)
                    del dropped
                    gc.collect()
                elif action == "reset":
                    engines[e].reset(arg)
                elif action == "scratch":
                    engines[e].ex.reserve_scratch(arg)
            if op == "stop":
                os._exit(0)
            if op == "build":
                shard = control.recv(0) if args[-1] else None
                engines[eid] = _WorkerEngine(_build_rank(rank, comm, args, shard))
            elif op == "prefill":
                rows, wires = args
                eng = engines[eid]
                eng.keep(wires)
                eng.ex.prefill_chunks([PrefillChunk(eng.seqs[rid], start, end) for rid, start, end in rows])
            elif op == "decode":
                engines[eid].decode(*args)
            elif op == "run":
                fn, fargs = args
                control.gather(fn(engines[eid].ex, *fargs))
            else:
                raise ValueError(f"unknown op {op!r}")
        except Exception as exc:
            if _comm_error(exc):
                _exit(rank, f"a collective of {op!r} failed (a peer died or timed out)", exc, _EXIT_PEER_GONE)
            import traceback

            traceback.print_exc()
            _exit(rank, f"{op!r} failed", exc, _EXIT_OWN_ERROR)
