"""A worker rank (``1 .. N-1``): the process ``TensorParallelGroup`` spawns (``worker_main``), its loop
over rank 0's broadcast steps, its copies of the running requests (``_WorkerEngine``), and how any rank
builds its shard's executor (``build_rank``, rank 0's too). A failed op or collective prints
``macattn tensor-parallel rank r: ...`` and exits (package doc)."""
from __future__ import annotations

import ctypes
import gc
import os
import signal
import sys
from dataclasses import replace

import torch
import torch.distributed as dist

from macattn.methods.base import ModelDims
from macattn.models.attention import unbind
from macattn.models.tensor_parallel import build_shard
from macattn.runtime.executor import ModelExecutor
from macattn.runtime.sequence import PrefillChunk, Sequence
from macattn.runtime.tensor_parallel.comm import (EXIT_OWN_ERROR, EXIT_PEER_GONE, ControlChannel,
                                                  ProcessGroupCollectives, open_store, process_groups)

__all__ = ["build_rank", "worker_main"]


def build_rank(rank: int, comm, build: tuple, shard) -> ModelExecutor:
    """Rank ``rank``'s shard of the model (``shard``: its tensors, None = random) bound to its method."""
    hf, spec, config, devices, dtype, seed, _ = build
    model = build_shard(hf, shard, comm, device=devices[rank], dtype=dtype, seed=seed)
    rc = replace(config, device=devices[rank])
    return ModelExecutor(model, spec.factory(ModelDims.of(model), rc), rc)


def _die_with_parent(parent_pid: int) -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)     # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent_pid:
        os._exit(EXIT_PEER_GONE)


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
        self.ex.decode_step(self._decoding(rows))

    def mixed(self, rows, chunks, wires) -> None:
        self.keep(wires)
        self.ex.mixed_step(self._decoding(rows),
                           [PrefillChunk(self.seqs[rid], start, end) for rid, start, end in chunks])

    def _decoding(self, rows) -> list[Sequence]:
        """The copies of the requests of a decode batch ``rows`` (``(request id, tokens generated, the last)``), their
        last token appended (rank 0 sampled it)."""
        seqs = []
        for rid, n_out, token in rows:
            s = self.seqs[rid]
            if len(s.output) == n_out - 1:
                s.output.append(token)
            if len(s.output) != n_out or s.output[-1] != token:
                raise RuntimeError(f"request {rid}: worker copy out of step with rank 0 ({len(s.output)} vs {n_out} "
                                   "tokens)")
            seqs.append(s)
        return seqs


def worker_main(rank: int, size: int, store_path: str, device: str, backend: str, timeout_s: float, parent_pid: int,
                 threads: int, rank_functions: frozenset = frozenset()) -> None:
    _die_with_parent(parent_pid)
    torch.set_num_threads(threads)
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    try:
        store = open_store(store_path, size, timeout_s)
        ctl, model = process_groups(store, rank, size, backend, timeout_s)
    except Exception as exc:
        _exit(rank, "could not join the group", exc, EXIT_PEER_GONE)
    control, comm = ControlChannel(ctl, rank, size, rank_functions), ProcessGroupCollectives(model, rank, size)
    engines: dict[int, _WorkerEngine] = {}
    while True:
        try:
            pending, eid, op, args = control.broadcast()
        except Exception as exc:
            _exit(rank, "lost rank 0 (the scheduler)", exc, EXIT_PEER_GONE)
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
                engines[eid] = _WorkerEngine(build_rank(rank, comm, args, shard))
            elif op == "prefill":
                rows, wires = args
                eng = engines[eid]
                eng.keep(wires)
                eng.ex.prefill_chunks([PrefillChunk(eng.seqs[rid], start, end) for rid, start, end in rows])
            elif op == "decode":
                engines[eid].decode(*args)
            elif op == "mixed":
                engines[eid].mixed(*args)
            elif op == "run":
                fn, fargs = args
                control.gather(fn(engines[eid].ex, *fargs))
            else:
                raise ValueError(f"unknown op {op!r}")
        except Exception as exc:
            if _comm_error(exc):
                _exit(rank, f"a collective of {op!r} failed (a peer died or timed out)", exc, EXIT_PEER_GONE)
            import traceback

            traceback.print_exc()
            _exit(rank, f"{op!r} failed", exc, EXIT_OWN_ERROR)
