"""How long one engine step takes while prompts arrive, with whole-prompt prefill and with chunked
prefill (``RuntimeConfig.max_num_batched_tokens``, the step's token budget): the longest steps are the stalls every running stream sees.

    python benchmarks/bench_engine_steps.py                       # CPU, the built-in checkpoint
    python benchmarks/bench_engine_steps.py --budgets 0 64 256    # 0 = whole prompts

``--requests`` prompts of ``--input-len`` random token ids, all queued at once, ``--max-batch-size`` in
flight, ``--output-len`` tokens each (greedy, MAC on). Per setting: steps, step-time p50 / p90 / p99 /
max, total wall time. Table + JSON (``benchmarks/results/bench_engine_steps_<device>.json``).
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

    eng = LLMEngine(model, MacConfig(), RuntimeConfig(max_batch_size=args.max_batch_size, device=args.device,
                                                      max_seq_len=args.input_len + args.output_len + 8,
                                                      max_num_batched_tokens=budget,
                                                      use_cuda_graphs=args.device.startswith("cuda")))
    rng = random.Random(args.seed)
    try:
        for _ in range(args.requests):
            eng.add_request([rng.randrange(300, args.vocab) for _ in range(args.input_len)],
                            max_new_tokens=args.output_len)
        steps, start = [], time.perf_counter()
        while eng.has_unfinished():
            t = time.perf_counter()
            eng.step()
            steps.append(time.perf_counter() - t)
        wall = time.perf_counter() - start
    finally:
        unbind(eng.executor.model)
    s = sorted(steps)
    pick = lambda q: s[min(len(s) - 1, int(q * (len(s) - 1)))]  # noqa: E731
    return {"max_num_batched_tokens": budget, "steps": len(s), "step_s_p50": pick(.5), "step_s_p90": pick(.9),
            "step_s_p99": pick(.99), "step_s_max": s[-1], "wall_s": wall}


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
    ap.add_argument("--out", default=None)
    ap.add_argument("--dry-run", action="store_true", help="two short requests: checks the script (no JSON)")
    args = ap.parse_args(argv)
    if args.dry_run:
        args.requests, args.max_batch_size, args.input_len, args.output_len, args.budgets = 2, 2, 12, 2, [0, 4]
    from macattn.models.checkpoint import load_builtin_checkpoint

    model, _ = load_builtin_checkpoint()
    model = model.to(args.device)
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
                               "model": "built-in checkpoint", "args": vars(args), "rows": rows}, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
