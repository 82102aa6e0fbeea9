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
queued since the last one — over a gloo **control group** (every socket on the loopback interface, the
rendezvous a file in a private directory; a message is read back through an allow-list of what the group
exchanges, ``comm.WireUnpickler``, and a function sent to ``run_on_ranks`` must be registered with
``comm.rank_function``), then every rank runs the same executor call; the model's collectives run in the **model group** (NCCL on GPUs, gloo on the CPU). Rank 0
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
exits with code ``EXIT_WEDGED`` (70) once the op has not returned for ``_WEDGE_GRACE_S``; likewise at exit when
its abort of the group is still inside NCCL after that grace (finalizing the interpreter around it ends in
SIGABRT). A server in
front of the engine is a process to restart; a library user who must survive a lost GPU worker runs the
engine in a child process.

Methods: those whose ``capabilities.head_sharded`` is set (``full``, ``mac``); any other, FastMKA-patched
models and A3 chunked prompts raise ``NotImplementedError`` naming what is not sharded. Worker processes
are spawned: a script that builds a tensor-parallel engine at import time needs the usual
``if __name__ == "__main__":`` guard.

The package, by role: ``comm`` (the control channel, the model group's collectives, the process groups
and exit codes), ``group`` (rank 0's ``TensorParallelGroup``: spawning, broadcasting, watching, failing
and shutting down), ``executor`` (rank 0's ``TensorParallelExecutor`` and the checks made before any
process starts), ``worker`` (a worker rank's process: ``worker_main`` and its loop).
"""
from __future__ import annotations

from macattn.runtime.tensor_parallel.executor import RandomWeights, TensorParallelExecutor, refuse_chunked_prompts
from macattn.runtime.tensor_parallel.group import EXIT_WEDGED, TensorParallelError, TensorParallelGroup

__all__ = ["TensorParallelError", "TensorParallelGroup", "TensorParallelExecutor", "RandomWeights",
           "refuse_chunked_prompts", "EXIT_WEDGED"]
