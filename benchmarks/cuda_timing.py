"""Timing of decode steps as CUDA-graph replays (an eager launch costs ~20 µs of GPU idle per
kernel on the H100, a replay ~1.2 µs), shared by the benchmark scripts."""
from __future__ import annotations

import statistics

import torch

__all__ = ["time_graph"]


def time_graph(fn, reps: int, warmup: int = 3) -> float:
    """Capture ``fn`` in a CUDA graph; median µs per replay."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(warmup):
        g.replay()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        starts[i].record()
        g.replay()
        ends[i].record()
    torch.cuda.synchronize()
    del g
    return statistics.median(a.elapsed_time(b) * 1e3 for a, b in zip(starts, ends))
