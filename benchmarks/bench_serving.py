"""Serving benchmark in the shape of vLLM's ``benchmark_serving``: the ``openai`` async client sends
``--num-prompts`` streaming completions to the OpenAI-compatible server (``macattn serve --model``),
arrivals Poisson at ``--request-rate`` per second (``inf``: all at once) with at most ``--concurrency``
in flight; prompts are random token ids of ``--input-len`` (token-id prompts) and every request asks
for ``--output-len`` tokens (greedy).

    python benchmarks/bench_serving.py                        # CPU, built-in model, server started here
    python benchmarks/bench_serving.py --url http://host:8000 --model NAME   # an already running server
    python benchmarks/bench_serving.py --dry-run              # a few tiny requests: checks the script
    python benchmarks/bench_serving.py --model llama8b-random --device cuda   # LLaMA-3.1-8B shapes, random bf16
                                                              # weights, a synthetic word-per-id tokenizer

Reported: time to first token (TTFT), inter-token latency (ITL: gaps between streamed chunks after the
first) and end-to-end latency, p50 / p99 / mean; request and output-token throughput over the run.
JSON (+ table) in ``benchmarks/results/bench_serving_<device>.json``.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import socket
import statistics
import sys
import threading
import time
from pathlib import Path


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def _stats(xs: list[float]) -> dict:
    return {"p50": _pct(xs, 50), "p99": _pct(xs, 99), "mean": statistics.fmean(xs) if xs else None, "n": len(xs)}


async def run(url: str, model: str, args) -> dict:
    import openai

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(300, args.vocab) for _ in range(args.input_len)] for _ in range(args.num_prompts)]
    gate = asyncio.Semaphore(args.concurrency)
    records: list[dict] = []

    async def one(prompt):
        async with gate:
            t0 = time.perf_counter()
            chunks, usage = [], None
            stream = await client.completions.create(model=model, prompt=prompt, max_tokens=args.output_len,
                                                     temperature=0, stream=True)
            async for ch in stream:
                if ch.choices and ch.choices[0].text:
                    chunks.append(time.perf_counter())
                if ch.usage is not None:
                    usage = ch.usage
            t1 = time.perf_counter()
            records.append({"ttft": chunks[0] - t0 if chunks else None, "itl": [b - a for a, b in zip(chunks, chunks[1:])],
                            "e2e": t1 - t0, "output_tokens": usage.completion_tokens if usage else len(chunks)})

    tasks, start = [], time.perf_counter()
    for p in prompts:
        tasks.append(asyncio.create_task(one(p)))
        if args.request_rate != float("inf"):
            await asyncio.sleep(rng.expovariate(args.request_rate))
    await asyncio.gather(*tasks)
    wall = time.perf_counter() - start
    out_tokens = sum(r["output_tokens"] for r in records)
    return {"requests": len(records), "duration_s": wall, "request_throughput_per_s": len(records) / wall,
            "output_token_throughput_per_s": out_tokens / wall, "output_tokens": out_tokens,
            "ttft_s": _stats([r["ttft"] for r in records if r["ttft"] is not None]),
            "itl_s": _stats([g for r in records for g in r["itl"]]), "e2e_s": _stats([r["e2e"] for r in records])}


RANDOM_8B = "llama8b-random"


def _random_8b(device: str):
    """LLaMA-3.1-8B shapes with random bf16 weights (``bench_e2e``'s) and a synthetic tokenizer that maps
    id ``i`` to the word ``w<i>`` (the prompts are token ids; only the streamed text needs a decoder)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from bench_e2e import LLAMA_8B, build_model

    model = build_model(LLAMA_8B, torch.bfloat16, device)
    vocab = {f"w{i}": i for i in range(LLAMA_8B["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return model, PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="w1", unk_token="w0")


def _start_server(args):
    import uvicorn

    from macattn.apps.llm import LLM
    from macattn.apps.openai_server import build_app

    if args.model == RANDOM_8B:
        model, tok = _random_8b(args.device)
        llm = LLM(model, tokenizer=tok, device=args.device, max_batch_size=args.max_batch_size,
                  max_seq_len=args.input_len + args.output_len + 16, prefill_chunk=args.prefill_chunk)
    else:
        llm = LLM(args.model, device=args.device, max_batch_size=args.max_batch_size,
                  prefill_chunk=args.prefill_chunk)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(build_app(llm, args.model), host="127.0.0.1", port=port,
                                           log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return llm, server, f"http://127.0.0.1:{port}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default=None, help="a running server (default: start one here on --model)")
    ap.add_argument("--model", default="builtin", help=f"'builtin', a model directory or '{RANDOM_8B}'")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--max-batch-size", type=int, default=8)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson arrivals per second")
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=8000, help="token ids are drawn from [300, vocab)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prefill-chunk", type=int, default=None, help="RuntimeConfig.prefill_chunk (default: whole prompts)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args(argv)
    if args.dry_run:
        args.num_prompts, args.concurrency, args.input_len, args.output_len = 4, 2, 16, 4
    server = None
    if args.url is None:
        llm, server, url = _start_server(args)
        args.vocab = min(args.vocab, llm.engine.vocab_size)
    else:
        url = args.url
    try:
        res = asyncio.run(run(url, args.model, args))
    finally:
        if server is not None:
            server.should_exit = True
            llm.shutdown()
    import torch

    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else f"{platform.machine()} CPU"
    report = {"benchmark": "bench_serving", "device": device, "torch": torch.__version__, "args": vars(args), **res}
    print(f"{'metric':<26} {'p50':>10} {'p99':>10} {'mean':>10}")
    for key in ("ttft_s", "itl_s", "e2e_s"):
        s = res[key]
        print(f"{key:<26} " + " ".join(f"{(v * 1e3 if v is not None else float('nan')):>8.1f}ms"
                                      for v in (s["p50"], s["p99"], s["mean"])))
    print(f"requests {res['requests']} in {res['duration_s']:.1f} s: {res['request_throughput_per_s']:.2f} req/s, "
          f"{res['output_token_throughput_per_s']:.1f} output tok/s")
    if not args.dry_run:
        tag = "cpu" if not args.device.startswith("cuda") else device.split()[1].lower()
        out = Path(args.out or Path(__file__).parent / "results" / f"bench_serving_{tag}.json")
        out.write_text(json.dumps(report, indent=2, default=str) + "\n")
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
