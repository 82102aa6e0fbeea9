"""How long one engine step takes while prompts arrive, with whole-prompt prefill and with chunked
prefill (``RuntimeConfig.max_num_batched_tokens``, the step's token budget): the longest steps are the stalls every running stream sees.

    python benchmarks/bench_engine_steps.py                       # CPU, the built-in checkpoint
    python benchmarks/bench_engine_steps.py --budgets 0 64 256    # 0 = whole prompts

``--requests`` prompts of ``--input-len`` random token ids, all queued at once, ``--max-batch-size`` in
flight, ``--output-len`` tokens each (greedy, MAC on), serial steps (each step's time is its own; on CUDA the
graphs are captured first, as a server does). Per setting: steps, step-time p50 / p90 / p99 / max, total wall
time, and with ``--timeline`` every step's time, decode rows and prompt chunks. ``--model llama8b-random``: 8B
shapes, random bf16 weights (CUDA). Table + JSON (``benchmarks/results/bench_engine_steps_<device>.json``).
"""
from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
from pathlib import Path

import torch


def run(model, budget: int | None, args) -> dict:
    from macattn.methods.mac.config import MacConfig
    from macattn.models.attention import unbind
    from macattn.runtime.config import RuntimeConfig
    from macattn.runtime.engine import LLMEngine

    cuda = args.device.startswith("cuda")
    eng = LLMEngine(model, MacConfig(), RuntimeConfig(max_batch_size=args.max_batch_size, device=args.device,
                                                      max_seq_len=args.input_len + args.output_len + 8,
                                                      max_num_batched_tokens=budget, use_cuda_graphs=cuda,
                                                      async_scheduling=False))   # a step's time is its own
    if cuda:
        eng.executor.prewarm_graphs()             # what a server does before its first request
    rng = random.Random(args.seed)
    timeline = []
    try:
        for _ in range(args.requests):
            eng.add_request([rng.randrange(300, args.vocab) for _ in range(args.input_len)],
                            max_new_tokens=args.output_len)
        steps, start = [], time.perf_counter()
        while eng.has_unfinished():
            t = time.perf_counter()
            scheduled = eng.scheduler.schedule()
            eng.execute(scheduled)
            steps.append(time.perf_counter() - t)
            timeline.append({"ms": round(steps[-1] * 1e3, 2), "decodes": len(scheduled.decodes),
                             "chunks": [[c.seq.request_id, c.start, c.end] for c in scheduled.prefills]})
        wall = time.perf_counter() - start
    finally:
        unbind(eng.executor.model)
    s = sorted(steps)
    pick = lambda q: s[min(len(s) - 1, int(q * (len(s) - 1)))]  # noqa: E731
    out = {"max_num_batched_tokens": budget, "steps": len(s), "step_s_p50": pick(.5), "step_s_p90": pick(.9),
           "step_s_p99": pick(.99), "step_s_max": s[-1], "wall_s": wall}
    if args.timeline:
        out["timeline"] = timeline          # every step: its time, decode rows, prompt chunks [request, start, end]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budgets", type=int, nargs="+", default=[0, 32, 128],
                    help="max_num_batched_tokens values (> --max-batch-size); 0 = whole prompts")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-batch-size", type=int, default=8)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=8000)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default="builtin", help="'builtin' or 'llama8b-random' (8B shapes, bf16, CUDA)")
    ap.add_argument("--timeline", action="store_true", help="keep every step's time, decode rows and prompt chunks")
    ap.add_argument("--out", default=None)
    ap.add_argument("--dry-run", action="store_true", help="two short requests: checks the script (no JSON)")
    args = ap.parse_args(argv)
    if args.dry_run:
        args.requests, args.max_batch_size, args.input_len, args.output_len, args.budgets = 2, 2, 12, 2, [0, 4]
    from bench_prefill_floor import load_model

    model, _ = load_model(args.model, torch.device(args.device),
                          torch.float32 if args.model == "builtin" else torch.bfloat16)
    rows = [run(model, b or None, args) for b in args.budgets]
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else f"{platform.machine()} CPU"
    print(f"{'budget':>13} {'steps':>6} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8} {'max ms':>8} {'wall s':>7}")
    for r in rows:
        print(f"{str(r['max_num_batched_tokens'] or 'whole'):>13} {r['steps']:>6} " + " ".join(
            f"{r[k] * 1e3:>8.1f}" for k in ("step_s_p50", "step_s_p90", "step_s_p99", "step_s_max"))
            + f" {r['wall_s']:>7.1f}")
    if args.dry_run:
        return 0
    tag = "cpu" if not args.device.startswith("cuda") else device.split()[1].lower()
    out = Path(args.out or Path(__file__).parent / "results" / f"bench_engine_steps_{tag}.json")
    out.write_text(json.dumps({"benchmark": "bench_engine_steps", "device": device, "torch": torch.__version__,
                               "model": args.model, "args": vars(args), "rows": rows}, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
