"""Where a served load's inter-token tail comes from: ``bench_serving.py`` run in this process with the engine's
``Scheduler.schedule`` and ``LLMEngine.step`` timed, so every engine call is logged (start, seconds, the decode
rows and prompt tokens it scheduled, the outputs it returned) and every stream's tokens are stamped when the
engine hands them out. Prints the server-side gaps between a stream's tokens (p50 / p90 / p99 / p99.9), the
engine calls' times, the slowest calls and the largest gaps with the calls inside them, and writes them as JSON.

    python benchmarks/profile_serving_steps.py --probe-out out.json --model llama8b-random --device cuda \\
        --workload mix_1k_64 --no-floor [--max-num-batched-tokens 1024]
    python benchmarks/profile_serving_steps.py --dry-run                  # CPU: checks the script (no JSON)

Every other flag is ``bench_serving.py``'s (its own JSON goes to its ``--out``). With async scheduling (the CUDA
default) an engine call launches step n + 1 and then reads step n's tokens, so a call's time is the previous
step's device time plus this one's launch, and a token is stamped when the call that read it returns.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _instrument() -> tuple[list, list]:
    """Wrap the engine's schedule and step; returns the (calls, tokens) logs they fill."""
    from macattn.runtime.engine import LLMEngine
    from macattn.runtime.scheduler import Scheduler

    calls, tokens, last = [], [], {}
    schedule, step = Scheduler.schedule, LLMEngine.step

    def timed_schedule(self, *a, **kw):
        s = schedule(self, *a, **kw)
        last["s"] = (len(s.decodes), sum(c.num_tokens for c in s.prefills), len(s.prefills))
        return s

    def timed_step(self, *a, **kw):
        last["s"] = (0, 0, 0)
        t = time.perf_counter()
        out = step(self, *a, **kw)
        done = time.perf_counter()
        calls.append((t, done - t, *last["s"], len(out)))
        tokens.extend((done, o.request_id) for o in out if o.token is not None)
        return out

    Scheduler.schedule, LLMEngine.step = timed_schedule, timed_step
    return calls, tokens


def summarize(calls: list, tokens: list, top: int = 30) -> dict:
    """The gaps between each stream's consecutive tokens and the engine calls' times (ms), with the slowest
    calls and the largest gaps (each with the calls that started in it or up to 0.3 s before)."""
    by_request: dict[int, list[float]] = {}
    for t, rid in tokens:
        by_request.setdefault(rid, []).append(t)
    gaps = sorted(((b - a, a, b, rid) for rid, ts in by_request.items() for a, b in zip(ts, ts[1:])), reverse=True)
    g = np.array([x[0] for x in gaps]) * 1e3
    d = np.array([c[1] for c in calls]) * 1e3
    quant = lambda x, qs: {str(q): float(np.percentile(x, q)) for q in qs} if len(x) else {}   # noqa: E731
    t0 = calls[0][0] if calls else 0.0
    return {
        "token_gap_ms": quant(g, (50, 90, 99, 99.9)), "gaps": len(g),
        "call_ms": quant(d, (50, 90, 99, 100)), "calls": len(calls),
        "slowest_calls": [{"t_s": c[0] - t0, "ms": c[1] * 1e3, "decodes": c[2], "prefill_tokens": c[3],
                           "chunks": c[4], "outputs": c[5]} for c in sorted(calls, key=lambda c: -c[1])[:top]],
        "largest_gaps": [{"ms": gap * 1e3, "request": rid, "t_s": a - t0,
                          "calls": [{"start_ms": (c[0] - a) * 1e3, "ms": c[1] * 1e3, "decodes": c[2],
                                     "prefill_tokens": c[3]} for c in calls if a - 0.3 < c[0] < b]}
                         for gap, a, b, rid in gaps[:top]],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 add_help=False)
    ap.add_argument("--probe-out", default=None, help="this probe's JSON (default: printed only)")
    ap.add_argument("-h", "--help", action="store_true")
    args, rest = ap.parse_known_args(argv)
    if args.help:
        ap.print_help()
        return 0
    calls, tokens = _instrument()
    import bench_serving

    rc = bench_serving.main(rest)
    summary = summarize(calls, tokens)
    print(json.dumps({k: summary[k] for k in ("token_gap_ms", "gaps", "call_ms", "calls")}, indent=1))
    for name in ("slowest_calls", "largest_gaps"):
        print(f"{name}:", json.dumps(summary[name][:6]))
    if args.probe_out:
        out = Path(args.probe_out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"benchmark": "profile_serving_steps", "argv": rest, "summary": summary,
                                   "calls": calls}, indent=1))
        print(f"wrote {out}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
