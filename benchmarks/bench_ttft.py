"""Time to first token through the engine (no HTTP): ``LLMEngine`` on the device, LLaMA-3.1-8B shapes
(random bf16 weights), prompts of random ids, each request asking for one token.

    python benchmarks/bench_ttft.py --device cuda                        # 1x1K, 16x1K, 1x8K, 1x32K, 4x32K
    python benchmarks/bench_ttft.py --device cuda --budgets 4096 8192 16384 --mixes 1x32768
    python benchmarks/bench_ttft.py --device cuda --mixes 1x32768 --question 100 --mac on --profile 40
                                                       # later turns over a cached 32K document, one profiled
    python benchmarks/bench_ttft.py --dry-run                            # CPU, tiny shapes: checks the script

For each prompt mix (``BxL``: B prompts of L tokens submitted together), token budget
(``RuntimeConfig.max_num_batched_tokens``; 0 = whole prompts) and MAC on / off, the wall time from
submitting the prompts to the last one's first token (``torch.cuda.synchronize`` before reading the
clock), median of ``--reps`` after a warm-up run of the same mix. MAC on minus MAC off is the cost of
seeding the rings (the prefill is otherwise the same). The prefill floor of the same mix, measured in
the same process by ``bench_prefill_floor`` when it is importable, is printed beside each figure.
``--question Q`` measures multi-turn reuse instead (issue 37; prefix caching on): each prompt is one fixed
document of L tokens followed by a fresh question of Q tokens; the warm-up run is the first turn (the document
prefilled whole, its time recorded as ``first_turn_s``) and every timed run a later turn over the cached
document (``later_over_first``).
JSON (device and UUID, versions, every figure) under ``benchmarks/results/``.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_e2e import LLAMA_8B, TINY, build_model  # noqa: E402

from macattn.methods.mac.config import MacConfig  # noqa: E402
from macattn.models.attention import unbind  # noqa: E402
from macattn.runtime.config import RuntimeConfig  # noqa: E402
from macattn.runtime.engine import LLMEngine  # noqa: E402

BUDGET_FIELD = next((f for f in ("max_num_batched_tokens", "prefill_chunk")
                     if f in {x.name for x in dataclasses.fields(RuntimeConfig)}), None)


def parse_mix(text: str) -> tuple[int, int]:
    b, l = text.lower().split("x")
    return int(b), int(l)


def ttft(model, B: int, L: int, budget: int, mac: bool, device: str, reps: int, seed: int = 0,
         profile: int = 0, question: int = 0, trace: str | None = None) -> list[float]:
    """Seconds from submitting ``B`` prompts of ``L`` tokens to the last first token, ``reps`` times
    (after one warm-up). ``profile > 0``: one more run under ``torch.profiler``, printing its ``profile``
    costliest ops by device time and by host time (the profiled run is not among the times); ``trace``: its
    Chrome trace (``chrome://tracing`` / Perfetto) is written there too.
    ``question > 0``: multi-turn (module doc): the prompts are one document of ``L`` tokens plus a fresh
    ``question``-token tail each, prefix caching on; the warm-up's time comes back first (the first turn)."""
    rc = RuntimeConfig(max_batch_size=B, max_seq_len=L + question + 8, device=device,
                       use_cuda_graphs=device.startswith("cuda"), **{BUDGET_FIELD: budget or None},
                       **({"enable_prefix_caching": True} if question else {}))
    if BUDGET_FIELD == "max_num_batched_tokens" and not budget and device.startswith("cuda"):
        rc = dataclasses.replace(rc, max_num_batched_tokens=10**9)      # "whole prompts" on CUDA too
    eng = LLMEngine(model, MacConfig() if mac else MacConfig(enabled=False), rc)
    g = torch.Generator().manual_seed(seed)
    doc = torch.randint(300, eng.vocab_size, (L,), generator=g) if question else None

    def prompt() -> torch.Tensor:
        if not question:
            return torch.randint(300, eng.vocab_size, (L,), generator=g)
        return torch.cat([doc, torch.randint(300, eng.vocab_size, (question,), generator=g)])

    times = []
    try:
        for rep in range(reps + 1 + bool(profile)):
            ids = [eng.add_request(prompt(), max_new_tokens=1) for _ in range(B)]
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            prof = profiler(device) if rep > reps else contextlib.nullcontext()
            t0 = time.perf_counter()
            with prof:
                while eng.has_unfinished():
                    eng.step()
                if device.startswith("cuda"):
                    torch.cuda.synchronize()
            if rep <= reps and (rep > 0 or question):
                times.append(time.perf_counter() - t0)
            elif rep > reps:
                print_profile(prof, profile, device)
                if trace:
                    prof.export_chrome_trace(trace)
            for i in ids:
                eng.pop_finished(i)
    finally:
        eng.close()
        unbind(model)
    return times


def profiler(device: str):
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device.startswith("cuda"):
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(activities=acts)


def print_profile(prof, top: int, device: str) -> None:
    if not isinstance(prof, torch.profiler.profile):
        return
    ka = prof.key_averages()
    dev_key = "self_device_time_total" if device.startswith("cuda") else "self_cpu_time_total"
    print(ka.table(sort_by=dev_key, row_limit=top, max_name_column_width=60))
    print(ka.table(sort_by="cpu_time_total", row_limit=top, max_name_column_width=60))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--mixes", nargs="+", default=["1x1024", "16x1024", "1x8192", "1x32768", "4x32768"])
    ap.add_argument("--budgets", type=int, nargs="+", default=[8192], help="token budgets; 0 = whole prompts")
    ap.add_argument("--mac", nargs="+", default=["on", "off"], choices=["on", "off"])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--floor", action="store_true", help="measure the prefill floor of each mix (bench_prefill_floor)")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="after the timed runs, one run under torch.profiler; print its N costliest ops")
    ap.add_argument("--trace", default=None, metavar="PATH",
                    help="with --profile: the profiled run's Chrome trace; '{mix}' / '{mac}' in PATH name each run's")
    ap.add_argument("--question", type=int, default=0, metavar="Q",
                    help="multi-turn: a fresh Q-token question after one cached L-token document (module doc)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args(argv)
    cuda = args.device.startswith("cuda")
    shapes = TINY if args.dry_run else LLAMA_8B
    if args.dry_run:
        args.mixes, args.reps = ["1x64", "3x40"], 1
    dtype = torch.bfloat16 if cuda else torch.float32
    model = build_model(shapes, dtype, args.device)
    floor_of = None
    if args.floor:
        try:
            from bench_prefill_floor import FloorShapes, prefill_floor     # noqa: PLC0415
        except ImportError as exc:
            print(f"no floor: {exc}")
        else:
            def floor_of(B, L):
                rec = prefill_floor(FloorShapes.of(shapes), B, L, dtype=dtype, device=torch.device(args.device), reps=3,
                                    warmup=1)
                return rec["floor_ms"] * 1e-3 if rec.get("floor_ms") else None
    rows = []
    for mix in args.mixes:
        B, L = parse_mix(mix)
        floor = floor_of(B, L) if floor_of else None
        for budget in args.budgets:
            for mac in args.mac:
                ts = ttft(model, B, L, budget, mac == "on", args.device, args.reps, profile=args.profile,
                          question=args.question,
                          trace=args.trace.format(mix=mix, mac=mac) if args.trace else None)
                rec = {"mix": mix, "B": B, "L": L, "budget": budget, "mac": mac, "floor_s": floor}
                if args.question:
                    first, ts = ts[0], ts[1:]
                    rec.update(question=args.question, first_turn_s=first,
                               later_over_first=statistics.median(ts) / first)
                rec.update(ttft_s=statistics.median(ts), ttft_all_s=ts)
                rec["x_floor"] = rec["ttft_s"] / rec["floor_s"] if rec["floor_s"] else None
                rows.append(rec)
                print(f"{mix:>9} budget {budget or 'whole':>6} mac {mac:>3}: TTFT {rec['ttft_s'] * 1e3:9.1f} ms"
                      + (f"  floor {rec['floor_s'] * 1e3:8.1f} ms  x{rec['x_floor']:.2f}" if rec["floor_s"] else "")
                      + (f"  first turn {rec['first_turn_s'] * 1e3:9.1f} ms, later / first "
                         f"{rec['later_over_first']:.3f}" if args.question else ""), flush=True)
    for r in rows:      # MAC's seeding cost: on over off at the same mix and budget
        off = next((o for o in rows if o["mix"] == r["mix"] and o["budget"] == r["budget"] and o["mac"] == "off"), None)
        if r["mac"] == "on" and off:
            r["mac_over_off"] = r["ttft_s"] / off["ttft_s"]
    print(f"{'mix':>9} {'budget':>7} {'mac':>4} {'TTFT ms':>9} {'floor ms':>9} {'x floor':>8} {'on/off':>7}")
    for r in rows:
        print(f"{r['mix']:>9} {r['budget'] or 'whole':>7} {r['mac']:>4} {r['ttft_s'] * 1e3:9.1f} "
              f"{(r['floor_s'] or float('nan')) * 1e3:9.1f} {(r['x_floor'] or float('nan')):8.2f} "
              f"{r.get('mac_over_off', float('nan')):7.3f}")
    dev = torch.cuda.get_device_name() if cuda else f"{platform.machine()} CPU"
    report = {"benchmark": "bench_ttft", "device": dev,
              "device_uuid": str(torch.cuda.get_device_properties(0).uuid) if cuda else None,
              "torch": torch.__version__, "budget_field": BUDGET_FIELD, "args": vars(args), "rows": rows}
    if not args.dry_run or args.out:
        tag = "cpu" if not cuda else dev.split()[1].lower()
        out = Path(args.out or Path(__file__).parent / "results" / f"bench_ttft_{tag}.json")
        out.write_text(json.dumps(report, indent=2, default=str) + "\n")
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
