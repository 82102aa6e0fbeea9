"""Retrieval-completion with the prefill KV offloaded to host memory (issue 20, item 6), LLaMA-3.1-8B attention
shapes (32 layers, 32 query / 8 KV heads, d = 128, bf16 K/V, F = 64 features), sink 16 / tail 64, pages of
``--page`` tokens, a ``--budget`` fraction of the mid region fetched per step (``ceil(budget·mid / page)`` pages
per KV head), B x context in ``--batches`` x ``--contexts``.

Per point, in one run:

  offload        ``OffloadedKV`` (``macattn.methods.completion.offload``): a decode step of all layers — append,
                 page selector, device LRU, page gather from pinned host memory (one kernel per tier and layer,
                 the SMs reading host memory), split-K exact attention + completion; prefetch of layer l+1 with
                 layer l's query on a copy stream (``--prefetch``)
  offload_nopf   the same without the prefetch
  topk_only      the same budget without the completion (softmax over the exact set; no log φ_k pages)
  full_offload   full attention over offloaded KV: every page of every layer copied host -> GPU each step
                 (one pinned ``cudaMemcpyAsync`` per request, tier and layer on a copy stream, double-buffered
                 against SDPA of the previous layer)
  per layer (KV on the GPU): the GPU-resident page op ``macattn::page_retrieval_completion``, the exhaustive op
                 ``macattn::retrieval_completion`` (same token budget), FlashInfer's full decode (as in
                 ``bench_completion_decode.py``) where it fits

Every step is one CUDA graph replay (all 32 layers; the copy stream's work is captured too), timed with CUDA
events; between replays the queries change (``q_t = ρ q_{t-1} + sqrt(1-ρ²) ε``, ``--q-corr``) and the position
advances, outside the timed region, so hot-page hits are those of a drifting decode query. Keys are drawn per
page around a page mean, so page bounds discriminate. The B requests share one prompt's host pages (one pinned
allocation expanded over the slots: 4 x 128K of host pages would not fit host memory twice over); every request
still selects and fetches its own pages. Figures are attention-only (no projections / MLP): per-step latency,
tokens/s (``B / step``), bytes fetched per step (misses + prefetches, K + V + log φ_k pages), hot-page hit rate,
device bytes per request vs its full KV. Check: the offloaded step of one layer vs the GPU-resident page op on
the same data.

Usage: python benchmarks/bench_offload.py [--out benchmarks/results/bench_offload_h100.json]
       python benchmarks/bench_offload.py --dry-run       (CPU, tiny shapes: the same code, fp64 checks)
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

import macattn.methods.completion.ops  # noqa: E402,F401
from macattn.methods.completion.config import CompletionConfig  # noqa: E402
from macattn.methods.completion.offload import OffloadConfig, OffloadedKV, offload_bytes, pinned_zeros  # noqa: E402
from macattn.methods.completion.reference import page_retrieval_completion_step, partition  # noqa: E402

N_SINK, N_TAIL = 16, 64


def log(msg: str) -> None:
    print(msg, flush=True)


class Shapes:
    def __init__(self, dry: bool):
        if dry:
            self.L, self.HQ, self.HKV, self.D, self.F = 2, 4, 2, 16, 8
        else:
            self.L, self.HQ, self.HKV, self.D, self.F = 32, 32, 8, 128, 64


def layer_data(sh: Shapes, T: int, page: int, seed: int, dev, dtype):
    """One layer's prompt: keys around a per-page mean (bounds discriminate), values, log φ_k [Hkv, T, F]."""
    g = torch.Generator(device=dev).manual_seed(seed)
    P = -(-T // page)
    mean = torch.randn(sh.HKV, P, 1, sh.D, generator=g, device=dev) * 1.5
    k = (mean + torch.randn(sh.HKV, P, page, sh.D, generator=g, device=dev)).flatten(1, 2)[:, :T].to(dtype)
    v = torch.randn(sh.HKV, T, sh.D, generator=g, device=dev).to(dtype)
    lpk = torch.randn(sh.HKV, T, sh.F, generator=g, device=dev) * 0.5
    return k, v, lpk


def build(sh, cfg, off, B, T, dev, dtype, host, *, completion=True, write_host=True):
    """An ``OffloadedKV`` of B slots holding the same prompt of T tokens over the shared ``host`` pages
    (written through slot 0 when ``write_host``)."""
    st = OffloadedKV.allocate(cfg, off, num_layers=sh.L, num_slots=B, num_kv_heads=sh.HKV, head_dim=sh.D,
                              feature_dim=sh.F, dtype=dtype, device=dev, completion=completion, host=host)
    for s in range(B):
        st.acquire()
    for layer in range(sh.L):
        k, v, lpk = layer_data(sh, T, cfg.page_size, layer, dev, dtype)
        comp = torch.ops.macattn.completion_cache(lpk[None], v[None], torch.tensor([T], device=dev), N_SINK, N_TAIL)
        comp = tuple(c[0] for c in comp)
        for s in range(B):
            st.admit_layer(layer, s, k, v, lpk, comp, write_host=write_host and s == 0)
    return st


def step_inputs(sh, B, T, dev, dtype, gen, q_prev=None, rho=0.9):
    q = torch.randn(B, sh.HQ, sh.D, generator=gen, device=dev)
    if q_prev is not None:
        q = rho * q_prev.float() + math.sqrt(1 - rho * rho) * q
    lpq = torch.randn(B, sh.HQ, sh.F, generator=gen, device=dev) * 0.5 - 1.0
    kn = torch.randn(B, sh.HKV, sh.D, generator=gen, device=dev).to(dtype)
    vn = torch.randn(B, sh.HKV, sh.D, generator=gen, device=dev).to(dtype)
    return q.to(dtype), lpq, kn, vn


def offload_step(st, sh, static):
    """One decode step of every layer (the captured body): append the token, fetch, attend."""
    slots, pos = static["slots"], static["pos"]
    lens, npf = pos + 1, static["npf"]
    outs = []
    for layer in range(sh.L):
        st.append(layer, slots, pos, static["kn"], static["vn"])
        outs.append(st.decode(layer, static["q"], static["lpq"], lens, npf, 1.0 / math.sqrt(sh.D)))
    return outs


def time_offload(st, sh, B, T, dev, dtype, steps, rho, dry):
    """Per-step µs of ``offload_step`` (graph replays on CUDA, wall clock on the CPU) with drifting queries;
    hit rate and pages fetched over the timed steps."""
    gen = torch.Generator(device=dev).manual_seed(7)
    q, lpq, kn, vn = step_inputs(sh, B, T, dev, dtype, gen)
    static = dict(slots=torch.arange(B, device=dev), pos=torch.full((B,), T, device=dev, dtype=torch.int64),
                  npf=torch.full((B,), T, device=dev, dtype=torch.int64), q=q, lpq=lpq, kn=kn, vn=vn)

    def advance(i):
        nonlocal q
        q, lpq_, kn_, vn_ = step_inputs(sh, B, T, dev, dtype, gen, q, rho)
        for name, x in (("q", q), ("lpq", lpq_), ("kn", kn_), ("vn", vn_)):
            static[name].copy_(x)
        static["pos"].fill_(T + i)

    cuda = dev.type == "cuda"
    warm = 2
    for i in range(warm):                      # eager steps: compile the kernels, fill the cache
        advance(i)
        offload_step(st, sh, static)
    graph = None
    if cuda:
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            offload_step(st, sh, static)
    h0, m0, p0 = st.hits.sum().item(), st.misses.sum().item(), st.prefetched.sum().item()
    times = []
    for i in range(steps):
        advance(warm + i)
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            graph.replay()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1e3)
        else:
            t0 = time.perf_counter()
            offload_step(st, sh, static)
            times.append((time.perf_counter() - t0) * 1e6)
    h, m, p = st.hits.sum().item() - h0, st.misses.sum().item() - m0, st.prefetched.sum().item() - p0
    page_bytes = st.page_size * (2 * sh.D * torch.tensor([], dtype=dtype).element_size() + (sh.F * 4 if st.completion else 0))
    return dict(step_us=statistics.median(times), tokens_per_s=B / (statistics.median(times) * 1e-6),
                hit_rate=h / max(1, h + m), pages_fetched_per_step=(m + p) / steps,
                bytes_fetched_per_step=(m + p) * page_bytes / steps, prefetched_per_step=p / steps,
                graph=cuda)


def time_full_offload(host_k, host_v, sh, B, T, dev, dtype, reps, dry):
    """Full attention over offloaded KV: every layer's K and V copied host -> GPU each step (double-buffered on
    a copy stream), SDPA over it. µs per step (graph replays on CUDA)."""
    P_tok = host_k.shape[3] * host_k.shape[4]
    buf = [[torch.empty(B, sh.HKV, P_tok, sh.D, dtype=dtype, device=dev) for _ in range(2)] for _ in range(2)]
    q = torch.randn(B, sh.HQ, 1, sh.D, device=dev).to(dtype)
    cuda = dev.type == "cuda"
    copy = torch.cuda.Stream(dev) if cuda else None
    ready = [torch.cuda.Event() for _ in range(sh.L)] if cuda else None
    done = [torch.cuda.Event() for _ in range(2)] if cuda else None
    out = []

    def fetch(layer):
        for b in range(B):
            buf[0][layer % 2][b].view(sh.HKV, -1, sh.D).copy_(host_k[b, layer].view(sh.HKV, -1, sh.D), non_blocking=True)
            buf[1][layer % 2][b].view(sh.HKV, -1, sh.D).copy_(host_v[b, layer].view(sh.HKV, -1, sh.D), non_blocking=True)

    def step():
        out.clear()
        if not cuda:
            for layer in range(sh.L):
                fetch(layer)
                out.append(F.scaled_dot_product_attention(q, buf[0][layer % 2][:, :, :T], buf[1][layer % 2][:, :, :T],
                                                          enable_gqa=True))
            return
        cur = torch.cuda.current_stream()
        copy.wait_stream(cur)
        with torch.cuda.stream(copy):
            fetch(0)
            ready[0].record(copy)
        for layer in range(sh.L):
            if layer + 1 < sh.L:
                with torch.cuda.stream(copy):
                    if layer >= 1:
                        copy.wait_event(done[(layer + 1) % 2])
                    fetch(layer + 1)
                    ready[layer + 1].record(copy)
            cur.wait_event(ready[layer])
            out.append(F.scaled_dot_product_attention(q, buf[0][layer % 2][:, :, :T], buf[1][layer % 2][:, :, :T],
                                                      enable_gqa=True))
            done[layer % 2].record(cur)

    if not cuda:
        t0 = time.perf_counter()
        step()
        return (time.perf_counter() - t0) * 1e6
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    from cuda_timing import graph_replay_us

    return statistics.median(graph_replay_us(graph, reps, warmup=1))


# ``--sweep``: launch alternatives of the page op's tail (``op.PAGES_LAUNCH``); the first is the tail's
# first version (BLOCK_K=64 with 4 warps spills 812 bytes per thread, one split loaded at a time in the merge)
TAIL_SWEEP = [dict(BLOCK_K=bk, num_warps=nw, WAVES=2, MIN_ITEMS=mi, MERGE_UNROLL=u, MERGE_WARPS=mw)
              for bk, nw, mi, u, mw in [(64, 4, 128, 1, 4), (32, 8, 128, 1, 4), (32, 8, 128, 4, 8), (32, 8, 256, 4, 8),
                                        (32, 8, 512, 4, 8), (32, 8, 64, 4, 8), (16, 4, 128, 4, 8), (64, 8, 128, 4, 8),
                                        (32, 8, 128, 2, 8)]]


def page_op_stages(q, k, v, seq_lens, n_prefill, lpq, lpk, comp, lo, hi, page: int, budget_pages: int, d: int,
                   reps: int, sweep: bool = False) -> dict:
    """µs of the GPU-resident page op's stages (CUDA-graph replays, each alone): the page select (bounds +
    radix select) and the tail over the selected pages (exact attention per KV head's query group +
    completion, ``decode_pages_triton``); for comparison the same tail as the per-query-head kernel the
    offloaded decode uses (pages expanded to positions + ``decode_retrieved_triton``: the op's tail before
    the grouped kernel)."""
    from cuda_timing import time_graph
    from macattn.plugins.retrieval_completion.op import (decode_pages_triton, decode_retrieved_triton, page_positions,
                                                        select_mid_pages)

    pages = select_mid_pages(q, lo, hi, n_prefill, N_SINK, N_TAIL, page, budget_pages)
    out = torch.empty_like(q)
    scale = 1.0 / math.sqrt(d)

    def tail():
        decode_pages_triton(q, k, v, seq_lens, n_prefill, lpq, lpk, *comp, pages, n_sink=N_SINK, n_tail=N_TAIL,
                            page_size=page, scale=scale, out=out)

    def tail_per_query_head():
        decode_retrieved_triton(q, k, v, seq_lens, n_prefill, lpq, *comp, page_positions(pages, page),
                                retrieved=(k, v, lpk), n_sink=N_SINK, n_tail=N_TAIL, top_k=budget_pages,
                                page_size=page, scale=scale, out=out)

    res = {"select_pages": time_graph(lambda: select_mid_pages(q, lo, hi, n_prefill, N_SINK, N_TAIL, page,
                                                               budget_pages), reps),
           "decode_tail": time_graph(tail, reps),
           "decode_tail_per_query_head": time_graph(tail_per_query_head, reps)}
    if sweep:
        from macattn.plugins.retrieval_completion import op

        default, res["tail_sweep"] = op.PAGES_LAUNCH, []
        try:
            for cfg in TAIL_SWEEP:
                op.PAGES_LAUNCH = cfg
                res["tail_sweep"].append({**cfg, "us": time_graph(tail, reps)})
        finally:
            op.PAGES_LAUNCH = default
    return res


def per_layer(st, sh, B, T, cfg, dev, dtype, data, reps, fi_ok, sweep=False):
    """One layer with its KV on the GPU: the resident page op, the exhaustive op, FlashInfer; the offloaded
    step's output of that layer vs the resident op's (same data, bounds, pages)."""
    k, v, lpk = data
    K = cfg.pages_for(cfg.top_k)
    kk, vv = k[None].expand(B, -1, -1, -1).contiguous(), v[None].expand(B, -1, -1, -1).contiguous()
    lp = lpk[None].expand(B, -1, -1, -1).contiguous()
    gen = torch.Generator(device=dev).manual_seed(3)
    q = torch.randn(B, sh.HQ, sh.D, generator=gen, device=dev).to(dtype)
    lpq = torch.randn(B, sh.HQ, sh.F, generator=gen, device=dev) * 0.5 - 1.0
    npf = torch.full((B,), T, device=dev, dtype=torch.int64)
    sl = npf.clone()
    comp = tuple(c[:B] for c in (st.comp_a[0], st.comp_b[0], st.comp_shift[0]))
    lo, hi = st.page_lo[0][:B], st.page_hi[0][:B]
    args = (q, kk, vv, sl, npf, lpq, lp, *comp)
    res = dict()
    page_op = lambda: torch.ops.macattn.page_retrieval_completion(*args, lo, hi, N_SINK, N_TAIL, cfg.page_size, K, 0.0)  # noqa: E731
    exh_op = lambda: torch.ops.macattn.retrieval_completion(*args, N_SINK, N_TAIL, K * cfg.page_size, 0.0)  # noqa: E731
    # the offloaded decode of layer 0 on the same inputs (rows at their prompt length, nothing generated)
    got = st.decode(0, q, lpq, sl, npf, 1.0 / math.sqrt(sh.D))
    want = page_op()
    res["check_offload_vs_resident_rel"] = float((got.double() - want.double()).norm() / want.double().norm())
    if dev.type == "cuda":
        from cuda_timing import time_graph

        res["resident_page_us"] = time_graph(page_op, reps)
        res["resident_exhaustive_us"] = time_graph(exh_op, reps)
        try:        # where the page op's time goes: its stages, each captured alone
            res["resident_page_stages_us"] = page_op_stages(q, kk, vv, sl, npf, lpq, lp, comp, lo, hi, cfg.page_size,
                                                            K, sh.D, reps, sweep)
        except Exception as e:  # noqa: BLE001  (recorded; the whole-op figure still counts)
            res["resident_page_stages_error"] = f"{type(e).__name__}: {e}"[:300]
        if fi_ok:
            try:
                from bench_completion_decode import flashinfer_step

                fn, _, keep = flashinfer_step(dict(q=q, k=kk, v=vv, T=T), B)
                res["flashinfer_us"] = time_graph(fn, reps)
                del keep
            except Exception as e:  # noqa: BLE001  (recorded; the other figures still count)
                res["flashinfer_error"] = f"{type(e).__name__}: {e}"[:300]
        peer = res.get("flashinfer_us")
        if peer:
            res["resident_page_speedup_vs_flashinfer"] = peer / res["resident_page_us"]
    else:   # the dry run: both against the fp64 reference on one row
        ref = page_retrieval_completion_step(*(a[:1] for a in args), n_sink=N_SINK, n_tail=N_TAIL,
                                             page_size=cfg.page_size, budget_pages=K)
        res["check_offload_vs_fp64_rel"] = float((got[:1].double() - ref.double()).norm() / ref.double().norm())
    return res


def versions() -> dict:
    v = dict(torch=torch.__version__, cuda=torch.version.cuda, python=platform.python_version())
    for name in ("triton", "flashinfer"):
        try:
            v[name] = __import__(name).__version__
        except Exception as e:  # noqa: BLE001
            v[name] = f"unavailable: {type(e).__name__}"
    return v


def run_point(sh, B, T, args, dev, dtype) -> dict:
    page = args.page
    mid = partition(T, T, n_sink=N_SINK, n_tail=N_TAIL).mid_len
    top_k = max(1, math.ceil(args.budget * mid))
    cfg = CompletionConfig(n_sink=N_SINK, n_tail=N_TAIL, top_k=top_k, feature_dim=sh.F, selector="quest",
                           page_size=page)
    K = cfg.pages_for(top_k)
    hot = max(K, math.ceil(args.hot_mult * K))
    gen_rows = 4 + args.steps + 2
    row = dict(batch=B, context=T, top_k_tokens=top_k, pages_per_kv_head=K, page=page, hot_pages=hot,
               budget=args.budget, q_corr=args.q_corr)
    off = OffloadConfig(hot_pages=hot, max_generated=gen_rows, max_prefill=T, prefetch="query",
                        host_budget_bytes=1 << 50, device_budget_bytes=1 << 40)
    P = -(-T // page)
    gpu = dev.type == "cuda"
    t0 = time.time()
    one = [(pinned_zeros if gpu else torch.zeros)(1, sh.L, sh.HKV, P, page, w, dtype=dt)
           for w, dt in ((sh.D, dtype), (sh.D, dtype), (sh.F, torch.float32))]
    host = tuple(t.expand(B, *t.shape[1:]) for t in one)     # the B requests share one prompt's host pages
    log(f"  B={B} ctx={T}: pinned host pages {sum(t.numel() * t.element_size() for t in one) / 2**30:.1f} GiB "
        f"({time.time() - t0:.1f} s)")
    bytes_req = offload_bytes(cfg, off, num_layers=sh.L, num_kv_heads=sh.HKV, head_dim=sh.D, feature_dim=sh.F,
                              dtype=dtype)
    row["device_bytes_per_request"] = bytes_req["device"]
    row["full_kv_bytes_per_request"] = bytes_req["full_kv"]
    row["device_fraction_of_full_kv"] = bytes_req["device"] / bytes_req["full_kv"]
    for name, prefetch, completion in (("offload", args.prefetch, True), ("offload_nopf", "none", True),
                                       ("topk_only", "none", False)):
        if name == "offload_nopf" and args.prefetch == "none":
            continue
        o = OffloadConfig(**{**off.__dict__, "prefetch": prefetch})
        t1 = time.time()
        first = name == "offload"                     # the first variant writes the shared host pages
        st = build(sh, cfg, o, B, T, dev, dtype, host, completion=completion, write_host=first)
        if first:
            row.update(per_layer(st, sh, B, T, cfg, dev, dtype, layer_data(sh, T, page, 0, dev, dtype), args.reps,
                                 not args.no_flashinfer, args.sweep))
            del st
            if args.resident_only:
                return row
            st = build(sh, cfg, o, B, T, dev, dtype, host, completion=completion, write_host=False)  # fresh caches
        r = time_offload(st, sh, B, T, dev, dtype, args.steps, args.q_corr, args.dry_run)
        row[name] = r
        log(f"  {name:>12}: {r['step_us'] / 1e3:8.2f} ms/step  {r['tokens_per_s']:8.1f} tok/s  hit {r['hit_rate']:.2f}  "
            f"{r['bytes_fetched_per_step'] / 2**20:8.1f} MiB/step  ({time.time() - t1:.1f} s)")
        del st
        if gpu:
            torch.cuda.empty_cache()
    t1 = time.time()
    full_us = time_full_offload(host[0], host[1], sh, B, T, dev, dtype, args.full_reps, args.dry_run)
    e = torch.tensor([], dtype=dtype).element_size()
    row["full_offload"] = dict(step_us=full_us, tokens_per_s=B / (full_us * 1e-6),
                               bytes_fetched_per_step=2 * sh.L * B * sh.HKV * P * page * sh.D * e, graph=gpu)
    log(f"  {'full_offload':>12}: {full_us / 1e3:8.2f} ms/step  {B / (full_us * 1e-6):8.1f} tok/s  "
        f"{row['full_offload']['bytes_fetched_per_step'] / 2**30:8.2f} GiB/step  ({time.time() - t1:.1f} s)")
    row["offload_speedup_vs_full_offload"] = row["offload"]["tokens_per_s"] / row["full_offload"]["tokens_per_s"]
    del host, one
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="131072")
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--budget", type=float, default=0.02, help="fetched fraction of the mid region")
    ap.add_argument("--page", type=int, default=64)
    ap.add_argument("--hot-mult", type=float, default=1.5, help="hot pages = this x the pages a step selects")
    ap.add_argument("--prefetch", choices=("query", "none"), default="query")
    ap.add_argument("--q-corr", type=float, default=0.9, help="correlation of a step's query with the last")
    ap.add_argument("--steps", type=int, default=20, help="timed decode steps (graph replays)")
    ap.add_argument("--full-reps", type=int, default=3, help="timed steps of full attention over offloaded KV")
    ap.add_argument("--reps", type=int, default=50, help="replays per per-layer figure")
    ap.add_argument("--no-flashinfer", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="also time the page op tail's launch alternatives (TAIL_SWEEP)")
    ap.add_argument("--resident-only", action="store_true",
                    help="only the per-layer figures with the KV on the GPU (no offloaded steps)")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, the same code (no timing claims)")
    ap.add_argument("--out", default="benchmarks/results/bench_offload_h100.json")
    args = ap.parse_args(argv)
    dev = torch.device("cpu" if args.dry_run else "cuda")
    dtype = torch.float64 if args.dry_run else torch.bfloat16
    if args.dry_run:
        args.contexts, args.batches, args.page, args.steps, args.full_reps = "600", "1,2", 16, 3, 1
        args.no_flashinfer = True
    else:
        from macattn.methods.kernels import register_kernels

        register_kernels()
    sh = Shapes(args.dry_run)
    t0 = time.time()
    rows = []
    for B in [int(b) for b in args.batches.split(",")]:
        for T in [int(c) for c in args.contexts.split(",")]:
            rows.append(run_point(sh, B, T, args, dev, dtype))
    log(f"\n{'B':>2} {'ctx':>7} {'pages':>5} {'offload ms':>10} {'tok/s':>8} {'hit':>5} {'MiB/step':>9} "
        f"{'nopf ms':>8} {'topk ms':>8} {'full-off ms':>11} {'x full-off':>10} {'page us':>8} {'FI us':>7} {'x FI':>5} "
        f"{'dev/KV':>6}")
    for r in rows:
        if "offload" not in r:          # --resident-only
            log(f"{r['batch']:>2} {r['context']:>7} {r['pages_per_kv_head']:>5}   page op {r.get('resident_page_us', float('nan')):.1f} us"
                f"  FlashInfer {r.get('flashinfer_us', float('nan')):.1f} us  stages {r.get('resident_page_stages_us')}")
            continue
        o = r["offload"]
        log(f"{r['batch']:>2} {r['context']:>7} {r['pages_per_kv_head']:>5} {o['step_us'] / 1e3:>10.2f} "
            f"{o['tokens_per_s']:>8.1f} {o['hit_rate']:>5.2f} {o['bytes_fetched_per_step'] / 2**20:>9.1f} "
            f"{r.get('offload_nopf', {}).get('step_us', float('nan')) / 1e3:>8.2f} "
            f"{r['topk_only']['step_us'] / 1e3:>8.2f} {r['full_offload']['step_us'] / 1e3:>11.2f} "
            f"{r['offload_speedup_vs_full_offload']:>10.1f} {r.get('resident_page_us', float('nan')):>8.1f} "
            f"{r.get('flashinfer_us', float('nan')):>7.1f} {r.get('resident_page_speedup_vs_flashinfer', float('nan')):>5.2f} "
            f"{r['device_fraction_of_full_kv']:>6.3f}")
    checks = [r["check_offload_vs_resident_rel"] for r in rows]
    if args.dry_run:
        worst = max(max(r["check_offload_vs_fp64_rel"] for r in rows), max(checks))
        ok = worst < 1e-9
        log(f"offloaded = reference: {'yes' if ok else 'NO'} (worst rel {worst:.1e})")
        return 0 if ok else 1
    log(f"offloaded vs GPU-resident op, worst rel: {max(checks):.2e}")
    out = dict(device=torch.cuda.get_device_name(), versions=versions(),
               shapes=dict(layers=sh.L, q_heads=sh.HQ, kv_heads=sh.HKV, head_dim=sh.D, features=sh.F, n_sink=N_SINK,
                           n_tail=N_TAIL, kv_dtype=str(dtype)),
               timing="per step: one CUDA graph replay of all layers (copy stream included), CUDA events, median; "
                      "per layer: CUDA-graph replay median", args=vars(args), rows=rows, seconds=time.time() - t0)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
