"""Real clients this project did not write, run against ``macattn serve --model builtin`` on the CPU:
guidellm 0.8.1 (its default chat request format, then ``/v1/completions``) and lm-eval 0.4.13
(``local-completions`` with its default settings on the tiny local tasks of ``tests/data/lm_eval/``:
generate_until, loglikelihood, multiple_choice), the lm-eval scores next to the same tasks scored by
lm-eval's ``hf`` model (a plain transformers forward of the same checkpoint, fp32).

The clients are found with ``--clients-bin DIR`` (a folder holding the ``guidellm`` and ``lm_eval`` commands,
e.g. a virtual environment's ``bin``), ``$MACATTN_CLIENTS_BIN``, or ``PATH``. They live in a virtual environment of
their own, not beside the project: guidellm needs numpy >= 2 and nvidia-pytriton (a test dependency) numpy < 2.
``--setup DIR`` makes that environment (``CLIENT_PINS``, the CPU torch and the transformers range the project
supports; about 2 minutes and 1.9 GB once, nothing when ``DIR`` already holds these pins) and prints its ``bin``;
the tests' fixture (``tests/apps/test_real_clients.py``) does this before running them::

    python benchmarks/run_clients.py --setup ~/.cache/macattn/clients
    python benchmarks/run_clients.py --clients-bin ~/.cache/macattn/clients/bin

Writes ``benchmarks/results/clients_cpu.json`` (the summary: failed requests per client, guidellm's request
counts and latencies, lm-eval's scores served vs transformers and the largest log-likelihood difference) and
the clients' own reports and logs under ``benchmarks/results/clients_cpu/``. Exit status 0 iff every client
run had no failed request and the served scores equal the transformers ones (log-likelihoods within
``--atol``, generations and accuracies exactly).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHECKPOINT = ROOT / "python" / "macattn" / "data" / "tiny_llama"
TASK_DIR = ROOT / "tests" / "data" / "lm_eval"
TASKS = ("macattn_generate_until", "macattn_loglikelihood", "macattn_multiple_choice")
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}


CLIENT_PINS = ("guidellm==0.8.1", "lm-eval[api,hf]==0.4.13", "accelerate")


def setup_clients(venv: Path) -> Path:
    """Make (or reuse) the clients' virtual environment at ``venv``; returns its ``bin`` folder. Reused as is when
    its stamp file lists the same requirements and both commands are there."""
    from macattn.models.transformers_api import SUPPORTED_TRANSFORMERS

    import torch

    reqs = [f"torch=={torch.__version__.split('+')[0]}", f"transformers{SUPPORTED_TRANSFORMERS}", *CLIENT_PINS]
    bin_dir, stamp = venv / "bin", venv / "macattn-clients.txt"
    if stamp.is_file() and stamp.read_text().split() == reqs and all((bin_dir / c).is_file()
                                                                    for c in ("guidellm", "lm_eval")):
        return bin_dir
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(bin_dir / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check", *reqs],
                   check=True)
    stamp.write_text("\n".join(reqs) + "\n")
    return bin_dir


def find_clients(bin_dir: str | None) -> dict[str, str | None]:
    """``{"guidellm": path or None, "lm_eval": path or None}`` (module doc: where they are looked for)."""
    bin_dir = bin_dir or os.environ.get("MACATTN_CLIENTS_BIN")
    found = {}
    for name in ("guidellm", "lm_eval"):
        path = Path(bin_dir) / name if bin_dir else None
        found[name] = str(path) if path is not None and path.is_file() else shutil.which(name)
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``macattn serve --model builtin`` in a subprocess (its output in ``log``), ready when it prints its
    ready line."""

    def __init__(self, log: Path, *extra: str, timeout: float = 300) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        cmd = [sys.executable, "-m", "macattn.cli", "serve", "--model", "builtin", "--port", str(self.port), *extra]
        self.cmd = cmd
        self._out = open(log, "w")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     cwd=ROOT, env={**os.environ, **OFFLINE})
        self.ready = threading.Event()
        threading.Thread(target=self._pump, daemon=True).start()
        if not self.ready.wait(timeout) or self.proc.poll() is not None:
            self.stop()
            raise RuntimeError(f"the server did not start (log: {log})")

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self._out.write(line)
            self._out.flush()
            if "ready on http://" in line:
                self.ready.set()

    def metrics(self) -> str:
        return metrics_text(self.url)

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def metrics_text(url: str) -> str:
    """The Prometheus text of the server at ``url`` (``/metrics``)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as r:
        return r.read().decode()


def request_counts(text: str) -> dict[str, int]:
    """Requests the server answered, by status (``macattn_requests_total``, summed over endpoints), from the
    Prometheus ``text``."""
    counts: dict[str, int] = {}
    for line in text.splitlines():
        m = re.match(r'macattn_requests_total\{endpoint="([^"]*)",status="(\d+)"\} ([0-9.e+]+)', line)
        if m:
            counts[m.group(2)] = counts.get(m.group(2), 0) + int(float(m.group(3)))
    return counts


def _run(cmd: list[str], log: Path, timeout: float, cwd: Path = ROOT) -> tuple[int, float]:
    t0 = time.time()
    with open(log, "w") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=cwd, timeout=timeout,
                                env={**os.environ, **OFFLINE}).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    return rc, time.time() - t0


def _mean(metrics: dict, key: str) -> float | None:
    """guidellm's mean of a successful-requests metric (None where its report lacks it)."""
    v = metrics.get(key, {}).get("successful", {}).get("mean")
    return None if v is None else round(v, 3)


def _pct99(metrics: dict, key: str) -> float | None:
    """guidellm's p99 of a successful-requests metric (None where its report lacks it)."""
    v = (metrics.get(key, {}).get("successful", {}).get("percentiles") or {}).get("p99")
    return None if v is None else round(v, 3)


def _version(exe: str, module: str) -> str | None:
    python = Path(exe).parent / "python"
    python = str(python) if python.is_file() else sys.executable
    out = subprocess.run([python, "-c", f"from importlib.metadata import version; print(version({module!r}))"],
                         capture_output=True, text=True)
    return out.stdout.strip() or None


def run_guidellm(exe: str, server, out: Path, *, requests: int, prompt_tokens: int, output_tokens: int,
                 timeout: float, tokenizer: Path = CHECKPOINT, profile: str = "kind=synchronous",
                 formats: tuple = (("chat", None), ("completions", "/v1/completions"))) -> dict:
    """guidellm against the server at ``server.url`` (its ``/metrics`` read before and after): one run per ``formats``
    entry ``(name, request_format or None for guidellm's default chat)``, ``requests`` synthetic prompts of
    ``prompt_tokens`` tokens (counted by ``tokenizer``, a Hugging Face tokenizer directory) each, ``profile``
    guidellm's load profile (synchronous by default; e.g. ``kind=concurrent,streams=16``)."""
    results = {}
    tok = str(tokenizer.relative_to(ROOT)) if tokenizer.is_relative_to(ROOT) else str(tokenizer)
    for name, fmt in formats:
        report = out / f"guidellm_{name}.json"
        backend = f"kind=openai_http,target={server.url}" + (f",request_format={fmt}" if fmt else "")
        cmd = [exe, "run", "--backend", backend, "--profile", profile,
               "--constraint", f"kind=max_requests,count={requests}",
               "--data", f"kind=synthetic_text,prompt_tokens={prompt_tokens},output_tokens={output_tokens}",
               "--tokenizer", f"kind=huggingface_auto,model={tok}",
               "--output", f"kind=json,path={report}", "--disable-console-interactive"]
        before = request_counts(metrics_text(server.url))
        rc, wall = _run(cmd, out / f"guidellm_{name}.log", timeout)
        after = request_counts(metrics_text(server.url))
        res = {"command": _portable(cmd), "exit_code": rc, "wall_s": round(wall, 1), "request_format": fmt or
               "default (/v1/chat/completions, streaming)",
               "server_responses": {k: after.get(k, 0) - before.get(k, 0) for k in after}}
        if report.is_file():
            bench = json.loads(report.read_text())["benchmarks"][0]
            m = bench["metrics"]
            totals = m["request_totals"]

            def med(key):
                v = m.get(key, {}).get("successful", {})
                return None if v.get("median") is None else round(v["median"], 3)

            res.update({"requests": totals, "median_request_latency_s": med("request_latency"),
                        "output_tok_per_s_mean": _mean(m, "output_tokens_per_second"),
                        "p99_ttft_ms": _pct99(m, "time_to_first_token_ms"),
                        "p99_itl_ms": _pct99(m, "inter_token_latency_ms"),
                        "median_ttft_ms": med("time_to_first_token_ms"), "median_itl_ms": med("inter_token_latency_ms"),
                        "median_output_tokens": med("output_token_count"),
                        "median_prompt_tokens": med("prompt_token_count"),
                        "failed_requests": totals.get("errored", 0) + totals.get("incomplete", 0)})
        else:
            res["failed_requests"] = None
        not_ok = sum(v for k, v in res["server_responses"].items() if k != "200")
        res["ok"] = (rc == 0 and res.get("failed_requests") == 0 and not_ok == 0
                     and res.get("requests", {}).get("successful") == requests)
        results[name] = res
    return results


def _samples(folder: Path, task: str) -> list[dict]:
    files = sorted(glob.glob(str(folder / "*" / f"samples_{task}_*.jsonl")))
    return [json.loads(line) for line in open(files[-1])] if files else []


def _scores(folder: Path) -> dict:
    files = sorted(glob.glob(str(folder / "*" / "results_*.json")))
    if not files:
        return {}
    res = json.loads(Path(files[-1]).read_text())["results"]
    return {task: {k.split(",")[0]: v for k, v in vals.items() if "stderr" not in k and k != "alias"}
            for task, vals in res.items()}


def run_lm_eval(exe: str, server: Server, out: Path, *, atol: float, timeout: float) -> dict:
    """lm-eval ``local-completions`` (default settings: token-id prompts, the server's remote tokenizer,
    batch 1) and ``hf`` (transformers, fp32) on the same tasks; per-sample comparison."""
    tasks = ",".join(TASKS)
    common = ["--tasks", tasks, "--include_path", str(TASK_DIR.relative_to(ROOT)), "--log_samples"]
    served = out / "lm_eval_server"
    ref = out / "lm_eval_transformers"
    for d in (served, ref):
        shutil.rmtree(d, ignore_errors=True)
    cmd_s = [exe, "--model", "local-completions", "--model_args",
             f"model=builtin,base_url={server.url}/v1/completions", "--output_path", str(served), *common]
    cmd_r = [exe, "--model", "hf", "--model_args",
             f"pretrained={CHECKPOINT.relative_to(ROOT)},dtype=float32", "--device", "cpu", "--output_path", str(ref),
             *common]
    before = request_counts(server.metrics())
    rc_s, wall_s = _run(cmd_s, out / "lm_eval_server.log", timeout)
    after = request_counts(server.metrics())
    rc_r, wall_r = _run(cmd_r, out / "lm_eval_transformers.log", timeout)
    per_task = {}
    max_diff, all_equal = 0.0, True
    for task in TASKS:
        a, b = _samples(served, task), _samples(ref, task)
        diffs, gen_equal, greedy_equal = [], True, True
        for x, y in zip(a, b):
            for rx, ry in zip(x["resps"], y["resps"]):
                if isinstance(rx[0], str):          # generate_until: the generated text
                    gen_equal &= rx[0] == ry[0]
                else:                               # loglikelihood: (logprob, is_greedy)
                    diffs.append(abs(float(rx[0][0]) - float(ry[0][0])))
                    greedy_equal &= str(rx[0][1]) == str(ry[0][1])
        d = max(diffs) if diffs else 0.0
        max_diff = max(max_diff, d)
        equal = bool(a) and len(a) == len(b) and gen_equal and greedy_equal and d <= atol
        all_equal &= equal
        per_task[task] = {"docs": len(a), "max_abs_loglikelihood_diff": d if diffs else None,
                          "generations_equal": gen_equal if not diffs else None, "is_greedy_equal": greedy_equal,
                          "equal": equal}
    s_scores, r_scores = _scores(served), _scores(ref)
    for task in TASKS:
        per_task[task]["server"] = s_scores.get(task)
        per_task[task]["transformers"] = r_scores.get(task)
        for metric in ("acc", "acc_norm", "exact_match"):
            sv, rv = (s_scores.get(task) or {}).get(metric), (r_scores.get(task) or {}).get(metric)
            if sv is not None or rv is not None:
                per_task[task]["equal"] &= sv == rv
                all_equal &= sv == rv
    responses = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    failed = sum(v for k, v in responses.items() if k != "200")
    return {"command_server": _portable(cmd_s), "command_transformers": _portable(cmd_r),
            "exit_code_server": rc_s, "exit_code_transformers": rc_r, "wall_s_server": round(wall_s, 1),
            "wall_s_transformers": round(wall_r, 1), "server_responses": responses, "failed_requests": failed,
            "atol": atol, "max_abs_loglikelihood_diff": max_diff, "tasks": per_task,
            "ok": rc_s == 0 and rc_r == 0 and failed == 0 and all_equal}


def _portable(cmd: list[str]) -> list[str]:
    """A command with this machine's paths written relative to the repository (as committed)."""
    out = []
    for c in cmd:
        c = c.replace(str(ROOT) + "/", "").replace(str(ROOT), ".")
        out.append(Path(c).name if os.path.isabs(c) and Path(c).is_file() else c)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients-bin", default=None, help="folder with the guidellm and lm_eval commands")
    ap.add_argument("--setup", default=None, metavar="DIR",
                    help="make the clients' virtual environment at DIR, print its bin folder and exit")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"), help="results folder")
    ap.add_argument("--only", choices=("guidellm", "lm_eval"), default=None, help="run one client")
    ap.add_argument("--requests", type=int, default=8, help="guidellm: requests per run")
    ap.add_argument("--prompt-tokens", type=int, default=64, help="guidellm: synthetic prompt tokens")
    ap.add_argument("--output-tokens", type=int, default=16, help="guidellm: output tokens (ignore_eos)")
    ap.add_argument("--atol", type=float, default=1e-4, help="lm-eval: log-likelihood tolerance served vs transformers")
    ap.add_argument("--timeout", type=float, default=1200, help="seconds per client run")
    ap.add_argument("--summary", default="clients_cpu.json", help="summary file name in --out")
    args = ap.parse_args(argv)
    if args.setup:
        print(setup_clients(Path(args.setup).expanduser().resolve()))
        return 0
    clients = find_clients(args.clients_bin)
    wanted = [args.only] if args.only else ["guidellm", "lm_eval"]
    missing = [c for c in wanted if clients[c] is None]
    if missing:
        print(f"not installed: {', '.join(missing)}; --setup DIR installs them (this script's doc)", file=sys.stderr)
        return 2
    out_root = Path(args.out)
    out = out_root / Path(args.summary).stem
    out.mkdir(parents=True, exist_ok=True)
    import torch

    summary = {"what": "real clients against `macattn serve --model builtin` (CPU); benchmarks/run_clients.py",
               "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
                           "torch": torch.__version__, "torch_threads": torch.get_num_threads()},
               "versions": {"guidellm": _version(clients["guidellm"], "guidellm") if clients["guidellm"] else None,
                            "lm_eval": _version(clients["lm_eval"], "lm_eval") if clients["lm_eval"] else None}}
    server = Server(out / "server.log")
    summary["server"] = {"command": _portable(server.cmd), "log": str((out / "server.log").relative_to(out_root))}
    try:
        if "guidellm" in wanted:
            print("guidellm ...", flush=True)
            summary["guidellm"] = run_guidellm(clients["guidellm"], server, out, requests=args.requests,
                                               prompt_tokens=args.prompt_tokens, output_tokens=args.output_tokens,
                                               timeout=args.timeout)
        if "lm_eval" in wanted:
            print("lm-eval ...", flush=True)
            summary["lm_eval"] = run_lm_eval(clients["lm_eval"], server, out, atol=args.atol, timeout=args.timeout)
        summary["server"]["responses"] = request_counts(server.metrics())
    finally:
        summary["server"]["exit_code"] = server.stop()
    ok = all((summary.get("guidellm") or {}).get(k, {}).get("ok", True) for k in ("chat", "completions")) and \
        (summary.get("lm_eval") or {}).get("ok", True)
    summary["ok"] = ok
    path = out_root / args.summary
    path.write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps({k: summary[k] for k in ("versions", "ok")}, indent=2))
    print(f"wrote {path} and {out}/")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
