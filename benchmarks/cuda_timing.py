"""Timing of decode steps as CUDA-graph replays (an eager launch costs ~20 µs of GPU idle per
kernel on the H100, a replay ~1.2 µs), shared by the benchmark scripts."""
from __future__ import annotations

import statistics

import torch

__all__ = ["replay_us", "graph_replay_us", "time_graph", "copy_bandwidth"]


def replay_us(fns, reps: int, warmup: int = 3, eager: int = 1) -> list[float]:
    """Capture every callable of ``fns`` into one CUDA graph and time ``reps`` replays (CUDA events).

    Each callable first runs ``eager`` times on a side stream (compile / JIT / autotune outside the
    capture), the graph replays ``warmup`` times untimed. Returns µs per replay.
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(eager):
            for fn in fns:
                fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    us = graph_replay_us(graph, reps, warmup)
    del graph
    return us


def graph_replay_us(graph: torch.cuda.CUDAGraph, reps: int, warmup: int = 3) -> list[float]:
    """µs per replay of an already captured ``graph`` (``warmup`` untimed replays first; CUDA events)."""
    for _ in range(warmup):
        graph.replay()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        starts[i].record()
        graph.replay()
        ends[i].record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)]


def time_graph(fn, reps: int, warmup: int = 3) -> float:
    """Median µs per replay of ``fn`` captured alone (``warmup`` eager calls and untimed replays)."""
    return statistics.median(replay_us([fn], reps, warmup, eager=warmup))


def copy_bandwidth(device, nbytes: int = 1 << 30, reps: int = 20) -> float | None:
    """Bytes per second a device-to-device copy moves (read + write of ``nbytes``), graph replays."""
    if device.type != "cuda":
        return None
    src, dst = torch.empty(nbytes, dtype=torch.uint8, device=device), torch.empty(nbytes, dtype=torch.uint8, device=device)
    us = statistics.median(replay_us([lambda: dst.copy_(src)], reps))
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / (us * 1e-6)
