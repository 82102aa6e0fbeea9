"""The wire of a tensor-parallel group: the gloo **control channel** (pickled objects: rank 0's step
broadcast, shards sent to one rank, results gathered from all; read back through an allow-list of the
classes and functions the group exchanges, ``WireUnpickler``, so a message can name nothing else), the **model group's collectives**
(``macattn.models.tensor_parallel.Collectives`` over gloo or NCCL), how every rank opens both process
groups (every socket on the loopback interface), and the exit codes the ranks agree on (package doc)."""
from __future__ import annotations

import ctypes
import dataclasses
import datetime
import enum
import io
import pickle

import torch
import torch.distributed as dist

__all__ = ["ProcessGroupCollectives", "ControlChannel", "WireUnpickler", "rank_function", "rank_functions",
           "process_groups", "abort_quietly",
           "EXIT_OWN_ERROR", "EXIT_PEER_GONE", "LOOPBACK", "open_store"]

LOOPBACK = "127.0.0.1"                          # the address every gloo socket of a group listens on
_CONTROL_IDLE = datetime.timedelta(days=365)   # a worker waits for the next step as long as rank 0 lives
_INLINE = 8192                                 # control message bytes sent in the first broadcast
EXIT_OWN_ERROR = 1                             # a worker's own op raised
EXIT_PEER_GONE = 3                             # a worker lost a peer (its collective failed)


class ProcessGroupCollectives:
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


# What a control message may name (module, name): the containers and tensor rebuilders pickle writes; beside
# them the functions registered with ``rank_function``, any dataclass or enum of the package and
# transformers' model configs
_WIRE_GLOBALS = frozenset({
    ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "slice"), ("builtins", "complex"),
    ("builtins", "bytearray"), ("collections", "OrderedDict"), ("torch._utils", "_rebuild_tensor_v2"),
    ("torch._utils", "_rebuild_parameter"), ("torch._tensor", "_rebuild_from_type_v2"),
    ("torch.storage", "_load_from_bytes"), ("torch", "Size"), ("torch", "device"),
})
_WIRE_ROOTS = ("builtins", "collections", "torch", "macattn", "transformers")
_RANK_FUNCTIONS: set[tuple[str, str]] = set()


def rank_function(fn):
    """Register ``fn`` (module level) as one ``TensorParallelExecutor.run_on_ranks`` may send; returns it.
    Workers learn the registrations made before their group was spawned, and the package's own as they
    import it."""
    _RANK_FUNCTIONS.add((fn.__module__, fn.__qualname__))
    return fn


def rank_functions() -> frozenset:
    """The registered ``(module, name)`` pairs (what a group hands its workers at spawn)."""
    return frozenset(_RANK_FUNCTIONS)


class WireUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that resolves only what the group exchanges (``_WIRE_GLOBALS``, the functions
    registered with ``rank_function`` here or in ``extra``, torch's storage and dtype objects, the package's
    dataclasses and enums, transformers' ``PretrainedConfig`` classes); any other global — ``os.system``, a
    module outside those roots — raises ``pickle.UnpicklingError`` before it is imported or called."""

    def __init__(self, file, extra: frozenset = frozenset()) -> None:
        super().__init__(file)
        self.extra = extra

    def find_class(self, module: str, name: str):
        registered = (module, name) in _RANK_FUNCTIONS or (module, name) in self.extra
        if registered or module.split(".")[0] in _WIRE_ROOTS:
            obj = super().find_class(module, name)      # importing it may register it (a package rank_function)
            if registered or (module, name) in _WIRE_GLOBALS or (module, name) in _RANK_FUNCTIONS \
                    or _wire_type(module, obj):
                return obj
        raise pickle.UnpicklingError(f"the tensor-parallel control channel carries no {module}.{name}")


def _wire_type(module: str, obj) -> bool:
    if module == "torch":
        return isinstance(obj, torch.dtype) or (isinstance(obj, type) and issubclass(obj, torch.storage._StorageBase))
    if module.startswith("torch.storage"):
        return isinstance(obj, type) and issubclass(obj, (torch.storage._StorageBase, torch.storage.TypedStorage))
    if module.startswith("macattn."):
        return isinstance(obj, type) and (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum))
    if module.startswith("transformers."):
        from transformers import PretrainedConfig

        return isinstance(obj, type) and issubclass(obj, PretrainedConfig)
    return False


class ControlChannel:
    """Pickled objects over the gloo control group (read back by ``WireUnpickler``): rank 0 broadcasts, sends
    shards, gathers results."""

    def __init__(self, pg, rank: int, size: int, rank_functions: frozenset = frozenset()) -> None:
        self.pg, self.rank, self.size = pg, rank, size
        self.rank_functions = rank_functions

    def _decode(self, data: bytes):
        return WireUnpickler(io.BytesIO(data), self.rank_functions).load()

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
        return self._decode(payload)

    def send(self, obj, dst: int) -> None:
        data = self._encode(obj)
        self.pg.send([torch.tensor([data.numel()], dtype=torch.int64)], dst, 0).wait()
        self.pg.send([data], dst, 1).wait()

    def recv(self, src: int = 0):
        n = torch.zeros(1, dtype=torch.int64)
        self.pg.recv([n], src, 0).wait()
        data = torch.empty(int(n), dtype=torch.uint8)
        self.pg.recv([data], src, 1).wait()
        return self._decode(data.numpy().tobytes())

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
        return [self._decode(o[:int(s)].numpy().tobytes()) for o, s in zip(outs, sizes)]


def open_store(path: str, size: int, timeout_s: float):
    """The group's rendezvous: a ``FileStore`` at ``path`` (in a private directory rank 0 made; no socket)."""
    store = dist.FileStore(path, size)
    store.set_timeout(datetime.timedelta(seconds=timeout_s))
    return store


def process_groups(store, rank: int, size: int, backend: str, timeout_s: float):
    """``(control, model)`` backends: gloo for the control group (idle waits last as long as rank 0
    lives), ``backend`` for the model group with ``timeout_s`` per collective."""
    timeout = datetime.timedelta(seconds=timeout_s)
    ctl = _gloo(dist.PrefixStore("ctl", store), rank, size, timeout)
    ctl.set_timeout(_CONTROL_IDLE)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts.is_high_priority_stream = False
        opts._timeout = timeout
        model = dist.ProcessGroupNCCL(dist.PrefixStore("model", store), rank, size, opts)
    else:
        model = _gloo(dist.PrefixStore("model", store), rank, size, timeout)
    return ctl, model


def _gloo(store, rank: int, size: int, timeout: datetime.timedelta):
    """A gloo group whose sockets listen on the loopback interface only (the group's ranks are local processes;
    gloo's default binds the host name's address, reachable from the network)."""
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=LOOPBACK)]
    opts._timeout = timeout
    return dist.ProcessGroupGloo(store, rank, size, opts)


def abort_quietly(part, peer_died: bool = False) -> None:
    """Abort ``part``'s process group (a ``ControlChannel`` or ``ProcessGroupCollectives``), ignoring errors. An
    NCCL group aborted because a peer died is kept alive until the process ends (``_keep_until_exit``)."""
    try:
        if peer_died and isinstance(part.pg, dist.ProcessGroupNCCL):
            _keep_until_exit(part.pg)
        part.pg.abort()
    except Exception:
        pass


def _keep_until_exit(obj) -> None:
    """Never run ``obj``'s destructor, a ProcessGroupNCCL whose communicator was aborted because a peer died; the OS
    reclaims it with the process. Added for the SIGABRT at exit on two H200s, which it did not cure: that came
    from the abort's own thread, still inside NCCL at finalization (``group._at_exit`` now waits for it). Kept
    because the GPU runs that pass had it: whether destroying such a group at exit is safe was not tested alone.
    A reference the interpreter does not own survives its teardown."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))
