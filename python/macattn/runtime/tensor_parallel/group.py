"""Rank 0's side of a tensor-parallel group: ``TensorParallelGroup`` spawns the workers, opens the
control and model process groups with them, broadcasts each engine operation, watches the workers and
stops the group when one dies (``TensorParallelError``; on NCCL, a process wedged on a dead peer exits
with ``EXIT_WEDGED``) (package doc)."""
from __future__ import annotations

import atexit
import itertools
import os
import shutil
import sys
import tempfile
import threading
import time
from typing import Any, Callable

import torch.multiprocessing as mp

from macattn.runtime.tensor_parallel.comm import (EXIT_PEER_GONE, ControlChannel, ProcessGroupCollectives,
                                                  abort_quietly, open_store, process_groups, rank_functions)
from macattn.runtime.tensor_parallel.worker import worker_main

__all__ = ["TensorParallelError", "TensorParallelGroup", "shutdown_all", "EXIT_WEDGED"]

EXIT_WEDGED = 70                               # rank 0: a dead peer left this process's NCCL stream stuck
_WEDGE_GRACE_S = 10.0                          # how long an op in flight may outlive the abort


class TensorParallelError(RuntimeError):
    """A rank of a tensor-parallel group died or failed; the group is stopped."""


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
        # the rendezvous is a file in a private directory: no port (a TCPStore listens on every interface)
        self._store_dir = tempfile.mkdtemp(prefix="macattn-tp-")
        store_path = os.path.join(self._store_dir, "store")
        store = open_store(store_path, size, timeout_s)
        ctx = mp.get_context("spawn")
        threads = max(1, (os.cpu_count() or 1) // size)
        try:
            for r in range(1, size):
                p = ctx.Process(target=worker_main, name=f"macattn-tp-rank{r}", daemon=True,
                                args=(r, size, store_path, devices[r], self.backend, timeout_s, os.getpid(), threads,
                                      rank_functions()))
                p.start()
                self.procs.append(p)
            ctl, model = process_groups(store, 0, size, self.backend, timeout_s)
        except BaseException as exc:
            self._stop_processes(0.0)
            raise TensorParallelError(f"could not start a tensor-parallel group of {size} ranks: {exc}"
                                      f"{self._dead_summary()}") from exc
        self._store = store
        self.control = ControlChannel(ctl, 0, size)
        self.comm = ProcessGroupCollectives(model, 0, size)
        threading.Thread(target=self._watch, name="macattn-tp-watch", daemon=True).start()

    def _watch(self) -> None:
        """Abort the groups as soon as a worker dies: an op rank 0 has in flight then fails at once instead
        of at the collective timeout (gloo). An NCCL op that still has not returned ``_WEDGE_GRACE_S`` later
        is stuck on the GPU for good: exit (module doc)."""
        while self.broken is None:
            if self._dead():
                for part in (self.comm, self.control):
                    self._abort_in_background(part)     # the NCCL abort can block (module doc): never here
                if self.backend == "nccl":
                    deadline = time.monotonic() + _WEDGE_GRACE_S
                    while self._in_op and time.monotonic() < deadline:
                        threading.Event().wait(0.1)
                    if self._in_op:
                        self._exit_wedged()
                return
            threading.Event().wait(0.2)

    def _abort_in_background(self, part) -> threading.Thread:
        """Abort ``part``'s process group on a daemon thread, kept in ``_aborting`` until it returns: an abort still
        inside NCCL when the interpreter finalizes ends the process with ``std::terminate`` (the thread is
        unwound through the binding's GIL guard), so ``_at_exit`` waits for these."""
        t = threading.Thread(target=abort_quietly, args=(part, bool(self._dead())), name="macattn-tp-abort",
                             daemon=True)
        _aborting[:] = [(a, g) for a, g in _aborting if a.is_alive()] + [(t, self)]
        t.start()
        return t

    def _exit_wedged(self, during: str = "during a collective") -> None:
        msg = (f"macattn tensor-parallel: the group of {self.size} ranks stopped {during}"
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
        causes = [(r, p) for r, p in dead if p.exitcode != EXIT_PEER_GONE] or dead
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
                    self._abort_in_background(part).join(5.0)
                    setattr(self, name, None)
            self._stop_processes(timeout_s)
            with TensorParallelGroup._live_lock:
                for key, group in list(TensorParallelGroup._live.items()):
                    if group is self:
                        del TensorParallelGroup._live[key]

    def _stop_processes(self, timeout_s: float) -> None:
        shutil.rmtree(self._store_dir, ignore_errors=True)
        for p in self.procs:
            p.join(timeout_s)
        for p in self.procs:
            if p.is_alive():
                p.terminate()
                p.join(2.0)
            if p.is_alive():
                p.kill()
                p.join(2.0)



_aborting: list[tuple[threading.Thread, TensorParallelGroup]] = []    # abort threads started, with their group


def shutdown_all() -> None:
    """Shut down every live tensor-parallel group of this process (also run at exit: ``_at_exit``)."""
    for group in list(TensorParallelGroup._live.values()):
        group.shutdown()


def _at_exit() -> None:
    """``shutdown_all``, then wait up to ``_WEDGE_GRACE_S`` for every group abort still running: one still inside
    NCCL when the interpreter finalizes ends it with ``std::terminate`` (SIGABRT), so the process exits
    ``EXIT_WEDGED`` naming the dead rank instead (module doc)."""
    shutdown_all()
    deadline = time.monotonic() + _WEDGE_GRACE_S
    for t, group in list(_aborting):
        t.join(max(0.0, deadline - time.monotonic()))
        if t.is_alive():
            group._exit_wedged("and its NCCL abort has not returned at exit")


atexit.register(_at_exit)
