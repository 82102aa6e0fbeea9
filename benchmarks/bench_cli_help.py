"""Wall time of ``macattn --help`` and of ``macattn COMMAND --help`` for every command: each a fresh process
(``python -m macattn``, the installed console script's code), timed from spawn to exit, ``--runs`` times;
prints the median per command and fails (exit 1) when one exceeds ``--budget`` seconds.

    PYTHONPATH=python python3 benchmarks/bench_cli_help.py --runs 5
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

from macattn.cli import command_parsers


def help_seconds(command: list[str], runs: int) -> list[float]:
    """Seconds of ``runs`` fresh ``python -m macattn COMMAND --help`` processes."""
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "macattn", *command, "--help"], check=True, stdout=subprocess.DEVNULL)
        times.append(time.perf_counter() - t0)
    return times


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=5, help="processes per command")
    p.add_argument("--budget", type=float, default=1.0, help="largest median in seconds that passes")
    p.add_argument("--json", default=None, help="also write {command: {median_s, runs_s}} here")
    args = p.parse_args()
    if args.runs < 1:
        p.error(f"--runs must be >= 1, got {args.runs}")
    report = {}
    for command in [[], *([c] for c in command_parsers())]:
        runs = help_seconds(command, args.runs)
        name = " ".join(["macattn", *command, "--help"])
        report[name] = {"median_s": statistics.median(runs), "runs_s": runs}
        print(f"{name:<40} median {statistics.median(runs):.3f} s  ({', '.join(f'{t:.3f}' for t in runs)})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    slow = [n for n, r in report.items() if r["median_s"] > args.budget]
    if slow:
        print(f"over the {args.budget} s budget: {', '.join(slow)}")
    return 1 if slow else 0


if __name__ == "__main__":
    sys.exit(main())
