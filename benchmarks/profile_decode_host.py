"""Host cost of the engine's decode steps in the mix's steady state: ``B`` requests of ``--input-len`` random
tokens decoding together (8B shapes, random bf16 weights, MAC at its defaults, CUDA graphs), the wall time of a
step with async scheduling and with serial steps, then ``cProfile`` over ``--profiled`` async steps: a step whose
time is mostly the wait in its one event synchronisation is GPU-bound (the host has nothing left to hide).

    python benchmarks/profile_decode_host.py                     # CUDA: 16 x 1K
    python benchmarks/profile_decode_host.py --batch 4 --input-len 32768 --out /tmp/x.txt

Prints the per-step times and the profile (by own time, then cumulative); ``--out`` writes the same text.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=60, help="timed steps per mode")
    ap.add_argument("--profiled", type=int, default=100, help="async steps under cProfile")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU (the decode step's graphs and its host sync)")
        return 1
    from bench_prefill_floor import load_model

    from macattn.methods.mac.config import MacConfig
    from macattn.runtime.config import RuntimeConfig
    from macattn.runtime.engine import LLMEngine

    model, _ = load_model("llama8b-random", torch.device("cuda"), torch.bfloat16)
    new = 20 + 3 * args.steps + args.profiled + 10
    eng = LLMEngine(model, MacConfig(), RuntimeConfig(max_batch_size=args.batch, device="cuda",
                                                      max_seq_len=args.input_len + new, use_cuda_graphs=True))
    eng.executor.prewarm_graphs()
    rng = random.Random(0)
    for _ in range(args.batch):
        eng.add_request([rng.randrange(300, 8000) for _ in range(args.input_len)], max_new_tokens=new)
    for _ in range(20):                       # the prefill and the first decode steps
        eng.step()
    torch.cuda.synchronize()
    lines = [f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.batch} x {args.input_len}"]
    for mode, sync in (("async", False), ("serial", True), ("async", False)):
        t = time.perf_counter()
        for _ in range(args.steps):
            eng.step(sync=sync)
        torch.cuda.synchronize()
        lines.append(f"{mode}: {(time.perf_counter() - t) / args.steps * 1e3:.2f} ms / step")
    prof = cProfile.Profile()
    t = time.perf_counter()
    prof.enable()
    for _ in range(args.profiled):
        eng.step()
    torch.cuda.synchronize()
    prof.disable()
    lines.append(f"profiled async: {(time.perf_counter() - t) / args.profiled * 1e3:.2f} ms / step")
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(35)
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(45)
    report = "\n".join(lines) + "\n" + text.getvalue()
    print(report)
    if args.out:
        Path(args.out).write_text(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
