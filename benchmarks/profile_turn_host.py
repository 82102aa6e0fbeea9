"""Host (Python) cost of a later multi-turn request, on the CPU: where the time between a request's arrival at
the OpenAI server and its first streamed token goes when its document is already in the prefix cache
(``bench_serving.py --workload multiturn_32k``'s later turns), part by part.

    python benchmarks/profile_turn_host.py                       # 8K and 32K documents, 6 turns each
    python benchmarks/profile_turn_host.py --doc-len 32768 --turns 8 --out /tmp/x.json

The model is the built-in LLaMA with one layer of width 64 and long positions, so the model's compute is small
(it is still CPU compute standing in for the GPU's, and is reported apart as ``model forward``: subtract it).
The server is ``build_app`` under uvicorn on 127.0.0.1; the client, in a process of its own, sends
``bench_serving``'s request (a token-id prompt: the document and a fresh question, greedy, 16 tokens, streamed).
Each part is the wall time of public functions of the server, the LLM API and the engine, wrapped and timed with
``time.perf_counter``, less what they call that another part counts; the last part is the rest of the server's
time to the first token (the server's own submit, thread and event-loop hand-offs, waits for the GIL). The
cyclic garbage collector's pauses in that window are shown apart (they fall inside the parts). Every part is the
median over the later turns. A measurement of host work on whatever CPU runs it, not of a GPU.
"""
from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import json
import multiprocessing
import statistics
import sys
import threading
import time
from collections import defaultdict
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

VOCAB = 32000
QUESTION = 100
OUTPUT = 16


class Spans:
    """Wall-clock spans of wrapped callables, by label, since the last ``take``."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.spans: dict[str, list[tuple[float, float]]] = defaultdict(list)

    def add(self, label: str, t0: float, t1: float) -> None:
        with self.lock:
            self.spans[label].append((t0, t1))

    def wrap(self, owner, name: str, label: str) -> None:
        """Time every call of ``owner.name`` (a function or a coroutine function) under ``label``."""
        fn = getattr(owner, name)

        if asyncio.iscoroutinefunction(fn):
            @functools.wraps(fn)
            async def timed(*a, **kw):
                t0 = time.perf_counter()
                try:
                    return await fn(*a, **kw)
                finally:
                    self.add(label, t0, time.perf_counter())
        else:
            @functools.wraps(fn)
            def timed(*a, **kw):
                t0 = time.perf_counter()
                try:
                    return fn(*a, **kw)
                finally:
                    self.add(label, t0, time.perf_counter())
        setattr(owner, name, timed)

    def watch_gc(self) -> None:
        """Record the cyclic garbage collector's pauses under ``"gc"`` (whichever thread they stop)."""
        started = {}

        def callback(phase: str, info: dict) -> None:
            if phase == "start":
                started[threading.get_ident()] = time.perf_counter()
            else:
                self.add("gc", started.pop(threading.get_ident()), time.perf_counter())
        gc.callbacks.append(callback)

    def take(self) -> dict[str, list[tuple[float, float]]]:
        with self.lock:
            out, self.spans = self.spans, defaultdict(list)
        return out


def instrument(spans: Spans) -> None:
    """Wrap the public functions of the server, the LLM API and the engine on a later turn's path (the server's
    ``json`` is a shim whose ``loads`` is timed)."""
    from macattn.apps.llm import LLM
    from macattn.apps.serving import openai_server
    from macattn.runtime.block_manager import BlockManager
    from macattn.runtime.engine import LLMEngine
    from macattn.runtime.executor import ModelExecutor
    from macattn.runtime.scheduler import Scheduler

    shim = type("json", (), {"loads": staticmethod(json.loads), "dumps": staticmethod(json.dumps),
                             "JSONDecodeError": json.JSONDecodeError})
    spans.wrap(shim, "loads", "json.loads")
    openai_server.json = shim
    for owner, name in ((openai_server, "parse_completion"), (LLM, "generate_async"), (LLMEngine, "make_request"),
                        (LLMEngine, "submit"), (LLMEngine, "step"), (Scheduler, "schedule"),
                        (BlockManager, "prompt_keys"), (ModelExecutor, "prefill_chunks"), (ModelExecutor, "run_model"),
                        (Scheduler, "commit"), (ModelExecutor, "sample")):
        spans.wrap(owner, name, f"{owner.__name__ if isinstance(owner, type) else 'server'}.{name}")


class TimedApp:
    """ASGI wrapper: per ``/v1/completions`` request, when it arrived, when its body was read and when its first
    token's event was sent."""

    def __init__(self, app) -> None:
        self.app, self.records = app, []

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] != "/v1/completions":
            return await self.app(scope, receive, send)
        rec = {"in": time.perf_counter()}
        self.records.append(rec)

        async def recv():
            msg = await receive()
            if msg["type"] == "http.request" and not msg.get("more_body"):
                rec["body"] = time.perf_counter()
            return msg

        async def snd(msg):
            if msg["type"] == "http.response.body" and "first" not in rec and b'"text": "w' in msg.get("body", b""):
                rec["first"] = time.perf_counter()
            await send(msg)

        await self.app(scope, recv, snd)


def build_server(doc_len: int) -> tuple:
    """``(LLM, TimedApp)``: the tiny model with a synthetic word-level tokenizer (id ``i`` decodes to ``w<i>``, as
    ``bench_serving``'s 8B model), one slot, MAC's defaults, prefix caching on."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from macattn.apps.llm import LLM
    from macattn.apps.serving.openai_server import build_app
    from macattn.models.builtin import build_builtin_model

    model = build_builtin_model("llama", seed=0, num_hidden_layers=1, hidden_size=64, intermediate_size=128,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=VOCAB + 1,
                                max_position_embeddings=doc_len + QUESTION + OUTPUT + 32)
    vocab = {f"w{i}": i for i in range(VOCAB)}
    vocab["<eos>"] = VOCAB
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="w0")
    llm = LLM(model, tokenizer=tok, device="cpu", max_batch_size=1, enable_prefix_caching=True)
    return llm, TimedApp(build_app(llm, "tiny"))


def client_turn(url: str, prompt: list[int]) -> dict:
    """One ``bench_serving`` streaming request (run in the client process)."""
    import httpx

    from bench_serving import _stream_one

    async def go():
        async with httpx.AsyncClient(base_url=url, timeout=3600) as client:
            return await _stream_one(client, "tiny", prompt, OUTPUT)
    return asyncio.run(go())


def _sum(spans, label: str, lo: float, hi: float) -> float:
    """Seconds of ``label``'s spans inside ``[lo, hi]``."""
    return sum(b - a for a, b in spans.get(label, ()) if lo <= a and b <= hi)


def turn_parts(rec: dict, spans) -> dict[str, float]:
    """Milliseconds per part of one turn's time to its first token, each exclusive of the others (module doc)."""
    t_in, t_first = rec["in"], rec["first"]
    step = next((a, b) for a, b in sorted(spans["LLMEngine.step"])
                if t_in <= a <= t_first and any(a <= x and y <= b for x, y in spans["ModelExecutor.prefill_chunks"]))
    s = functools.partial(_sum, spans, lo=t_in, hi=t_first)
    e = functools.partial(_sum, spans, lo=step[0], hi=step[1])
    model = e("ModelExecutor.run_model")
    engine_request = s("LLMEngine.make_request") + s("LLMEngine.submit")
    parts = {
        "receive body (uvicorn)": rec["body"] - t_in,
        "json.loads": s("json.loads"),
        "parse_completion (validate fields)": s("server.parse_completion"),
        "LLM API request (excl. engine)": s("LLM.generate_async") - engine_request,
        "engine make_request + submit (check ids)": engine_request,
        "schedule (excl. block hashes)": e("Scheduler.schedule") - e("BlockManager.prompt_keys"),
        "prefix-cache block hashes": e("BlockManager.prompt_keys"),
        "prefill inputs (excl. model)": e("ModelExecutor.prefill_chunks") - model,
        "commit + sample": e("Scheduler.commit") + e("ModelExecutor.sample"),
        "rest of the engine step": (step[1] - step[0] - e("Scheduler.schedule") - e("ModelExecutor.prefill_chunks")
                                    - e("Scheduler.commit") - e("ModelExecutor.sample")),
        "output thread + SSE event (step end -> sent)": t_first - step[1],
    }
    host = sum(parts.values())
    parts["rest: server submit, hand-offs, GIL waits"] = t_first - t_in - model - host
    parts["host total (all above)"] = t_first - t_in - model
    parts["model forward (CPU compute, not host: subtract)"] = model
    parts["server: arrival -> first token sent"] = t_first - t_in
    parts["of which GC pauses (inside the parts)"] = s("gc")
    return {k: v * 1e3 for k, v in parts.items()}


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def profile(doc_len: int, turns: int, seed: int, spans: Spans, client: ProcessPoolExecutor) -> dict:
    """``turns`` requests of one ``doc_len``-token document and a fresh question each; per part the median over
    the later turns (ms), and every turn's client TTFT."""
    import random

    import uvicorn

    from macattn.apps.serving.openai_server import server_config

    llm, app = build_server(doc_len)
    port = _free_port()
    server = uvicorn.Server(server_config(app, "127.0.0.1", port))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    rng = random.Random(seed)
    doc = [rng.randrange(300, VOCAB) for _ in range(doc_len)]
    later, ttft, cached = [], [], []
    try:
        for turn in range(turns):
            spans.take()
            question = [rng.randrange(300, VOCAB) for _ in range(QUESTION)]
            res = client.submit(client_turn, f"http://127.0.0.1:{port}", doc + question).result()
            time.sleep(0.2)                          # the stream's end: the engine and output threads idle
            ttft.append(res["ttft"] * 1e3)
            cached.append(res["cached_tokens"])
            if turn:
                parts = turn_parts(app.records[-1], spans.take())
                later.append({**parts, "client TTFT": res["ttft"] * 1e3})
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        llm.shutdown()
    return {"doc_len": doc_len, "prompt_len": doc_len + QUESTION, "client_ttft_ms_per_turn": ttft,
            "cached_tokens_per_turn": cached,
            "later_turn_ms": {k: statistics.median(t[k] for t in later) for k in later[0]}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--doc-len", type=int, action="append", help="document tokens (repeatable; default 8192, 32768)")
    ap.add_argument("--turns", type=int, default=6, help="requests per document (the first fills the cache)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads of the server (1: no OpenMP workers competing with the host threads)")
    ap.add_argument("--out", default=None, help="JSON file (default: print only)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    spans = Spans()
    instrument(spans)
    spans.watch_gc()
    results = []
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as client:
        for n in args.doc_len or [8192, 32768]:
            results.append(profile(n, args.turns, args.seed, spans, client))
    labels = list(results[0]["later_turn_ms"])
    print(f"{'part (ms, median of later turns)':52s}" + "".join(f"{r['prompt_len']:>10d}" for r in results))
    for k in labels:
        print(f"{k:52s}" + "".join(f"{r['later_turn_ms'][k]:10.2f}" for r in results))
    for r in results:
        ttft = [round(x, 1) for x in r["client_ttft_ms_per_turn"]]
        print(f"prompt {r['prompt_len']}: client TTFT per turn (ms) {ttft}, cached {r['cached_tokens_per_turn']}")
    if args.out:
        Path(args.out).write_text(json.dumps({"benchmark": "profile_turn_host", "device": "cpu",
                                              "torch_threads": args.threads, "results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
