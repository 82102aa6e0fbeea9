"""Serving benchmark in the shape of vLLM's ``benchmark_serving``, measured against the hardware floor of
the same device in the same run: an async HTTP client (``httpx``, raw JSON and server-sent events, as vLLM's
benchmark posts with aiohttp) sends streaming completions (token-id prompts, greedy) to the OpenAI-compatible
server (``macattn.apps.serving.openai_server``, started here on the
model, or ``--url``), at most ``concurrency`` in flight, arrivals Poisson at ``--request-rate`` per second
(``inf``: all at once).

    python benchmarks/bench_serving.py --model llama8b-random --device cuda      # every named workload
    python benchmarks/bench_serving.py --model llama8b-random --device cuda --workload long_4x32k_1024 --mac-ab
    python benchmarks/bench_serving.py                        # CPU, built-in model: one run of --num-prompts etc.
    python benchmarks/bench_serving.py --dry-run              # tiny requests on the CPU: checks the script
    python benchmarks/bench_serving.py --dry-run --workload ttft_1k --workload long_4x32k_1024 --mac-ab
    python benchmarks/bench_serving.py --model llama8b-random --device cuda --workload multiturn_32k
    python benchmarks/bench_serving.py --url http://host:8000 --model NAME   # an already running server (no floor)

Named workloads (``--workload NAME``, repeatable; all of them by default on ``--device cuda``; ``--dry-run``
scales each down to a few tokens; one result record each, one per variant):

==================  =========================================  ============================================
name                requests                                   reported
==================  =========================================  ============================================
ttft_32k            1 x (32K in, 1 out), ``--ttft-reps`` times   TTFT
ttft_1k             1 x (1K in, 1 out), ``--ttft-reps`` times    TTFT
mix_1k_64           64 x (1K in, 64 out), 16 in flight          output tok/s, TTFT p50/p99, ITL p50/p99
long_4x32k_128      4 x (32K in, 128 out), MAC on               TTFT p50, whole run, output tok/s
long_4x32k_1024     4 x (32K in, 1024 out), MAC on; hit         as above, per variant, + measured hit rate
                    patterns ``model`` / ``seeded90`` /
                    ``seeded100`` (``--hit-patterns``); MAC off
                    too with ``--mac-ab``
multiturn_32k       one 32K document, then 4 turns of (the      TTFT per turn and cached prompt tokens per
                    document + a ~100-token question, 16 out),  turn (``usage.prompt_tokens_details``), the
                    one at a time, greedy; prefix caching on    later turns' TTFT p50 / the first turn's
                    and off (same MAC)
==================  =========================================  ============================================

``--no-mac`` runs every workload with MAC off (``LLM(mac="off")``). Hit patterns: ``model`` is the model's
own matches (MAC's defaults); ``seededP`` is a benchmark-only subclass of ``MacAttention`` registered here
under ``bench_mac_seededP`` (``SeededHitMac``: a fixed seeded fraction P of the (layer, head) pairs matches
a constant query, so every step of those heads hits), never reachable from a user's configuration. The
measured hit rate is the mean of ``RequestOutput.metrics["mac_hit_rate"]`` over the workload's requests,
read from the server's ``/metrics`` (its ``macattn_mac_hit_rate`` histogram) before and after the run.

The floor (``bench_prefill_floor.measure_floor``, this process, this device, the served model's shapes):
the prefill floor of each workload's prompt mix (``1 x input`` for the TTFT workloads, ``concurrency x input``
otherwise) and the MAC-off decode step at ``concurrency x input`` (the model object is shared). Each record
carries ``TTFT p50 / prefill floor`` and ``output tok/s / floor tok/s``, where floor tok/s = output tokens /
(prefill floor of all prompts + decode floor x decode steps; a wave of ``concurrency`` requests takes
``output_len - 1`` decode steps after its prefill). Every (batch, max_seq_len, method, MAC) shape gets its
own ``LLM`` + server; a server is shut down (``server.should_exit``, ``llm.shutdown()``, the model unbound)
before the next starts. On CUDA all decode-graph buckets are captured before the first request. Before each
record a warm-up runs untimed (``warmup_load``): one request of the workload's prompt length, or for a throughput
workload a first wave of ``concurrency`` of them (8 output tokens), so the paths the timed load takes (prompts
chunked beside running decodes) have run once in this process whichever record comes first.
``--max-num-batched-tokens`` goes to ``LLM(...)`` only when given and only if this version's ``LLM`` takes it (the
JSON says which).

``--guidellm EXE`` also runs guidellm (its ``concurrent`` profile at the workload's concurrency, the workload's
request count and prompt / output lengths, ``/v1/completions``) against each throughput workload's server right
after this benchmark's own client, and puts guidellm's summary in the record (its report beside the JSON, in
``guidellm_<workload>/``). On ``llama8b-random`` guidellm's synthetic words map to varied ids (``guidellm_words``).

Reported: TTFT, inter-token latency (ITL: gaps between streamed chunks after the first), end-to-end
latency (p50 / p99 / mean), request and output-token throughput, the floor and the ratios; the server's own
means of TTFT, per-request ITL and latency over the same requests (``server_means``; for guidellm's run too), so what a
client adds shows, and the quantiles of every token gap the server saw (``server_itl_quantiles_s``, from its
``vllm:inter_token_latency_seconds`` buckets); JSON (device and
UUID, versions, every figure; rewritten after every record) in ``benchmarks/results/bench_serving_<gpu>.json``
or ``--out``, and a table.
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import inspect
import json
import math
import random
import socket
import statistics
import subprocess
import sys
import threading
import time
import traceback
import zlib
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import ClassVar

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from macattn.methods.mac.backend import MacAttention  # noqa: E402
from macattn.methods.mac.config import MacConfig  # noqa: E402

RANDOM_8B = "llama8b-random"


# --- the client -----------------------------------------------------------------------------------
def _pct(xs: list[float], q: float) -> float | None:
    """The ``q``-th percentile, linearly interpolated between the two nearest ranks (numpy's default, which
    vLLM's ``benchmark_serving`` reports): the p50 of 4 requests is the mean of the 2nd and 3rd. Until the
    eighth session this took the rank ``round(q / 100 * (n - 1))``, the 3rd of 4 (``benchmarks/notes/serving.md``)."""
    if not xs:
        return None
    xs = sorted(xs)
    pos = q / 100 * (len(xs) - 1)
    lo = int(pos)
    return xs[lo] + (xs[min(lo + 1, len(xs) - 1)] - xs[lo]) * (pos - lo)


def _stats(xs: list[float]) -> dict:
    """p50 / p99 / mean / n, and every value (sorted) where there are at most 16 (a few long requests' TTFTs)."""
    out = {"p50": _pct(xs, 50), "p99": _pct(xs, 99), "mean": statistics.fmean(xs) if xs else None, "n": len(xs)}
    if 0 < len(xs) <= 16:
        out["sorted"] = sorted(xs)
    return out


async def run(url: str, model: str, args=None, *, num_prompts: int | None = None, input_len: int | None = None,
              output_len: int | None = None, concurrency: int | None = None, request_rate: float | None = None,
              vocab: int | None = None, seed: int | None = None) -> dict:
    """Send ``num_prompts`` streaming completions of ``input_len`` random token ids (drawn from
    ``[300, vocab)``, seeded) asking for ``output_len`` tokens each, ``concurrency`` in flight; every keyword
    left None is read from ``args`` (the CLI's). Returns throughput and TTFT / ITL / e2e statistics (s)."""
    import httpx

    pick = lambda v, name: v if v is not None else getattr(args, name)  # noqa: E731
    num_prompts, input_len, output_len = pick(num_prompts, "num_prompts"), pick(input_len, "input_len"), \
        pick(output_len, "output_len")
    concurrency, request_rate = pick(concurrency, "concurrency"), pick(request_rate, "request_rate")
    vocab, seed = pick(vocab, "vocab"), pick(seed, "seed")
    # raw JSON over httpx, as vLLM's benchmark_serving posts with aiohttp: openai-python's request transform
    # walks a prompt of ids element by element (0.93 s for 32K ids on the 2-core CPU machine), which a
    # TTFT timed around client.completions.create would count as the server's
    client = httpx.AsyncClient(base_url=url, timeout=3600, limits=httpx.Limits(max_connections=concurrency + 4))
    rng = random.Random(seed)
    prompts = [[rng.randrange(300, vocab) for _ in range(input_len)] for _ in range(num_prompts)]
    gate = asyncio.Semaphore(concurrency)
    records: list[dict] = []

    async def one(prompt):
        async with gate:
            records.append(await _stream_one(client, model, prompt, output_len))

    tasks, start = [], time.perf_counter()
    for p in prompts:
        tasks.append(asyncio.create_task(one(p)))
        if request_rate != float("inf"):
            await asyncio.sleep(rng.expovariate(request_rate))
    await asyncio.gather(*tasks)
    wall = time.perf_counter() - start
    await client.aclose()
    return _results(records, wall)


async def _stream_one(client, model: str, prompt: list[int], output_len: int) -> dict:
    """One streaming greedy completion of ``prompt``: its TTFT, inter-token gaps, e2e (s), output tokens and the
    prompt tokens the server served from its prefix cache (``usage.prompt_tokens_details.cached_tokens``; None
    from a server that does not report it)."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0,
                       "stream": True, "stream_options": {"include_usage": True}})
    t0 = time.perf_counter()
    chunks, usage = [], None
    async with client.stream("POST", "/v1/completions", content=body,
                             headers={"Content-Type": "application/json"}) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread()).decode()[:300]}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ch = json.loads(line[6:])
            if ch.get("choices") and ch["choices"][0].get("text"):
                chunks.append(time.perf_counter())
            if ch.get("usage"):
                usage = ch["usage"]
    t1 = time.perf_counter()
    return {"ttft": chunks[0] - t0 if chunks else None, "itl": [b - a for a, b in zip(chunks, chunks[1:])],
            "e2e": t1 - t0, "output_tokens": usage["completion_tokens"] if usage else len(chunks),
            "cached_tokens": ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens")}


def _results(records: list[dict], wall: float) -> dict:
    out_tokens = sum(r["output_tokens"] for r in records)
    return {"requests": len(records), "duration_s": wall, "request_throughput_per_s": len(records) / wall,
            "output_token_throughput_per_s": out_tokens / wall, "output_tokens": out_tokens,
            "ttft_s": _stats([r["ttft"] for r in records if r["ttft"] is not None]),
            "itl_s": _stats([g for r in records for g in r["itl"]]), "e2e_s": _stats([r["e2e"] for r in records])}


async def turns(url: str, model: str, *, doc_len: int, question_len: int, num_turns: int, output_len: int,
                vocab: int, seed: int) -> dict:
    """The multi-turn load: one document of ``doc_len`` random token ids, then ``num_turns`` requests, one at a
    time, each the document followed by a fresh question of ``question_len`` ids (greedy, ``output_len`` out).
    ``run``'s figures plus ``turns`` (per turn: TTFT s, cached prompt tokens), the first turn's TTFT and the
    later turns' TTFT p50 over it (what prefix caching is for: the document is prefilled once)."""
    import httpx

    rng = random.Random(seed)
    doc = [rng.randrange(300, vocab) for _ in range(doc_len)]
    client = httpx.AsyncClient(base_url=url, timeout=3600)
    records, start = [], time.perf_counter()
    for _ in range(num_turns):
        question = [rng.randrange(300, vocab) for _ in range(question_len)]
        records.append(await _stream_one(client, model, doc + question, output_len))
    wall = time.perf_counter() - start
    await client.aclose()
    first, later = records[0]["ttft"], [r["ttft"] for r in records[1:]]
    later_p50 = _pct(later, 50)
    return {**_results(records, wall),
            "turns": [{"ttft_s": r["ttft"], "cached_tokens": r["cached_tokens"]} for r in records],
            "ttft_first_turn_s": first, "ttft_later_turns_p50_s": later_p50,
            "later_over_first": later_p50 / first if first and later_p50 is not None else None}


_CLIENT = None


def client_load(url: str, model: str, args, **kw) -> dict:
    """``run`` in a client process of its own (spawned once, then reused), keywords left out read from ``args``:
    the load generator must not share the server's interpreter (and its GIL) any more than a real client does
    (measured in-process on the H100, the client's event loop added ~300 ms to the ITL p99 of mix_1k_64)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    global _CLIENT
    for name in ("num_prompts", "input_len", "output_len", "concurrency", "request_rate", "vocab", "seed"):
        if kw.get(name) is None:
            kw[name] = getattr(args, name)
    if _CLIENT is None:
        _CLIENT = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
    return _CLIENT.submit(_run_sync, url, model, kw).result()


def _run_sync(url: str, model: str, kw: dict) -> dict:
    return asyncio.run(run(url, model, None, **kw))


def client_turns(url: str, model: str, **kw) -> dict:
    """``turns`` in the client process (``client_load``'s)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    global _CLIENT
    if _CLIENT is None:
        _CLIENT = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
    return _CLIENT.submit(_turns_sync, url, model, kw).result()


def _turns_sync(url: str, model: str, kw: dict) -> dict:
    return asyncio.run(turns(url, model, **kw))


def close_client() -> None:
    global _CLIENT
    if _CLIENT is not None:
        _CLIENT.shutdown()
        _CLIENT = None


SERVER_MEANS = {"server_ttft_mean_s": "macattn_time_to_first_token_seconds",
                "server_itl_mean_s": "macattn_inter_token_latency_seconds",
                "server_e2e_mean_s": "macattn_e2e_request_latency_seconds"}
"""Per-request latencies as the server measured them (its histograms), reported per record beside the client's."""


SERVER_GAPS = "vllm:inter_token_latency_seconds"
"""The server's histogram of every gap between a sequence's tokens (vLLM v1's meaning), whose buckets give
``server_itl_quantiles_between``."""


def scrape_metrics(url: str) -> dict[str, float]:
    """The server's Prometheus series this benchmark reads (``/metrics``): the ``_sum`` / ``_count`` of the MAC hit
    rate and KV skip histograms (per-request ``RequestOutput.metrics``) and of ``SERVER_MEANS``' latency
    histograms, generated tokens, and ``SERVER_GAPS``' cumulative buckets (keys ``<name>_bucket:<le>``, summed over
    its labels), read with ``prometheus_client``'s parser."""
    from prometheus_client.parser import text_string_to_metric_families
    from run_clients import metrics_text

    hists = ("macattn_mac_hit_rate", "macattn_mac_kv_skip", *SERVER_MEANS.values())
    keys = {f"{h}_{part}" for h in hists for part in ("sum", "count")} | {"macattn_generated_tokens_total"}
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics_text(url)):
        for sample in family.samples:
            if sample.name in keys:
                out[sample.name] = float(sample.value)
            elif sample.name == f"{SERVER_GAPS}_bucket":
                key = f"{sample.name}:{sample.labels['le']}"
                out[key] = out.get(key, 0.0) + float(sample.value)
    return out


def server_itl_quantiles_between(before: dict, after: dict, qs=(50, 90, 99)) -> dict:
    """Quantiles (s) of the token gaps the server observed between two scrapes, from ``SERVER_GAPS``' buckets as
    Prometheus's ``histogram_quantile`` estimates them (linear within the bucket holding the rank; a rank in the
    ``+Inf`` bucket reads the largest finite bound): ``{"n": gaps, "p50": ..., ...}``; ``{}`` without gaps."""
    prefix = f"{SERVER_GAPS}_bucket:"
    bounds = sorted((float(k[len(prefix):]), k) for k in after if k.startswith(prefix))
    cum = [(le, after[k] - before.get(k, 0.0)) for le, k in bounds]
    total = cum[-1][1] if cum else 0.0
    if total <= 0:
        return {}
    finite = max((le for le, _ in cum if le != float("inf")), default=0.0)
    out = {"n": int(total)}
    for q in qs:
        rank, lo, below = q / 100 * total, 0.0, 0.0
        for le, c in cum:
            if c >= rank:
                out[f"p{q}"] = finite if le == float("inf") else lo + (le - lo) * (rank - below) / max(c - below, 1e-300)
                break
            lo, below = le, c
    return out


def _mean_between(before: dict, after: dict, name: str) -> tuple[float | None, int]:
    """Mean of histogram ``name`` over the observations between two scrapes, and their count."""
    n = after.get(f"{name}_count", 0.0) - before.get(f"{name}_count", 0.0)
    return ((after.get(f"{name}_sum", 0.0) - before.get(f"{name}_sum", 0.0)) / n if n > 0 else None), int(n)


def hit_rate_between(before: dict, after: dict) -> dict:
    """Mean per-request MAC hit rate and KV skip of the requests that finished between two scrapes."""
    hit, n = _mean_between(before, after, "macattn_mac_hit_rate")
    skip, _ = _mean_between(before, after, "macattn_mac_kv_skip")
    return {"measured_hit_rate": hit, "measured_kv_skip": skip, "requests_with_mac_metrics": n}


def server_means_between(before: dict, after: dict) -> dict:
    """``SERVER_MEANS`` over the requests that finished between two scrapes (None where none did): what the
    server measured, so a client's own overhead shows as the difference from the client's figures."""
    return {key: _mean_between(before, after, name)[0] for key, name in SERVER_MEANS.items()}


# --- workloads ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Workload:
    """One named load: ``num_prompts`` requests of ``input_len`` prompt tokens and ``output_len`` output
    tokens, ``concurrency`` in flight, served by an engine of ``max_seq_len`` (None: the model's) and
    ``concurrency`` slots. ``kind``: ``"ttft"`` (sequential single requests), ``"throughput"`` or ``"multiturn"``
    (``turns``: a document of ``input_len`` tokens asked ``num_prompts`` questions of ``question_len`` tokens,
    one at a time, with prefix caching on and off). ``patterns``: MAC hit patterns run with MAC on; ``ab``:
    ``--mac-ab`` adds a MAC-off record. ``mac_window``: MAC's window for this workload (None: MAC's default; the
    dry run's documents are shorter than the default window, which a cache hit leaves to compute)."""

    name: str
    num_prompts: int
    input_len: int
    output_len: int
    concurrency: int
    max_seq_len: int | None
    kind: str = "throughput"
    patterns: tuple[str, ...] = ("model",)
    ab: bool = False
    max_batch_size: int | None = None      # None: concurrency
    question_len: int = 0
    mac_window: int | None = None

    @property
    def slots(self) -> int:
        return self.max_batch_size or self.concurrency

    @property
    def prefill_mix(self) -> tuple[int, int]:
        """(prompts prefilled together, tokens each): the mix whose floor the TTFT is compared with."""
        if self.kind == "multiturn":                   # the first turn: the whole document and a question
            return 1, self.input_len + self.question_len
        return (1 if self.kind == "ttft" else min(self.concurrency, self.num_prompts)), self.input_len

    @property
    def decode_point(self) -> tuple[int, int] | None:
        """(batch, context) of the decode floor, None when no decode step runs."""
        if self.kind != "throughput" or self.output_len <= 1:
            return None
        return min(self.concurrency, self.num_prompts), self.input_len


_LONG_SEQ = 32768 + 1024 + 64          # both long workloads share one engine shape (one server for both)
WORKLOADS: dict[str, Workload] = {w.name: w for w in (
    Workload("ttft_1k", 1, 1024, 1, 1, 1024 + 64, kind="ttft"),
    Workload("ttft_32k", 1, 32768, 1, 1, 32768 + 64, kind="ttft"),
    Workload("mix_1k_64", 64, 1024, 64, 16, 1024 + 64 + 64),
    Workload("long_4x32k_128", 4, 32768, 128, 4, _LONG_SEQ),
    Workload("long_4x32k_1024", 4, 32768, 1024, 4, _LONG_SEQ, patterns=("model", "seeded90", "seeded100"), ab=True),
    Workload("multiturn_32k", 4, 32768, 16, 1, 32768 + 128 + 16, kind="multiturn", question_len=100),
)}
# --dry-run: the same workloads with a few tokens (the CPU, the built-in model)
_DRY = {"ttft_1k": dict(input_len=24, max_seq_len=64), "ttft_32k": dict(input_len=96, max_seq_len=160),
        "mix_1k_64": dict(num_prompts=6, input_len=16, output_len=4, concurrency=3, max_seq_len=48),
        "long_4x32k_128": dict(num_prompts=2, input_len=64, output_len=3, concurrency=2, max_seq_len=96),
        "long_4x32k_1024": dict(num_prompts=2, input_len=64, output_len=6, concurrency=2, max_seq_len=96),
        "multiturn_32k": dict(num_prompts=3, input_len=96, question_len=8, output_len=3, max_seq_len=128,
                              mac_window=16)}


def resolve_workloads(args) -> list[Workload]:
    """The workloads of this run: ``--workload`` names (scaled down under ``--dry-run``; TTFT ones repeated
    ``--ttft-reps`` times), all of them on CUDA by default, else one ``custom`` run of the CLI's sizes."""
    names = args.workload or (list(WORKLOADS) if args.device.startswith("cuda") and not args.dry_run else [])
    out = []
    for n in names:
        w = WORKLOADS[n]
        if args.dry_run:
            w = replace(w, **_DRY[n])
        if w.kind == "ttft":
            w = replace(w, num_prompts=args.ttft_reps)
        if args.hit_patterns and w.name == "long_4x32k_1024":
            w = replace(w, patterns=tuple(args.hit_patterns))
        out.append(w)
    if not out:
        seq = args.input_len + args.output_len + 16 if args.model == RANDOM_8B else None
        out.append(Workload("custom", args.num_prompts, args.input_len, args.output_len, args.concurrency, seq,
                            max_batch_size=args.max_batch_size or 8))
    return out


def variants(w: Workload, args) -> list[tuple[str, str | None, bool | None]]:
    """``(mac "on"/"off", hit pattern or None, prefix caching: True / False, None = the engine's default)`` per
    record of ``w``: a multi-turn workload runs each MAC variant with the cache on, then off."""
    v = [("off", None)] if args.no_mac else [("on", p) for p in w.patterns]
    if not args.no_mac and args.mac_ab and w.ab:
        v.append(("off", None))
    caching = (True, False) if w.kind == "multiturn" else (None,)
    return [(mac, p, c) for mac, p in v for c in caching]


# --- seeded hit patterns (benchmark only) ---------------------------------------------------------
HIT_PATTERNS = {"model": None, "seeded90": 0.9, "seeded100": 1.0}


class SeededHitMac(MacAttention):
    """MAC whose match query is a constant for a fixed, seeded fraction ``hit_fraction`` of the (layer,
    query-head) pairs (benchmark only; registered by ``seeded_mac_class``, never by the package).

    For a seeded pair, ``match_query`` returns the pair's constant vector ``[d]`` (in place of the real
    pre-RoPE query), so the ring of that head holds the same vector at every position and each decode step
    matches it at distance 0: a hit whenever the matched entry lies at ``p >= band`` (every ring entry of a
    prompt of ``>= window + band`` tokens). Other pairs match their real query (the calibrated scale, if any,
    applied as ``MacAttention`` does). The mask ``seeded_heads [L, Hq]`` bool and the constants
    ``seeded_query [L, Hq, d]`` (the query dtype) are made on the model's device here, so the per-step op is a
    ``torch.where`` a CUDA graph captures (no host work, no allocation at equal dtypes)."""

    name: ClassVar[str] = "bench_mac_seeded"
    hit_fraction: ClassVar[float] = 1.0
    pattern_seed: ClassVar[int] = 0

    @classmethod
    def default_config(cls) -> MacConfig:
        """MAC on with its defaults (``MacConfig()``): the engine's config when none is given (a method
        other than ``"mac"`` takes no ``mac=`` through ``LLM``)."""
        return MacConfig()

    def __init__(self, config, dims, *, num_slots: int, query_dtype: torch.dtype | None = None) -> None:
        super().__init__(config, dims, num_slots=num_slots, query_dtype=query_dtype)
        L, H, d = dims.num_layers, dims.num_q_heads, dims.head_dim
        g = torch.Generator().manual_seed(self.pattern_seed)
        flat = torch.zeros(L * H, dtype=torch.bool)
        flat[torch.randperm(L * H, generator=g)[: round(self.hit_fraction * L * H)]] = True
        self.seeded_heads = flat.view(L, H).to(dims.device)                                   # [L, Hq] bool
        self.seeded_query = torch.randn(L, H, d, generator=g).to(dims.device, query_dtype or dims.dtype)   # [L, Hq, d]
        # per layer: (mask, constant) shaped for [B, Hq, d] and for [B, Hq, T, d] queries (views, made once)
        self._where = [(self.seeded_heads[i].view(1, H, 1), self.seeded_query[i].view(1, H, d),
                        self.seeded_heads[i].view(1, H, 1, 1), self.seeded_query[i].view(1, H, 1, d))
                       for i in range(L)]

    def match_query(self, layer: int, q_pre: torch.Tensor) -> torch.Tensor:
        """``q_pre`` ``[B, Hq, d]`` or ``[B, Hq, T, d]`` -> the same shape and dtype, seeded heads replaced."""
        q = super().match_query(layer, q_pre)
        m3, c3, m4, c4 = self._where[layer]
        mask, const = (m4, c4) if q.dim() == 4 else (m3, c3)
        return torch.where(mask, const.to(q.dtype), q)


def seeded_mac_class(fraction: float, seed: int = 0) -> type[SeededHitMac]:
    """The ``SeededHitMac`` subclass of ``fraction``, registered (``macattn.methods.registry.register``) as
    ``bench_mac_seeded<100 fraction>`` in this process; the same class on every call."""
    from macattn.methods.registry import METHODS, register

    name = f"bench_mac_seeded{round(fraction * 100)}"
    have = METHODS.get(name)
    if have is not None and (getattr(have, "hit_fraction", None), getattr(have, "pattern_seed", None)) \
            == (fraction, seed):
        return have
    cls = type(f"SeededHitMac{round(fraction * 100)}", (SeededHitMac,),
               {"name": name, "hit_fraction": fraction, "pattern_seed": seed, "__module__": __name__,
                "__doc__": f"SeededHitMac with hit_fraction={fraction}, pattern_seed={seed} (benchmark only)."})
    return register(cls)


def method_for(mac: str, pattern: str | None) -> tuple[str, str | None]:
    """``LLM(method=..., mac=...)`` of a variant: MAC off, MAC's defaults, or a seeded pattern."""
    if mac == "off":
        return "mac", "off"
    frac = HIT_PATTERNS[pattern or "model"]
    return ("mac", None) if frac is None else (seeded_mac_class(frac).name, None)


# --- model, engine, server ------------------------------------------------------------------------
def _random_8b(device: str, words: tuple[str, ...] = (), id_range: tuple[int, int] = (300, 8000)):
    """LLaMA-3.1-8B shapes with random bf16 weights (``bench_e2e``'s) and a synthetic tokenizer that maps
    id ``i`` to the word ``w<i>`` (the prompts are token ids; only the streamed text needs a decoder). Its
    end token ``<eos>`` has the id ``vocab_size``, which the model never produces: every request runs to
    ``max_tokens``. ``words`` (a text client's words, ``guidellm_words``) take distinct ids of ``id_range``
    (seeded, in place of those ids' ``w<i>``), so a client that sends text sends varied ids, not one unknown id
    per word, and the tokenizer saved for it (one string per id) reads the same ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from bench_e2e import LLAMA_8B, build_model

    model = build_model(LLAMA_8B, torch.bfloat16, device)
    names = [f"w{i}" for i in range(LLAMA_8B["vocab_size"])]
    words = sorted(set(words) - set(names))
    lo, hi = id_range
    if len(words) > hi - lo:
        raise ValueError(f"{len(words)} words do not fit the {hi - lo} ids of id_range {id_range}")
    for w, i in zip(words, random.Random(0).sample(range(lo, hi), len(words))):
        names[i] = w
    vocab = {name: i for i, name in enumerate(names)}
    vocab["<eos>"] = LLAMA_8B["vocab_size"]
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return model, PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="w0")


def load_model(name: str, device: str, words: tuple[str, ...] = ()):
    """``(model on device, tokenizer)`` for ``builtin``, ``llama8b-random`` (``words``: see ``_random_8b``) or a
    transformers directory."""
    if name == RANDOM_8B:
        return _random_8b(device, words)
    from bench_prefill_floor import load_model as _load

    model, tok = _load(name, torch.device(device), torch.float32 if name == "builtin" else "auto")
    return model, tok


def engine_options(args) -> tuple[dict, dict]:
    """``LLM`` keyword arguments beyond the defaults, and what the JSON says about them: each engine option
    of the CLI (``--max-num-batched-tokens``, ``--prefill-chunk``, ``--async-scheduling``, ``--mac-min-context``)
    is passed only when given and only when this version's ``LLM.__init__`` takes it (the token budget is newer
    than the prefill chunk, which it replaces); one given but not taken is reported and warned about, not passed.
    ``Server`` drops ``mac_min_context`` for MAC off and for a seeded pattern's method."""
    from macattn.apps.llm import LLM

    params = set(inspect.signature(LLM.__init__).parameters)
    try:                                  # an LLM built through EngineArgs takes every one of its fields
        from dataclasses import fields

        from macattn.runtime.engine_args import EngineArgs

        params |= {f.name for f in fields(EngineArgs)}
    except ImportError:
        pass
    kw, info = {}, {}
    for name in ("max_num_batched_tokens", "prefill_chunk", "async_scheduling", "mac_min_context"):
        value = getattr(args, name)
        info[name] = value
        info[f"llm_takes_{name}"] = name in params
        if value is None:
            continue
        info[f"{name}_applied"] = name in params
        if name in params:
            kw[name] = value
        else:
            note = (f"--{name.replace('_', '-')} was given but this version's LLM.__init__ has no {name}: not "
                    "passed (the engine's own default ran)")
            info.setdefault("notes", []).append(note)
            print(f"warning: {note}", file=sys.stderr)
    return kw, info


def guidellm_words(exe: str) -> tuple[str, ...]:
    """The words guidellm's synthetic prompts are made of (Faker's English lorem list, read from the Python beside
    ``exe``, as written in a sentence: lower case, capitalised, with a full stop), so ``llama8b-random``'s word
    tokenizer reads them as varied ids."""
    python = Path(exe).parent / "python"
    code = "import json; from faker.providers.lorem.en_US import Provider; print(json.dumps(list(Provider.word_list)))"
    listed = json.loads(subprocess.run([str(python) if python.exists() else sys.executable, "-c", code],
                                       capture_output=True, text=True, check=True).stdout)
    base = {w.strip() for w in listed if w.strip()}
    return tuple(sorted({v for w in base for v in (w, w.capitalize(), w + ".", w.capitalize() + ".")}))


def run_guidellm_beside(exe: str, server: "Server", tok, w: Workload, out_dir: Path, timeout: float) -> dict:
    """guidellm (``run_clients.run_guidellm``) against the server that just served workload ``w``: the same
    requests, prompt and output lengths at ``w.concurrency`` concurrent streams, ``/v1/completions`` (what this
    benchmark's own client sends), its prompts counted by the server's own tokenizer (saved for it here)."""
    from run_clients import run_guidellm

    out_dir.mkdir(parents=True, exist_ok=True)
    tok_dir = out_dir / "tokenizer"
    tok.save_pretrained(tok_dir)
    res = run_guidellm(exe, server, out_dir, requests=w.num_prompts, prompt_tokens=w.input_len,
                       output_tokens=w.output_len, timeout=timeout, tokenizer=tok_dir,
                       profile=f"kind=concurrent,streams={w.concurrency}",
                       formats=((f"{w.name}_completions", "/v1/completions"),))
    return next(iter(res.values()))


def warmup_load(w: Workload) -> dict:
    """The untimed warm-up before a record: ``num_prompts`` / ``output_len`` / ``concurrency`` of a first wave of
    the workload (one short request for a TTFT or multi-turn workload). Lazy first-call costs — kernel and plan
    builds of the shapes only a loaded step meets — are paid once per process, so without the wave the first record
    of a process paid them in its timed load (an A/B's first variant measured slower:
    ``benchmarks/notes/serving.md``)."""
    if w.kind != "throughput":
        return dict(num_prompts=1, output_len=2, concurrency=1)
    return dict(num_prompts=w.concurrency, output_len=min(w.output_len, 8), concurrency=w.concurrency)


def prewarm_graphs(llm) -> dict:
    """What the server's engine captured before the first request (``EngineArgs.build_engine`` captures every decode
    bucket's greedy step and every prefill bucket's pieces at start-up; ``ModelExecutor.prewarm_graphs`` captures
    only what is missing and returns the sizes), so the JSON records that no timed request paid a capture."""
    try:
        return {"captured": llm.engine.executor.prewarm_graphs()}
    except Exception as exc:                                   # noqa: BLE001 - recorded; the first requests capture
        return {"captured": {}, "error": f"{type(exc).__name__}: {exc}"}


class Server:
    """An ``LLM`` on the shared model and its OpenAI server on a free local port (uvicorn in a thread)."""

    def __init__(self, model, tok, args, w: Workload, method: str, mac: str | None, llm_kw: dict,
                 prefix_caching: bool | None = None) -> None:
        import uvicorn

        from macattn.apps.llm import LLM
        from macattn.apps.serving.openai_server import build_app

        self.key = server_key(w, method, mac, prefix_caching)
        t0 = time.perf_counter()
        if prefix_caching is not None:
            llm_kw = {**llm_kw, "enable_prefix_caching": prefix_caching}
        if w.mac_window is not None and mac != "off":
            llm_kw = {**llm_kw, "mac_window": w.mac_window}
        if mac == "off" or method != "mac":     # MAC's flag: neither MAC off nor a seeded pattern's class takes it
            llm_kw = {k: v for k, v in llm_kw.items() if k != "mac_min_context"}
        self.llm = LLM(model, tokenizer=tok, method=method, mac=mac, device=args.device, max_batch_size=w.slots,
                       max_seq_len=w.max_seq_len, **llm_kw)
        self.server = self.thread = None
        try:
            self.prewarm = prewarm_graphs(self.llm)
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            self.server = uvicorn.Server(uvicorn.Config(build_app(self.llm, args.model), host="127.0.0.1",
                                                        port=port, log_level="warning"))
            self.thread = threading.Thread(target=self.server.run, daemon=True)
            self.thread.start()
            while not self.server.started:
                if not self.thread.is_alive():
                    raise RuntimeError("the uvicorn server thread ended before it started")
                time.sleep(0.05)
        except BaseException:
            self.stop()                       # the engine (and the model's binding) go with a failed start
            raise
        self.url = f"http://127.0.0.1:{port}"
        self.start_s = time.perf_counter() - t0

    def info(self) -> dict:
        return {"method": self.key[2], "mac": self.key[3] or "on", "max_batch_size": self.key[0],
                "max_seq_len": self.llm.engine.config.max_seq_len, "start_s": self.start_s,
                "prefix_caching": getattr(self.llm.engine, "prefix_caching", False), "graph_prewarm": self.prewarm,
                "mac_min_context": getattr(getattr(self.llm.engine, "mac_config", None), "min_context", None)}

    def stop(self) -> None:
        """Stop the server (``should_exit``, thread joined), the engine loop (``llm.shutdown()``), unbind the
        shared model and free the engine's memory."""
        from macattn.models.attention import is_patched, unbind

        if self.server is not None:
            self.server.should_exit = True
        if self.thread is not None:
            self.thread.join(timeout=60)
        self.llm.shutdown()
        self.llm.engine.close()
        model = self.llm.engine.executor.model
        if is_patched(model):
            unbind(model)
        del self.llm, self.server
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def prompt_seed(seed: int, w: Workload) -> int:
    """The seed of workload ``w``'s prompts: ``--seed`` offset by the workload's name, so two workloads never send
    the same prompts. A server kept from one workload to the next (same engine shape) would otherwise serve the
    second one's prompts from the first one's prefix cache (measured: 4 x (32K -> 1024) after 4 x (32K -> 128)
    had a TTFT p50 of 0.67 s against 4.76 s on a fresh server)."""
    return seed + zlib.crc32(w.name.encode()) % 1_000_003


def server_key(w: Workload, method: str, mac: str | None, prefix_caching: bool | None = None) -> tuple:
    return (w.slots, w.max_seq_len, method, mac, prefix_caching, w.mac_window)


# --- the floor beside each record -----------------------------------------------------------------
def floor_for(w: Workload, floor: dict | None) -> dict:
    """The floor of workload ``w`` from ``measure_floor``'s report: its prefill mix's floor and, for a
    throughput workload, floor tok/s = output tokens / (prefill floor of all prompts + decode steps x the
    decode floor step)."""
    from bench_prefill_floor import mix_name

    if floor is None:
        return {"note": "no floor measured"}
    n, length = w.prefill_mix
    mix = mix_name(n, length)
    pf = floor["prefill"].get(mix, {}).get("floor_ms")
    out = {"prefill_mix": mix, "prefill_floor_ms": pf}
    point = w.decode_point
    if point is None:
        return out
    key = f"{point[0]}x{point[1]}"
    step = floor["decode"].get(key, {}).get("step_ms")
    waves = math.ceil(w.num_prompts / n)
    steps = waves * (w.output_len - 1)
    out.update(decode_point=key, decode_floor_step_ms=step, decode_steps=steps, waves=waves)
    if pf is not None and step is not None:
        prefill_all = pf * w.num_prompts / n
        total = prefill_all + steps * step
        out.update(prefill_all_ms=prefill_all, decode_all_ms=steps * step, floor_total_ms=total,
                   floor_output_tok_per_s=w.num_prompts * w.output_len / (total * 1e-3))
    return out


def ratios(res: dict, fl: dict) -> dict:
    """TTFT p50 / prefill floor, TTFT p99 / prefill floor, output tok/s / floor tok/s (None where a side is missing)."""
    pf = fl.get("prefill_floor_ms")
    t50, t99 = res["ttft_s"]["p50"], res["ttft_s"]["p99"]
    ftok = fl.get("floor_output_tok_per_s")
    return {"ttft_p50_over_prefill_floor": t50 * 1e3 / pf if pf and t50 is not None else None,
            "ttft_p99_over_prefill_floor": t99 * 1e3 / pf if pf and t99 is not None else None,
            "output_tok_per_s_over_floor": res["output_token_throughput_per_s"] / ftok if ftok else None}


# --- report ---------------------------------------------------------------------------------------
def _ms(v) -> str:
    return f"{v * 1e3:.1f}" if isinstance(v, (int, float)) else "-"


def _f(v, spec=".2f") -> str:
    return format(v, spec) if isinstance(v, (int, float)) else "-"


def print_summary(res: dict, server: dict | None = None, gaps: dict | None = None) -> None:
    """Today's per-run lines: TTFT / ITL / e2e p50, p99, mean (and the server's own means, ``server_means_between``,
    and its token gaps' quantiles, ``server_itl_quantiles_between``, where given); requests and output tok/s."""
    print(f"{'metric':<26} {'p50':>10} {'p99':>10} {'mean':>10} {'server mean':>12}")
    for key, skey in (("ttft_s", "server_ttft_mean_s"), ("itl_s", "server_itl_mean_s"), ("e2e_s", "server_e2e_mean_s")):
        s, sv = res[key], (server or {}).get(skey)
        print(f"{key:<26} " + " ".join(f"{(v * 1e3 if v is not None else float('nan')):>8.1f}ms"
                                      for v in (s["p50"], s["p99"], s["mean"], sv)))
    if gaps:
        print(f"server token gaps (from /metrics buckets, {gaps['n']}): " + ", ".join(
            f"{k} ~{v * 1e3:.1f} ms" for k, v in gaps.items() if k != "n"))
    print(f"requests {res['requests']} in {res['duration_s']:.1f} s: {res['request_throughput_per_s']:.2f} req/s, "
          f"{res['output_token_throughput_per_s']:.1f} output tok/s")


def format_turns(records: list[dict]) -> str:
    """The multi-turn records: TTFT and cached prompt tokens per turn, later turns' TTFT p50 / the first's."""
    lines = []
    for r in records:
        res = r.get("results") or {}
        if "turns" not in res:
            continue
        per = " ".join(f"{_ms(t['ttft_s'])}ms/{t['cached_tokens']}" for t in res["turns"])
        lines.append(f"{r['workload']:<16} {r['variant']:<36} TTFT/cached per turn: {per}; later / first "
                     f"{_f(res['later_over_first'], '.3f')}")
    return "\n".join(lines)


def format_records(records: list[dict]) -> str:
    """Every record beside its floor."""
    head = (f"{'workload':<16} {'variant':<18} {'TTFT p50':>9} {'p99':>8} {'floor':>8} {'x floor':>7} "
            f"{'output tok/s':>12} {'floor tok/s':>11} {'of floor':>8} {'ITL p50':>8} {'ITL p99':>8} {'hit':>6}")
    lines = ["times in ms; 'x floor' = TTFT p50 / prefill floor of the mix, 'of floor' = output tok/s / floor tok/s",
             head]
    for r in records:
        if "results" not in r:
            lines.append(f"{r['workload']:<16} {r['variant']:<18} error: {r.get('error', '?')[:90]}")
            continue
        res, fl, ra = r["results"], r["floor"], r["ratios"]
        tok = res["output_token_throughput_per_s"] if r["kind"] == "throughput" else None
        lines.append(f"{r['workload']:<16} {r['variant']:<18} {_ms(res['ttft_s']['p50']):>9} "
                     f"{_ms(res['ttft_s']['p99']):>8} "
                     f"{_f(fl.get('prefill_floor_ms'), '.1f'):>8} {_f(ra['ttft_p50_over_prefill_floor']):>7} "
                     f"{_f(tok, '.1f'):>12} {_f(fl.get('floor_output_tok_per_s'), '.1f'):>11} "
                     f"{_f(ra['output_tok_per_s_over_floor']):>8} {_ms(res['itl_s']['p50']):>8} "
                     f"{_ms(res['itl_s']['p99']):>8} {_f(r.get('measured_hit_rate'), '.3f'):>6}")
    return "\n".join(lines)


def _env(args) -> dict:
    from bench_prefill_floor import environment

    return environment(torch.device(args.device))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default=None, help="a running server (default: start one here on --model; no floor)")
    ap.add_argument("--model", default="builtin", help=f"'builtin', a model directory or '{RANDOM_8B}'")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--workload", action="append", choices=list(WORKLOADS), default=None,
                    help="a named workload (repeatable; default: all of them with --device cuda, else one run of "
                         "--num-prompts / --input-len / ...)")
    ap.add_argument("--no-mac", action="store_true", help="MAC off (LLM(mac='off')) in every workload")
    ap.add_argument("--mac-ab", action="store_true", help="long_4x32k_1024 also runs with MAC off")
    ap.add_argument("--hit-patterns", nargs="+", choices=list(HIT_PATTERNS), default=None,
                    help="long_4x32k_1024's MAC-on hit patterns (default: model seeded90 seeded100)")
    ap.add_argument("--ttft-reps", type=int, default=None,
                    help="sequential requests of a TTFT workload (default 3; dry 2)")
    ap.add_argument("--max-batch-size", type=int, default=None, help="slots of the custom run (default 8; a named "
                                                                     "workload has its concurrency)")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson arrivals per second")
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=8000, help="token ids are drawn from [300, vocab)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prefill-chunk", type=int, default=None,
                    help="LLM(prefill_chunk=...) of versions before the token budget; passed only when given and taken")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="LLM(max_num_batched_tokens=...), passed only when given and when this LLM takes it")
    ap.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                    help="LLM(async_scheduling=...): each step launched before the previous step's tokens are read "
                         "(default: the engine's, on for CUDA); passed only when given and taken")
    ap.add_argument("--mac-min-context", type=int, default=None,
                    help="LLM(mac_min_context=...): MAC engages from this context (default: the engine's, 8192 on "
                         "CUDA); passed only when given and taken, and only to MAC's default method")
    ap.add_argument("--no-floor", action="store_true", help="skip the floor measurement")
    ap.add_argument("--floor-reps", type=int, default=None, help="timed reps per floor figure (default 5; dry 2)")
    ap.add_argument("--no-warmup", action="store_true", help="no untimed warm-up request before each record")
    ap.add_argument("--guidellm", default=None, metavar="EXE",
                    help="also run guidellm (this command) against each throughput workload's server, same load")
    ap.add_argument("--guidellm-timeout", type=float, default=300, help="seconds per guidellm run")
    ap.add_argument("--out", default=None)
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args(argv)
    if args.dry_run:
        if not args.workload:
            args.num_prompts, args.concurrency, args.input_len, args.output_len = 4, 2, 16, 4
        args.device = "cpu"
    args.ttft_reps = args.ttft_reps or (2 if args.dry_run else 3)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device: use --device cpu or --dry-run", file=sys.stderr)
        return 2
    workloads = resolve_workloads(args)
    report = {"benchmark": "bench_serving", **_env(args), "model": args.model, "dry_run": args.dry_run,
              "args": vars(args), "workloads": [asdict(w) for w in workloads], "floor": None, "records": []}
    out = args.out
    if out is None and not args.dry_run:
        dev = report["device"]
        gpu = dev.split()[1].lower() if len(dev.split()) > 1 else "gpu"
        tag = "cpu" if not args.device.startswith("cuda") else gpu
        out = Path(__file__).parent / "results" / f"bench_serving_{tag}.json"

    def save() -> None:
        if out:
            Path(out).parent.mkdir(parents=True, exist_ok=True)
            Path(out).write_text(json.dumps(report, indent=2, default=str) + "\n")

    if args.url is not None:                              # an external server: no floor, no restarts
        report["floor_note"] = "an external server (--url): no floor measured, its own MAC setting"
        for w in workloads:
            rec = {"workload": w.name, "kind": w.kind, "variant": "external server", **asdict(w)}
            before = scrape_metrics(args.url)
            if w.kind == "multiturn":            # the server's own prefix-caching setting
                res = client_turns(args.url, args.model, doc_len=w.input_len, question_len=w.question_len,
                                   num_turns=w.num_prompts, output_len=w.output_len, vocab=args.vocab, seed=args.seed)
            else:
                res = client_load(args.url, args.model, args, num_prompts=w.num_prompts, input_len=w.input_len,
                                  output_len=w.output_len, concurrency=w.concurrency)
            after = scrape_metrics(args.url)
            rec.update(hit_rate_between(before, after), server_means=server_means_between(before, after),
                       server_itl_quantiles_s=server_itl_quantiles_between(before, after))
            rec.update(results=res, floor=floor_for(w, None), ratios=ratios(res, {}))
            report["records"].append(rec)
            print_summary(res, rec["server_means"], rec["server_itl_quantiles_s"])
            save()
        close_client()
        print(format_records(report["records"]))
        return 0

    llm_kw, report["engine_options"] = engine_options(args)
    t0 = time.perf_counter()
    words = ()
    if args.guidellm and args.model == RANDOM_8B:
        try:
            words = guidellm_words(args.guidellm)
        except (OSError, ValueError, subprocess.CalledProcessError) as exc:   # recorded; our own figures still run
            report["guidellm_error"] = f"guidellm's words not readable beside {args.guidellm}: {exc}"
            print(f"warning: {report['guidellm_error']}; guidellm skipped", file=sys.stderr, flush=True)
            args.guidellm = None
    model, tok = load_model(args.model, args.device, words)
    report["model_load_s"] = time.perf_counter() - t0
    args.vocab = min(args.vocab, model.config.vocab_size)
    if not args.no_floor:
        from bench_prefill_floor import FloorShapes, measure_floor

        mixes = sorted({w.prefill_mix for w in workloads})
        points = sorted({w.decode_point for w in workloads if w.decode_point is not None})
        t0 = time.perf_counter()
        report["floor"] = measure_floor(FloorShapes.of(model.config), mixes=mixes, decode_points=points, model=model,
                                        device=args.device, dtype=next(model.parameters()).dtype,
                                        reps=args.floor_reps or (2 if args.dry_run else 5),
                                        warmup=1 if args.dry_run else 2)
        report["floor_measure_s"] = time.perf_counter() - t0
        save()
    current: Server | None = None
    failed = 0
    try:
        for w in workloads:
            for mac, pattern, caching in variants(w, args):
                method, mac_arg = method_for(mac, pattern)
                variant = (f"mac={mac}" + (f",hits={pattern}" if mac == "on" else "")
                           + ("" if caching is None else f",prefix_cache={'on' if caching else 'off'}"))
                rec = {"workload": w.name, "kind": w.kind, "variant": variant, "mac": mac,
                       "hit_pattern": pattern if mac == "on" else None, "method": method,
                       "prefix_caching": caching, **asdict(w)}
                print(f"=== {w.name} {variant} ({w.num_prompts} x ({w.input_len} in, {w.output_len} out), "
                      f"{w.concurrency} in flight)", flush=True)
                try:
                    if current is None or current.key != server_key(w, method, mac_arg, caching):
                        if current is not None:
                            current.stop()
                            current = None
                        current = Server(model, tok, args, w, method, mac_arg, llm_kw, caching)
                    rec["server"] = current.info()
                    if not args.no_warmup:
                        t1 = time.perf_counter()
                        rec["warmup"] = warmup_load(w)
                        client_load(current.url, args.model, args, input_len=w.input_len, seed=args.seed + 1000,
                                    **rec["warmup"])
                        rec["warmup_s"] = time.perf_counter() - t1
                    before = scrape_metrics(current.url)
                    if w.kind == "multiturn":
                        res = client_turns(current.url, args.model, doc_len=w.input_len, question_len=w.question_len,
                                           num_turns=w.num_prompts, output_len=w.output_len, vocab=args.vocab,
                                           seed=args.seed)
                    else:
                        rec["prompt_seed"] = prompt_seed(args.seed, w)
                        res = client_load(current.url, args.model, args, num_prompts=w.num_prompts,
                                          input_len=w.input_len, output_len=w.output_len, concurrency=w.concurrency,
                                          seed=rec["prompt_seed"])
                    after = scrape_metrics(current.url)
                    rec.update(hit_rate_between(before, after), server_means=server_means_between(before, after),
                               server_itl_quantiles_s=server_itl_quantiles_between(before, after))
                    if args.guidellm and w.kind == "throughput":
                        gdir = Path(out or "guidellm_out").parent / f"guidellm_{w.name}"
                        try:
                            rec["guidellm"] = run_guidellm_beside(args.guidellm, current, tok, w, gdir,
                                                                  args.guidellm_timeout)
                            rec["guidellm"]["server_means"] = server_means_between(after, scrape_metrics(current.url))
                        except (OSError, ValueError, KeyError) as exc:     # recorded beside our own figures
                            rec["guidellm"] = {"error": f"{type(exc).__name__}: {exc}"}
                        print(f"guidellm: {json.dumps(rec['guidellm'], default=str)}", flush=True)
                    fl = floor_for(w, report["floor"])
                    rec.update(results=res, floor=fl, ratios=ratios(res, fl))
                    print_summary(res, rec["server_means"], rec["server_itl_quantiles_s"])
                    print(f"floor: prefill {fl.get('prefill_mix', '-')} {_f(fl.get('prefill_floor_ms'), '.1f')} ms "
                          f"(TTFT p50 x {_f(rec['ratios']['ttft_p50_over_prefill_floor'])}), floor output tok/s "
                          f"{_f(fl.get('floor_output_tok_per_s'), '.1f')} (measured / floor "
                          f"{_f(rec['ratios']['output_tok_per_s_over_floor'])}); MAC hit rate "
                          f"{_f(rec.get('measured_hit_rate'), '.3f')}", flush=True)
                except Exception as exc:                  # noqa: BLE001 - one record failing must not stop the rest
                    failed += 1
                    rec["error"] = f"{type(exc).__name__}: {exc}"
                    rec["trace"] = traceback.format_exc()[-3000:]
                    print(f"error: {rec['error']}", file=sys.stderr, flush=True)
                    if current is not None:
                        try:
                            current.stop()
                        finally:
                            current = None
                report["records"].append(rec)
                save()
    finally:
        close_client()
        if current is not None:
            current.stop()
    if report["floor"] is not None:
        from bench_prefill_floor import format_table

        print(format_table(report["floor"]))
    print(format_records(report["records"]))
    turns_table = format_turns(report["records"])
    if turns_table:
        print(turns_table)
    save()
    if out:
        print(f"wrote {out}")
    return 1 if failed and args.dry_run else 0


if __name__ == "__main__":
    sys.exit(main())
