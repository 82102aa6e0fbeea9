"""The weight-only FP8 GEMV (``macattn.plugins.fp8_linear``) against bf16 ``F.linear`` (cuBLAS) on
LLaMA-3.1-8B's projection shapes at decode batch M in {1, 2, 4}: µs per call, bytes moved, GB/s and
the fraction of the H100 SXM's HBM bandwidth (3.35e12 B/s).

Timing: one CUDA graph per (op, shape, M) that calls the op once on each of several copies of the
weight, together at least 4x the L2 cache, so every call streams its weight from HBM (a lone 16 MB
FP8 weight would stay in the 50 MB L2); ``cuda_timing.replay_us`` (eager calls first: the FP8
autotuner runs outside the capture; then ``graph_replay_us``, CUDA events) gives µs per replay,
whose median over ``--reps`` divided by the copies is µs per call, including the graph's gap
between kernels that a decode step pays too. Bytes per call: the weight (+ its fp32 scales) + x +
out. The JSON also keeps, per shape, the autotuner's choice and its cold-L2 timing of every config.

    python benchmarks/bench_fp8_linear.py [--rows 1 2 4] [--reps 50] [--out PATH]
    python benchmarks/bench_fp8_linear.py --dry-run   # CPU: tiny shapes through the dense path, no timing

Writes ``benchmarks/results/bench_fp8_linear_<gpu>.json`` (``--out``).
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cuda_timing import replay_us  # noqa: E402

from macattn.plugins.fp8_linear import fp8_linear, fp8_linear_reference, quantize_fp8_weight  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}   # (N, K) of LLaMA-3.1-8B, q/k/v and gate/up fused
HBM_BYTES_PER_S = 3.35e12              # H100 SXM
COLUMNS = ("proj", "N", "K", "M", "bf16_us", "fp8_us", "speedup", "bf16_gbps", "fp8_gbps", "bf16_hbm_pct",
           "fp8_hbm_pct")


def bytes_moved(M: int, N: int, K: int, fp8: bool) -> int:
    """Weight (+ fp32 scales) + bf16 x [M, K] + bf16 out [M, N]."""
    return N * K * (1 if fp8 else 2) + (4 * N if fp8 else 0) + 2 * M * (K + N)


def per_call_us(fn, weights, reps: int) -> float:
    """Median µs of one ``fn(weight)`` call, each of ``weights`` once per graph replay."""
    return statistics.median(replay_us([functools.partial(fn, w) for w in weights], reps)) / len(weights)


def dry_run(rows: list[int]) -> int:
    """Tiny shapes (N, K / 256) through ``fp8_linear``'s dense path on the CPU: checks the script."""
    for proj, (N, K) in SHAPES.items():
        wq, scale = quantize_fp8_weight(torch.randn(N // 256, K // 256) * 0.02)
        for M in rows:
            x = torch.randn(M, K // 256, dtype=torch.bfloat16)
            err = (fp8_linear(x, wq, scale).float() - fp8_linear_reference(x, wq, scale).float()).abs().max()
            print(f"{proj:>8} N={N // 256:<4} K={K // 256:<3} M={M}: max |fp8_linear - reference| {float(err):.3g}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4], help="decode batch sizes M (1-16)")
    ap.add_argument("--reps", type=int, default=50, help="timed graph replays per figure")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/bench_fp8_linear_<gpu>.json)")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, no timing or JSON")
    args = ap.parse_args(argv)
    if min(args.rows) < 1 or args.reps < 1:
        ap.error("--rows and --reps must be ints >= 1")
    if args.dry_run:
        return dry_run(args.rows)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (or --dry-run)")
    import triton

    from macattn.plugins.fp8_linear.kernel import fp8_gemv

    name = torch.cuda.get_device_name()
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    rows = []
    print(" ".join(f"{c:>12}" for c in COLUMNS), flush=True)
    for proj, (N, K) in SHAPES.items():
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02
        wq, scale = quantize_fp8_weight(w)
        bf16 = [w] + [w.clone() for _ in range(math.ceil(4 * l2 / w.nbytes) - 1)]
        fp8 = [(wq, scale)] + [(wq.clone(), scale) for _ in range(math.ceil(4 * l2 / wq.nbytes) - 1)]
        for M in args.rows:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            fp8_gemv.configs_timings = {}
            fp8_linear(x, wq, scale)                                     # autotunes this key
            tuned = {str(c): round(t[0] * 1e3, 2) for c, t in fp8_gemv.configs_timings.items()}
            best = str(fp8_gemv.best_config)
            t16 = per_call_us(lambda weight: F.linear(x, weight), bf16, args.reps)
            t8 = per_call_us(lambda pair: fp8_linear(x, *pair), fp8, args.reps)
            b16, b8 = bytes_moved(M, N, K, fp8=False), bytes_moved(M, N, K, fp8=True)
            r = dict(proj=proj, N=N, K=K, M=M, bf16_us=t16, fp8_us=t8, speedup=t16 / t8,
                     bf16_bytes=b16, fp8_bytes=b8, bf16_gbps=b16 / t16 / 1e3, fp8_gbps=b8 / t8 / 1e3,
                     bf16_hbm_pct=100 * b16 / (t16 * 1e-6) / HBM_BYTES_PER_S,
                     fp8_hbm_pct=100 * b8 / (t8 * 1e-6) / HBM_BYTES_PER_S,
                     bf16_copies=len(bf16), fp8_copies=len(fp8), fp8_config=best, fp8_autotune_us=tuned)
            rows.append(r)
            print(" ".join(f"{r[c]:>12.1f}" if isinstance(r[c], float) else f"{r[c]:>12}" for c in COLUMNS),
                  flush=True)
        del w, wq, scale, bf16, fp8
        torch.cuda.empty_cache()
    report = dict(benchmark="bench_fp8_linear", device=name, torch=torch.__version__, triton=triton.__version__,
                  cuda=torch.version.cuda, l2_bytes=l2, hbm_bytes_per_s=HBM_BYTES_PER_S, reps=args.reps,
                  timing="CUDA-graph replay median / weight copies (weights >= 4x L2)", rows=rows)
    gpu = name.split()[1].lower() if len(name.split()) > 1 else "gpu"
    out = Path(args.out or Path(__file__).resolve().parent / "results" / f"bench_fp8_linear_{gpu}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
