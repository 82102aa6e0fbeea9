"""Where the engine's serving loop makes the host wait for the GPU outside the read of a step's sampled tokens.

A closed loop on the engine alone (no HTTP): ``--in-flight`` requests at a time, ``--num-prompts`` in all, each
``--input-len`` random token ids -> ``--output-len`` tokens (the 1K mix's shape by default), the engine built
as the server builds it (``EngineArgs``: async scheduling, CUDA graphs captured at start-up, MAC engaging from its
CUDA default), run once untimed, once timed, and once under ``torch.cuda.set_sync_debug_mode("warn")``. Every
operation that synchronised is counted by its call site (the stack's frames in the package). With async
scheduling a step's one wait should be the read of its tokens (``InFlightStep.tokens_on_host``, an event wait that
the debug mode does not report), so every site listed here stalls the pipeline: the GPU idles while the host
catches up (``benchmarks/notes/serving.md``, eighth pass).

    python benchmarks/find_host_syncs.py --device cuda [--max-num-batched-tokens 1024] [--out host_syncs.json]
    python benchmarks/find_host_syncs.py --dry-run        # CPU, tiny shapes: checks the script (no CUDA: no site)

Prints the loop's output tok/s and engine-call times, then the sites (count, stack); JSON (device, versions,
every figure) to ``--out``.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time
import traceback
import warnings
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

ROOT = Path(__file__).resolve().parents[1]


def closed_loop(engine, n: int, in_flight: int, input_len: int, output_len: int, vocab: int, gen) -> dict:
    """Keep ``in_flight`` requests running until ``n`` finished; the wall time and each engine call's ms."""
    submitted = done = 0
    running, calls = set(), []
    t0 = time.perf_counter()
    while done < n:
        while submitted < n and len(running) < in_flight:
            ids = torch.randint(min(300, vocab - 1), vocab, (input_len,), generator=gen)
            running.add(engine.add_request(ids, max_new_tokens=output_len))
            submitted += 1
        t = time.perf_counter()
        out = engine.step()
        calls.append((time.perf_counter() - t) * 1e3)
        for o in out:
            if o.finished:
                running.discard(o.request_id)
                engine.pop_finished(o.request_id)
                done += 1
    return {"wall_s": time.perf_counter() - t0, "call_ms": calls}


def sync_sites(run, frames: int = 6) -> collections.Counter:
    """Run ``run()`` under the CUDA sync debug mode's warnings; ``Counter`` of the synchronising call sites (the last
    ``frames`` frames of the package and this script, innermost last)."""
    sites: collections.Counter = collections.Counter()
    show = warnings.showwarning

    def record(message, category, filename, lineno, file=None, line=None):
        stack = [f"{os.path.relpath(f.filename, ROOT)}:{f.lineno} {f.name}" for f in traceback.extract_stack()[:-1]
                 if "macattn" in f.filename or f.filename == __file__]
        sites["\n".join(stack[-frames:])] += 1

    cuda = torch.cuda.is_available()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            run()
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode(0)
            warnings.showwarning = show
    return sites


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--in-flight", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None, help="the token budget (default: the engine's)")
    ap.add_argument("--out", default=None, help="JSON path (default: printed only)")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, few requests: checks the script")
    args = ap.parse_args(argv)
    from bench_e2e import LLAMA_8B, TINY, build_model
    from bench_prefill_floor import environment

    from macattn.runtime.engine_args import EngineArgs

    if args.dry_run:
        args.device, args.num_prompts, args.in_flight, args.input_len, args.output_len = "cpu", 6, 3, 24, 4
    shapes = TINY if args.dry_run else LLAMA_8B
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    model = build_model(shapes, dtype, args.device)
    engine = EngineArgs(model="builtin", dtype="float32" if args.dry_run else "bfloat16", device=args.device,
                        max_batch_size=args.in_flight, max_seq_len=args.input_len + args.output_len + 16,
                        max_num_batched_tokens=args.max_num_batched_tokens,
                        enable_prefix_caching=False).build_engine(model)
    gen = torch.Generator().manual_seed(0)
    loop = lambda n: closed_loop(engine, n, args.in_flight, args.input_len, args.output_len,   # noqa: E731
                                 shapes["vocab_size"], gen)
    loop(args.in_flight)                                                    # warm-up
    timed = loop(args.num_prompts)
    sites = sync_sites(lambda: loop(args.in_flight * 2))
    calls = np.array(timed["call_ms"])
    tok_s = args.num_prompts * args.output_len / timed["wall_s"]
    quant = {str(q): float(np.percentile(calls, q)) for q in (50, 90, 99, 100)}
    print(f"{args.num_prompts} x ({args.input_len} -> {args.output_len}), {args.in_flight} in flight, budget "
          f"{engine.config.max_num_batched_tokens}: {tok_s:.1f} output tok/s; engine calls (ms) "
          + ", ".join(f"p{q} {v:.1f}" for q, v in quant.items()))
    print(f"synchronising call sites: {len(sites)}" + ("" if torch.cuda.is_available() else " (no CUDA: none)"))
    for stack, n in sites.most_common():
        print(f"{n:6d} x\n    " + stack.replace("\n", "\n    "))
    if args.out:
        record = {"env": environment(torch.device(args.device)), "args": vars(args),
                  "budget": engine.config.max_num_batched_tokens, "output_tok_per_s": tok_s, "call_ms": quant,
                  "sites": [{"count": n, "stack": stack.split("\n")} for stack, n in sites.most_common()]}
        Path(args.out).write_text(json.dumps(record, indent=1))
        print(f"wrote {args.out}")
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
