"""MAC decode on the GPU vs FlashInfer 0.2.7 and torch SDPA, one attention layer (LLaMA-3.1-8B shapes).

Grid: B in {1, 8, 32} x context in {32K, 128K}; 32 query heads, 8 KV heads, d=128, bf16;
K=1024, r=256, reuse gap ~400 (uniform in [380, 420] per head).

Methods (all timed as CUDA-graph replays, median of many replays, CUDA events):
  mac_hit      our MAC step (match -> plan -> attention -> merge+append), every head hits
  mac_99       same, 1% of (request, head) pairs miss (at least one)
  ours_full    our full-attention path (same attention kernel, static split, no ring)
  flashinfer   BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=True), planned once
  sdpa         torch SDPA, enable_gqa=True, contiguous [B, Hkv, T, d]
plus the MAC step's per-kernel breakdown: match (partials) / plan (one program: match
decision + work split) / attention (partial summaries) / merge+append, each kernel captured
alone (so each includes its own launch gap; the step overlaps them through PDL).

Rotation: each graph runs the step once on each of ``n_sets`` independent input sets (KV
cache, rings, queries) so that L2 (50 MB) does not serve a set's bytes from the previous
replay; ``n_sets`` is chosen so that the smallest per-step footprint (the MAC step's)
times ``n_sets`` exceeds 3x L2, limited by memory (the JSON says where it was limited).

Usage: python benchmarks/bench_mac_decode.py [--quick] [--out benchmarks/results/bench_mac_decode.json]
       python benchmarks/bench_mac_decode.py --tune   (launch-parameter sweep, prints a table)
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

try:
    from tqdm import tqdm
except ImportError:  # pragma: no cover
    def tqdm(it=None, **kw):
        return it

from cuda_timing import replay_us

HQ, HKV, D = 32, 8, 128
WINDOW, BAND, TAU = 1024, 256, 0.45
GAP_LO, GAP_HI = 380, 420
PAGE_SIZE = 16
COPY_BW = 3.0e12            # B/s, measured D2D copy (read + write) on this H100 (FACTS.md)
L2_BYTES = 50 * 2 ** 20
DTYPE = torch.bfloat16
GIB = 2 ** 30


# ---------------------------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------------------------
def time_graph(step_fns, reps: int, warmup: int = 3) -> dict:
    """Capture ``step_fns`` (one per input set) into one graph; time replays. Per-step median in µs."""
    per = [t / len(step_fns) for t in replay_us(step_fns, reps, warmup)]
    return {"median_us": statistics.median(per), "min_us": min(per), "max_us": max(per), "reps": reps,
            "sets_per_replay": len(step_fns)}


def reps_for(est_us: float, n_sets: int) -> int:
    per_replay = max(est_us * n_sets, 1.0)
    return int(min(400, max(20, 0.6e6 / per_replay)))


# ---------------------------------------------------------------------------------------------
# inputs
# ---------------------------------------------------------------------------------------------
class MacSet:
    """One independent input set: paged KV, rings (hits planted at gap ~400), queries."""

    def __init__(self, B: int, ctx: int, gen: torch.Generator, dev, *, paged: bool = True, miss_frac: float = 0.01):
        self.B, self.ctx = B, ctx
        m = ctx - 1
        self.positions = torch.full((B,), m, dtype=torch.int64, device=dev)
        self.slots = torch.arange(B, dtype=torch.int64, device=dev)
        self.q = torch.randn(B, HQ, D, device=dev, generator=gen).to(DTYPE)
        if paged:
            per = ctx // PAGE_SIZE
            n_pages = B * per
            self.k = torch.randn(n_pages, PAGE_SIZE, HKV, D, device=dev, generator=gen, dtype=DTYPE)
            self.v = torch.randn(n_pages, PAGE_SIZE, HKV, D, device=dev, generator=gen, dtype=DTYPE)
            perm = torch.randperm(n_pages, device=dev, generator=gen).to(torch.int32)
            self.page_table = perm.view(B, per).contiguous()
        else:
            self.k = torch.randn(B, HKV, ctx, D, device=dev, generator=gen, dtype=DTYPE)
            self.v = torch.randn(B, HKV, ctx, D, device=dev, generator=gen, dtype=DTYPE)
            self.page_table = None
        self.qring = torch.randn(B, HQ, WINDOW, D, device=dev, generator=gen).to(DTYPE)
        self.oring = 0.1 * torch.randn(B, HQ, WINDOW, D, device=dev, generator=gen)
        self.ring_lse = torch.randn(B, HQ, WINDOW, device=dev, generator=gen) * 0.5 + math.log(ctx)
        t = torch.arange(m - WINDOW, m, device=dev)
        self.ring_pos = torch.empty(B, WINDOW, dtype=torch.int64, device=dev)
        self.ring_pos[:, t % WINDOW] = t
        gaps = torch.randint(GAP_LO, GAP_HI + 1, (B, HQ), device=dev, generator=gen)
        p = m - gaps
        idx = (p % WINDOW).view(B, HQ, 1, 1).expand(B, HQ, 1, D)
        near = torch.gather(self.qring, 2, idx).squeeze(2).float()
        self.q_pre = (near + 0.05 * torch.randn(B, HQ, D, device=dev, generator=gen)).to(DTYPE)
        # the "99% hit" variant: 1% of (request, head) pairs (at least one) get a fresh query -> miss
        self.n_miss = max(1, round(miss_frac * B * HQ))
        self.q_pre99 = self.q_pre.clone()
        flat = torch.randperm(B * HQ, device=dev, generator=gen)[: self.n_miss]
        self.q_pre99.view(B * HQ, D)[flat] = torch.randn(self.n_miss, D, device=dev, generator=gen).to(DTYPE)
        self.gaps = gaps

    def ring_args(self):
        return self.qring, self.oring, self.ring_lse, self.ring_pos


def kv_set_bytes(B: int, ctx: int) -> int:
    return B * ctx * HKV * D * 2 * 2


def ring_set_bytes(B: int) -> int:
    return B * HQ * WINDOW * (D * 2 + D * 4 + 4) + B * WINDOW * 8


def mac_bytes(B: int, gap: float = (GAP_LO + GAP_HI) / 2) -> dict:
    """Analytic bytes of one MAC all-hit step (the floor's numerator)."""
    match = B * HQ * WINDOW * D * 2 + B * WINDOW * 8 + B * HQ * D * 2
    # per group the union range runs from the smallest p - r + 1 of its 4 heads to m
    span = BAND + GAP_HI      # heads' gaps are uniform in [380, 420]; the union takes the largest
    attn = B * HKV * span * D * 2 * 2 + B * HQ * D * 2
    merge = B * HQ * (D * 4 + 4) + B * HQ * (D * 2 + D * 4 + 4) + B * HQ * D * 2
    return {"match": match, "attention": attn, "merge_append": merge, "total": match + attn + merge,
            "span_tokens_per_group": span}


# ---------------------------------------------------------------------------------------------
# methods
# ---------------------------------------------------------------------------------------------
def make_plan(B, ctx, page_size, **kw):
    from macattn.plugins.mac.decode_plan import MacDecodePlan
    return MacDecodePlan(batch_size=B, max_context=ctx, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D,
                         window=WINDOW, band=BAND, tau=TAU, page_size=page_size, device="cuda", **kw)


def mac_step_fns(plan, sets, *, q_pre_attr="q_pre"):
    def fn(s):
        return lambda: plan.run(s.q, getattr(s, q_pre_attr), s.k, s.v, s.positions, s.slots, *s.ring_args(),
                                page_table=s.page_table, check=False)
    return [fn(s) for s in sets]


def stage_fns(plan, sets):
    """Per-stage step lists for the breakdown (each stage reads what the previous full run left)."""
    return {
        "match": [lambda s=s: plan.run_match(s.q_pre, s.qring, s.ring_pos, s.ring_lse, s.slots, s.positions)
                  for s in sets],
        "plan": [lambda s=s: plan.run_plan(s.positions) for s in sets],
        "attention": [lambda s=s: plan.run_attention(s.q, s.k, s.v, s.positions, s.page_table) for s in sets],
        "merge_append": [lambda s=s: plan.run_merge(s.q_pre, s.positions, s.slots, *s.ring_args()) for s in sets],
    }


def flashinfer_fns(B, ctx, sets):
    import flashinfer
    dev = "cuda"
    per = ctx // PAGE_SIZE
    ws = torch.empty(128 * 2 ** 20, dtype=torch.uint8, device=dev)
    indptr = torch.arange(0, (B + 1) * per, per, dtype=torch.int32, device=dev)
    last = torch.full((B,), PAGE_SIZE, dtype=torch.int32, device=dev)
    indices = sets[0].page_table.reshape(-1).contiguous()
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        ws, "NHD", use_cuda_graph=True, use_tensor_cores=True, paged_kv_indptr_buffer=torch.empty_like(indptr),
        paged_kv_indices_buffer=torch.empty_like(indices), paged_kv_last_page_len_buffer=torch.empty_like(last))
    wrapper.plan(indptr, indices, last, HQ, HKV, D, PAGE_SIZE, q_data_type=DTYPE, kv_data_type=DTYPE)
    outs = [torch.empty(B, HQ, D, dtype=DTYPE, device=dev) for _ in sets]
    # every set uses the same page table (different cache tensors), so one plan serves all
    for s in sets[1:]:
        s.page_table = sets[0].page_table
    fns = [lambda s=s, o=o: wrapper.run(s.q, (s.k, s.v), out=o) for s, o in zip(sets, outs)]
    return fns, outs, wrapper


def sdpa_fns(sets):
    fns = []
    for s in sets:
        q4 = s.q.unsqueeze(2)
        fns.append(lambda s=s, q4=q4: F.scaled_dot_product_attention(q4, s.k, s.v, enable_gqa=True))
    return fns


def rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


TWO_STAGE = (("fp8", 4), ("proj32_fp8", 4), ("proj16", 4))   # (match_sketch, match_candidates) timed


def two_stage_rows(B, ctx, sets, args, exact_hit_rate, n_sets) -> dict:
    """MAC all-hit with ``MacConfig(match="two_stage")``: the whole step and the match stage alone (the
    query's sketch, candidate and select kernels, the sketch append), per variant."""
    from macattn.methods.mac.match_sketch import sketch, sketch_dims, sketch_dtype, sketch_projection_of

    rows = {}
    for kind, C in TWO_STAGE:
        plan = make_plan(B, ctx, PAGE_SIZE, match_candidates=C, match_sketch_dims=sketch_dims(kind, D),
                         match_sketch_itemsize=sketch_dtype(kind).itemsize, **args.plan_kw)
        srings = [sketch(s.qring, kind).to(sketch_dtype(kind)) for s in sets]
        proj = sketch_projection_of(kind, D, "cuda")

        def step(s, sr):
            return plan.run(s.q, s.q_pre, s.k, s.v, s.positions, s.slots, *s.ring_args(), page_table=s.page_table,
                            check=False, sring=sr, proj=proj)

        def match(s, sr):
            plan.run_two_stage_match(s.q_pre, proj, s.qring, sr, s.ring_pos, s.ring_lse, s.slots, s.positions)

        s0 = sets[0]
        _, mp, _ = plan.run(s0.q, s0.q_pre, s0.k, s0.v, s0.positions, s0.slots, *s0.ring_args(),
                            page_table=s0.page_table, sring=srings[0], proj=proj)
        hit = float((mp >= 0).float().mean())
        full = time_graph([lambda s=s, sr=sr: step(s, sr) for s, sr in zip(sets, srings)], reps_for(30, n_sets))
        only = time_graph([lambda s=s, sr=sr: match(s, sr) for s, sr in zip(sets, srings)], reps_for(10, n_sets))
        ring = srings[0]
        rows[f"{kind} C={C}"] = {"step": full, "match_us": only["median_us"], "hit_rate": hit,
                                 "exact_hit_rate": exact_hit_rate,
                                 "sketch_ring_bytes": ring.numel() * ring.element_size(), "plan": repr(plan.two_stage)}
        del plan, srings
    return rows


# ---------------------------------------------------------------------------------------------
# one grid point
# ---------------------------------------------------------------------------------------------
def choose_sets(B, ctx, mem_budget, max_sets=24):
    per_set = kv_set_bytes(B, ctx) + ring_set_bytes(B)
    by_mem = max(1, int(mem_budget // per_set))
    footprint = mac_bytes(B)["total"]
    want = max(2, math.ceil(3 * L2_BYTES / footprint))
    n = max(1, min(by_mem, want, max_sets))
    return n, {"n_sets": n, "wanted_for_l2": want, "limited_by_memory": n < want, "set_bytes": per_set,
               "mac_step_bytes": footprint, "rotated_bytes_mac": n * footprint}


def run_point(B, ctx, args, pbar=None, fi_ok=True):
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(int.from_bytes(os.urandom(4), "little"))
    res = {"B": B, "context": ctx, "methods": {}, "breakdown_us": {}, "checks": {}}
    free, total = torch.cuda.mem_get_info()
    budget = min(free - 10 * GIB, 52 * GIB)
    n_sets, rot = choose_sets(B, ctx, budget)
    res["rotation_paged"] = rot
    full_bytes = kv_set_bytes(B, ctx) + B * HQ * D * 4
    mb = mac_bytes(B)
    res["floors_us"] = {"full_attention": full_bytes / COPY_BW * 1e6, "mac_hit": mb["total"] / COPY_BW * 1e6,
                        "match": mb["match"] / COPY_BW * 1e6, "attention_hit": mb["attention"] / COPY_BW * 1e6}
    res["bytes"] = {"full_attention": full_bytes, **{f"mac_{k}": v for k, v in mb.items()}}

    def tick(name):
        if pbar is not None:
            pbar.set_postfix_str(f"B={B} ctx={ctx // 1024}K {name}")
            pbar.update(1)

    # ---- paged phase: MAC, ours full, FlashInfer ----
    sets = [MacSet(B, ctx, gen, dev) for _ in range(n_sets)]
    res["mac_99_miss_heads"] = max(1, round(0.01 * B * HQ))
    res["mac_99_miss_heads_of"] = B * HQ
    plan = make_plan(B, ctx, PAGE_SIZE, **args.plan_kw)
    res["plan"] = repr(plan)
    # correctness spot check vs the reference on a slice is in the tests; here: hits really happen
    s0 = sets[0]
    saved = [t.clone() for t in s0.ring_args()]
    out, mp, _ = plan.run(s0.q, s0.q_pre, s0.k, s0.v, s0.positions, s0.slots, *s0.ring_args(),
                          page_table=s0.page_table)
    torch.cuda.synchronize()
    res["checks"]["mac_hit_rate"] = float((mp >= 0).float().mean())
    res["checks"]["mac_mean_gap"] = float((s0.positions.unsqueeze(1) - mp).float().mean())
    plan.run(s0.q, s0.q_pre99, s0.k, s0.v, s0.positions, s0.slots, *s0.ring_args(), page_table=s0.page_table)
    torch.cuda.synchronize()
    res["checks"]["mac_99_hit_rate"] = float((plan.match_pos >= 0).float().mean())
    for dst, src in zip(s0.ring_args(), saved):
        dst.copy_(src)
    del saved

    est_full = full_bytes / COPY_BW * 1e6
    t = time_graph(mac_step_fns(plan, sets), reps_for(mb["total"] / COPY_BW * 1e6 + 10, n_sets))
    res["methods"]["mac_hit"] = t
    tick("mac_hit")
    t = time_graph(mac_step_fns(plan, sets, q_pre_attr="q_pre99"), reps_for(est_full * 0.05 + 20, n_sets))
    res["methods"]["mac_99"] = t
    tick("mac_99")
    if B * HKV < torch.cuda.get_device_properties(0).multi_processor_count:
        # the one-launch persistent step (opt-in; made for batches whose KV groups leave SMs idle), same sets
        plan1 = make_plan(B, ctx, PAGE_SIZE, **{**args.plan_kw, "persistent": True})
        res["methods"]["mac_hit_persistent"] = time_graph(mac_step_fns(plan1, sets), reps_for(40, n_sets))
        res["methods"]["mac_99_persistent"] = time_graph(mac_step_fns(plan1, sets, q_pre_attr="q_pre99"),
                                                         reps_for(est_full * 0.05 + 40, n_sets))
        res["persistent_programs"] = plan1.persistent_programs
        plan1 = None
    # rings must be back in the all-hit state for the stage breakdown: re-run the all-hit step once
    for s in sets:
        plan.run(s.q, s.q_pre, s.k, s.v, s.positions, s.slots, *s.ring_args(), page_table=s.page_table, check=False)
    for name, fns in stage_fns(plan, sets).items():
        res["breakdown_us"][name] = time_graph(fns, reps_for(10, n_sets))["median_us"]
    tick("breakdown")
    res["two_stage"] = two_stage_rows(B, ctx, sets, args, res["checks"]["mac_hit_rate"], n_sets)
    tick("two_stage")
    full_plan = plan
    full_fns = [lambda s=s: full_plan.run_full(s.q, s.k, s.v, s.positions, page_table=s.page_table, check=False)
                for s in sets]
    res["methods"]["ours_full"] = time_graph(full_fns, reps_for(est_full, n_sets))
    ours_full_out = full_plan.run_full(s0.q, s0.k, s0.v, s0.positions, page_table=s0.page_table).clone()
    tick("ours_full")
    if fi_ok:
        try:
            fns, outs, wrapper = flashinfer_fns(B, ctx, sets)
            res["methods"]["flashinfer"] = time_graph(fns, reps_for(est_full, n_sets))
            fns[0]()
            torch.cuda.synchronize()
            res["checks"]["ours_full_vs_flashinfer_rel"] = rel(ours_full_out, outs[0])
            del fns, outs, wrapper
        except Exception as e:  # noqa: BLE001 - record and go on
            res["methods"]["flashinfer"] = {"error": f"{type(e).__name__}: {e}"[:500]}
    tick("flashinfer")
    sets = plan = full_plan = full_fns = None      # free the paged sets before the contiguous phase
    gc.collect()
    torch.cuda.empty_cache()

    # ---- contiguous phase: SDPA (and our full path on the same layout) ----
    free, _ = torch.cuda.mem_get_info()
    budget = min(free - 14 * GIB, 52 * GIB)      # SDPA may need workspace
    n_c, rot_c = choose_sets(B, ctx, budget)
    res["rotation_contiguous"] = rot_c
    try:
        csets = [MacSet(B, ctx, gen, dev, paged=False) for _ in range(n_c)]
        res["methods"]["sdpa"] = time_graph(sdpa_fns(csets), reps_for(est_full, n_c))
        plan_c = make_plan(B, ctx, None, **args.plan_kw)
        fns = [lambda s=s: plan_c.run_full(s.q, s.k, s.v, s.positions, check=False) for s in csets]
        res["methods"]["ours_full_contiguous"] = time_graph(fns, reps_for(est_full, n_c))
        c0 = csets[0]
        ref = F.scaled_dot_product_attention(c0.q.unsqueeze(2), c0.k, c0.v, enable_gqa=True).squeeze(2)
        res["checks"]["ours_full_contiguous_vs_sdpa_rel"] = rel(plan_c.run_full(c0.q, c0.k, c0.v, c0.positions), ref)
        fns = mac_step_fns(plan_c, csets)
        res["methods"]["mac_hit_contiguous"] = time_graph(fns, reps_for(mb["total"] / COPY_BW * 1e6 + 10, n_c))
        csets = plan_c = fns = None
    except torch.OutOfMemoryError as e:
        res["methods"].setdefault("sdpa", {"error": f"OOM: {e}"[:300]})
    tick("sdpa")
    gc.collect()
    torch.cuda.empty_cache()

    m = res["methods"]
    peers = [m[k]["median_us"] for k in ("flashinfer", "sdpa") if k in m and "median_us" in m[k]]
    best = min(peers) if peers else float("nan")
    res["best_peer_us"] = best
    res["speedup_vs_best_peer"] = {k: best / v["median_us"] for k, v in m.items() if "median_us" in v}
    res["match_bw_TBps"] = mb["match"] / (res["breakdown_us"]["match"] * 1e-6) / 1e12
    res["match_frac_of_copy_bw"] = res["match_bw_TBps"] * 1e12 / COPY_BW
    return res


# ---------------------------------------------------------------------------------------------
# tuning sweep
# ---------------------------------------------------------------------------------------------
TUNE_CONFIGS = ({}, {"early_b": False}, {"pdl": False}, {"b_items": 2}, {"b_items": 4})


def tune(points):
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(1234)
    for B, ctx in points:
        n_sets, _ = choose_sets(B, ctx, min(torch.cuda.mem_get_info()[0] - 10 * GIB, 40 * GIB), max_sets=12)
        sets = [MacSet(B, ctx, gen, "cuda") for _ in range(n_sets)]
        for kw in TUNE_CONFIGS:
            try:
                plan = make_plan(B, ctx, PAGE_SIZE, **kw)
                hit = time_graph(mac_step_fns(plan, sets), 50)["median_us"]
                h99 = time_graph(mac_step_fns(plan, sets, q_pre_attr="q_pre99"), 30)["median_us"]
                # back to the all-hit ring state for the stage timings
                time_graph(mac_step_fns(plan, sets), 1, warmup=0)
                st = {n: time_graph(f, 50)["median_us"] for n, f in stage_fns(plan, sets).items()}
                full = time_graph([lambda s=s: plan.run_full(s.q, s.k, s.v, s.positions, page_table=s.page_table,
                                                             check=False) for s in sets], 20)["median_us"]
                rows.append((B, ctx, kw, hit, h99, st, full))
                print(f"B={B:2d} ctx={ctx // 1024:3d}K {str(kw):38s} mac={hit:7.1f} mac99={h99:7.1f} "
                      + " ".join(f"{k}={v:7.1f}" for k, v in st.items()) + f" full={full:8.1f} "
                      f"res={plan.attend.per_sm} NS={plan.match.NS}", flush=True)
            except Exception as e:  # noqa: BLE001
                print(f"B={B} ctx={ctx} {kw}: {type(e).__name__}: {e}"[:300], flush=True)
        del sets
        gc.collect()
        torch.cuda.empty_cache()
        if B * ctx <= 8 * 32768:      # contiguous layout: full path, pipeline depth
            csets = [MacSet(B, ctx, gen, "cuda", paged=False) for _ in range(n_sets)]
            for kw in ({}, {"num_stages": 3}):
                plan = make_plan(B, ctx, None, **kw)
                full = time_graph([lambda s=s: plan.run_full(s.q, s.k, s.v, s.positions, check=False)
                                   for s in csets], 20)["median_us"]
                hit = time_graph(mac_step_fns(plan, csets), 50)["median_us"]
                print(f"B={B:2d} ctx={ctx // 1024:3d}K contiguous {str(kw):27s} mac={hit:7.1f} full={full:8.1f} "
                      f"{plan.attend.per_sm}", flush=True)
            del csets
            gc.collect()
            torch.cuda.empty_cache()
    return rows


def versions() -> dict:
    import triton
    v = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
         "cuda": torch.version.cuda, "python": platform.python_version(),
         "sms": torch.cuda.get_device_properties(0).multi_processor_count}
    try:
        import flashinfer
        v["flashinfer"] = flashinfer.__version__
    except Exception as e:  # noqa: BLE001
        v["flashinfer"] = f"unavailable: {type(e).__name__}: {e}"[:200]
    return v


def targets(results) -> list[dict]:
    """The issue's targets (MAC kernels v6), read off this run's numbers (never asserted)."""
    out = []
    by = {(r["B"], r["context"]): r for r in results}

    def med(r, k):
        return r["methods"].get(k, {}).get("median_us", float("nan"))

    for r in results:
        if r["B"] == 1:
            t = med(r, "mac_hit")
            out.append({"target": f"MAC all-hit, B=1, {r['context'] // 1024}K: <= 10 us per layer", "measured_us": t,
                        "met": t <= 10.0, "missed_by": None if t <= 10.0 else f"{t - 10.0:.1f} us"})
    r = by.get((1, 131072))
    if r:
        t, fi = med(r, "mac_hit"), med(r, "flashinfer")
        out.append({"target": "MAC all-hit, B=1, 128K: >= 18x FlashInfer", "measured_x": fi / t, "met": fi / t >= 18.0})
        t = med(r, "mac_99")
        out.append({"target": "MAC 99 % hit, B=1, 128K: <= 30 us", "measured_us": t, "met": t <= 30.0,
                    "missed_by": None if t <= 30.0 else f"{t - 30.0:.1f} us"})
    r = by.get((32, 131072))
    if r:
        best = r["best_peer_us"]
        rows = {"exact": (med(r, "mac_hit"), r["breakdown_us"].get("match"))}
        rows.update({k: (v["step"]["median_us"], v["match_us"]) for k, v in r.get("two_stage", {}).items()})
        for name, (t, match_us) in rows.items():
            out.append({"target": f"MAC all-hit, B=32, 128K ({name} match): >= 60x the best peer, match <= 30 us",
                        "measured_x": best / t, "match_us": match_us, "best_peer_us": best,
                        "met": best / t >= 60.0 and (match_us or float("inf")) <= 30.0})
    for r in results:
        ours, fi = med(r, "ours_full"), med(r, "flashinfer")
        out.append({"target": f"our full path within 2% of FlashInfer, B={r['B']}, {r['context'] // 1024}K",
                    "ratio": ours / fi, "met": ours <= 1.02 * fi})
        if r["B"] >= 8:
            f = r["match_frac_of_copy_bw"]
            out.append({"target": f"match >= 70% of copy bandwidth, B={r['B']}, {r['context'] // 1024}K",
                        "frac": f, "TBps": r["match_bw_TBps"], "met": f >= 0.70})
    return out


def print_table(results):
    cols = ["mac_hit", "mac_99", "mac_hit_persistent", "mac_99_persistent", "ours_full", "flashinfer", "sdpa"]
    print("\nper-layer decode time, µs (CUDA-graph replay median); x = speedup vs best peer (FlashInfer/SDPA);\n"
          "mac_hit / mac_99: the four-kernel step (default); *_persistent: the opt-in one-launch step (B * Hkv < SMs);\n"
          "breakdown: the four kernels, each captured alone")
    print(f"{'B':>3} {'ctx':>5} " + " ".join(f"{c:>17}" for c in cols) + f" {'match TB/s':>10}  breakdown µs (match/plan/attention/merge+append)")
    for r in results:
        cells = []
        for c in cols:
            m = r["methods"].get(c, {})
            if "median_us" in m:
                cells.append(f"{m['median_us']:9.1f} {r['speedup_vs_best_peer'][c]:6.1f}x")
            else:
                cells.append(f"{'n/a':>17}")
        bd = r["breakdown_us"]
        print(f"{r['B']:>3} {r['context'] // 1024:>4}K " + " ".join(cells)
              + f" {r['match_bw_TBps']:10.2f}  {bd['match']:.1f}/{bd['plan']:.1f}/{bd['attention']:.1f}/{bd['merge_append']:.1f}")
    print("\nMAC all-hit with the two-stage match (step µs, x best peer; match stage µs; hit rate vs exact's)")
    for r in results:
        for name, t in r.get("two_stage", {}).items():
            us = t["step"]["median_us"]
            print(f"{r['B']:>3} {r['context'] // 1024:>4}K {name:>16} {us:9.1f} {r['best_peer_us'] / us:6.1f}x "
                  f"match {t['match_us']:6.1f}  hit {t['hit_rate']:.3f} / {t['exact_hit_rate']:.3f}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="B=1 and B=8 at 32K only")
    ap.add_argument("--tune", action="store_true", help="launch-parameter sweep instead of the benchmark")
    ap.add_argument("--points", type=str, default=None, help="e.g. '1x32768,32x131072'")
    ap.add_argument("--no-flashinfer", action="store_true")
    ap.add_argument("--plan-kw", type=str, default="{}", help="JSON dict of MacDecodePlan keyword overrides")
    ap.add_argument("--out", type=str, default="benchmarks/results/bench_mac_decode.json")
    ap.add_argument("--summarize", type=str, default=None, help="recompute the targets of an existing JSON, print it")
    args = ap.parse_args(argv)
    if args.summarize:
        d = json.loads(Path(args.summarize).read_text())
        d["targets"] = targets(d["results"])
        d.setdefault("notes", "see benchmarks/NOTES.md for floors, versions, predictions and why targets were missed")
        Path(args.summarize).write_text(json.dumps(d, indent=1))
        print_table(d["results"])
        for t in d["targets"]:
            print(("MET   " if t["met"] else "MISSED") + "  " + t["target"]
                  + (f"  (missed by {t['missed_by']})" if t.get("missed_by") else ""))
        return
    args.plan_kw = json.loads(args.plan_kw)
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    from macattn.methods.kernels import register_kernels

    register_kernels()
    if args.points:
        points = [tuple(int(x) for x in p.split("x")) for p in args.points.split(",")]
    elif args.quick:
        points = [(1, 32768), (8, 32768)]
    else:
        points = [(b, c) for c in (32768, 131072) for b in (1, 8, 32)]
    if args.tune:
        tune(points)
        return
    info = versions()
    print(json.dumps(info), flush=True)
    results = []
    t0 = time.time()
    with tqdm(total=7 * len(points), desc="bench", file=sys.stdout, mininterval=5) as pbar:
        for B, ctx in points:
            results.append(run_point(B, ctx, args, pbar, fi_ok=not args.no_flashinfer))
            partial = {"versions": info, "config": cfg_dict(args), "results": results}
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(partial, indent=1))
    final = {"versions": info, "config": cfg_dict(args), "results": results, "targets": targets(results),
             "notes": "see benchmarks/NOTES.md for floors, versions, predictions and why targets were missed"}
    Path(args.out).write_text(json.dumps(final, indent=1))
    print_table(results)
    for t in final["targets"]:
        print(("MET   " if t["met"] else "MISSED") + "  " + t["target"]
              + (f"  (missed by {t['missed_by']})" if t.get("missed_by") else ""))
    print(f"total {time.time() - t0:.0f} s; JSON -> {args.out}")


def cfg_dict(args):
    return {"Hq": HQ, "Hkv": HKV, "d": D, "dtype": "bf16", "window": WINDOW, "band": BAND, "tau": TAU,
            "gap_range": [GAP_LO, GAP_HI], "page_size": PAGE_SIZE, "copy_bw_Bps": COPY_BW, "l2_bytes": L2_BYTES,
            "plan_kw": args.plan_kw, "timing": "CUDA graph of one step per input set, replayed; CUDA events per "
            "replay; median over replays divided by sets per replay",
            "flashinfer_call": "BatchDecodeWithPagedKVCacheWrapper(ws128MB, 'NHD', use_cuda_graph=True, "
            "use_tensor_cores=True), plan once, run in graph",
            "sdpa_call": "F.scaled_dot_product_attention(q[B,32,1,128], k[B,8,T,128], v, enable_gqa=True)"}


if __name__ == "__main__":
    main()
