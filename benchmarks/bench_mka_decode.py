"""FastMKA decode on the GPU vs the unmodified model: step latency, a per-kernel profile, the op's launch sweep.

Plain torch (no transformers) LLaMA-3.1-8B-shaped decoder layers (hidden 4096, 32 query heads,
8 KV heads, d=128, FFN 14336, RMSNorm, bf16; RoPE left out of both, it costs the same), ``--layers``
of them (32 by default, the whole model), one decode step for a batch of B requests whose KV caches hold
``context`` tokens:

  base      unmodified: q/k/v projections, cache write, SDPA (enable_gqa), o-proj, MLP
  mka       FastMKA: q projection, ``macattn::route_fused_attention`` (Triton, two launches: routing MLP
            4096->64->3 split over Dq + L2 prefix-mean update; routing finished + fused K/V projection),
            cache write, SDPA, o-proj, MLP
  mka_unfused  same with the step composed of ordinary torch ops in bf16 (router, state update,
            fuse, two cuBLAS projections): what FastMKA costs without the fused op

Every figure is a CUDA-graph replay median (CUDA events). A figure "per layer" comes from one graph that
runs the same stage for every layer in turn (each with its own weights, so a weight set larger than the
50 MB L2 is streamed from HBM as in the step; timing one layer's stage alone would read its weights from
L2). KV bytes per request: K/V cache (identical shapes: the cache stores the fused K/V) plus FastMKA's
per-request L2 state (``D`` fp32 + one int64 per layer).

Sections (any combination; ``--grid`` alone by default):

  --grid     the step grid: base / mka / mka_unfused at every (batch, context); the op alone vs the same math
             in torch (and v1, ``mka_op_v1.py``), per layer
  --profile  at ``--profile-points`` (default 1x32768,8x32768): every stage of the step per layer and
             mode (base, mka, mka_v1, mka_unfused), its bytes and copy-bandwidth floor (bytes / the D2D copy
             rate measured at start), the sum of the stages against the whole step
  --sweep    launch constants of the op (``RouteFusedLaunch``): each kernel alone over a grid, then the best
             pair against ``DEFAULT_LAUNCH`` (the op alone, per layer)
  --dry-run  every section at tiny shapes on the CPU (Triton's interpreter, no CUDA graphs, no timing
             worth reading): checks that the script runs

Usage: python benchmarks/bench_mka_decode.py [--grid] [--profile] [--sweep] [--quick]
       [--out benchmarks/results/bench_mka_decode.json]
"""
from __future__ import annotations

import os
import sys

DRY = "--dry-run" in sys.argv
if DRY:      # before anything imports triton: the kernels run in its interpreter on the CPU
    os.environ["TRITON_INTERPRET"] = "1"

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from macattn.methods.kernels import register_kernels  # noqa: E402

register_kernels()   # the Triton kernels as the op's CUDA impl
from macattn.methods.mka import ops as ops_mka  # noqa: E402,F401
from macattn.methods.mka.reference import route_fused_decode_reference, router_reference  # noqa: E402
from macattn.plugins.route_fused.op import DEFAULT_LAUNCH, RouteFusedLaunch, RouteFusedPlan  # noqa: E402

from cuda_timing import copy_bandwidth, replay_us  # noqa: E402
from mka_op_v1 import RouteFusedV1  # noqa: E402

DT = torch.bfloat16
MODES = ("base", "mka", "mka_unfused")
PROFILE_MODES = ("base", "mka", "mka_v1", "mka_unfused")


@dataclass(frozen=True)
class Shapes:
    """Model shapes of the benchmark (LLaMA-3.1-8B by default; ``TINY`` for ``--dry-run``)."""

    hidden: int = 4096
    q_heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    ffn: int = 14336
    router_hidden: int = 64

    @property
    def dq(self) -> int:
        return self.q_heads * self.head_dim

    @property
    def nkv(self) -> int:
        return self.kv_heads * self.head_dim


TINY = Shapes(hidden=64, q_heads=4, kv_heads=2, head_dim=16, ffn=128, router_hidden=8)

# --sweep: each kernel's constants alone (the other kernel at its default), then the best pair
SWEEP_ROUTE = [dict(split=s, route_warps=w) for s, w in ((64, 4), (128, 4), (256, 4), (128, 8), (256, 8))]
SWEEP_PROJECT = [dict(block_n=n, block_d=d, stages=s, warps=w)      # none spills on sm_90a (ptxas_report.py --route-fused)
                 for n, d, s, w in ((16, 128, 3, 4), (16, 128, 4, 4), (16, 128, 6, 4), (16, 256, 3, 4), (16, 256, 4, 4),
                                    (16, 256, 4, 8), (32, 128, 3, 4), (32, 128, 4, 4), (64, 128, 3, 8))]
SWEEP_DRY = ([dict(split=16)], [dict(block_n=16, block_d=16)])


# ---------------------------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------------------------
def per_call_us(fns, reps: int) -> float:
    """Median µs of one callable of ``fns`` (all captured in one graph, replayed ``reps`` times; the
    replay's time divided by ``len(fns)``). Dry run: one eager pass, wall time."""
    if DRY:
        t0 = time.perf_counter()
        for fn in fns:
            fn()
        return (time.perf_counter() - t0) * 1e6 / len(fns)
    return statistics.median(replay_us(fns, reps)) / len(fns)


# ---------------------------------------------------------------------------------------------
# the model
# ---------------------------------------------------------------------------------------------
def make_layer(S: Shapes, gen_seed: int, dev) -> dict:
    g = torch.Generator(device=dev).manual_seed(gen_seed)
    w = lambda o, i: (torch.randn(o, i, generator=g, device=dev) / i ** 0.5).to(DT)  # noqa: E731
    R = S.router_hidden
    return dict(wq=w(S.dq, S.hidden), wk=w(S.nkv, S.hidden), wv=w(S.nkv, S.hidden), wo=w(S.hidden, S.dq),
                wg=w(S.ffn, S.hidden), wu=w(S.ffn, S.hidden), wd=w(S.hidden, S.ffn),
                w1=w(R, S.dq), b1=torch.zeros(R, device=dev, dtype=DT), w2=w(3, R),
                b2=torch.zeros(3, device=dev, dtype=DT), gate=torch.tensor(0.5, device=dev, dtype=DT),
                bk=torch.zeros(S.nkv, device=dev, dtype=DT), bv=torch.zeros(S.nkv, device=dev, dtype=DT))


def rms(x):
    return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5).to(x.dtype)


def op_args(a, q, lw, sm, sc, slots) -> tuple:
    """The 16 arguments of ``route_fused_attention`` for layer weights ``lw`` (prefix mean)."""
    return (a, q, lw["w1"], lw["b1"], lw["w2"], lw["b2"], lw["gate"], sm, sc, slots, lw["wk"], lw["bk"], lw["wv"],
            lw["bv"], 0, 0.0)


def unfused_router(q, lw):
    return router_reference(q, lw["w1"].float(), lw["b1"].float(), lw["w2"].float(), lw["b2"].float(),
                            lw["gate"].float())


def unfused_summary(a, sm, sc, slots):
    m0 = sm[slots]
    m1 = m0 + (a.float() - m0) / (sc[slots] + 1).unsqueeze(1)
    sm[slots] = m1
    sc[slots] += 1
    return m1


def unfused_fuse_kv(a, lam, m1, lw):
    f = (lam[:, 0:1] * a.float() + lam[:, 1:2] * m1).to(DT)
    return f @ lw["wk"].T + lw["bk"], f @ lw["wv"].T + lw["bv"]


def unfused(a, q, lw, sm, sc, slots):
    """The op's math as ordinary torch ops (prefix mean), bf16 projections."""
    lam = unfused_router(q, lw)
    m1 = unfused_summary(a, sm, sc, slots)
    return (*unfused_fuse_kv(a, lam, m1, lw), lam)


def kv_of(mode: str, a, q, lw, sm, sc, slots):
    if mode == "base":
        return a @ lw["wk"].T, a @ lw["wv"].T
    if mode == "mka":
        return torch.ops.macattn.route_fused_attention(*op_args(a, q, lw, sm, sc, slots))[:2]
    if mode == "mka_v1":
        return RouteFusedV1(*op_args(a, q, lw, sm, sc, slots)).run()[:2]
    return unfused(a, q, lw, sm, sc, slots)[:2]


def attend(S: Shapes, q, kc, vc):
    B = q.shape[0]
    return F.scaled_dot_product_attention(q.view(B, S.q_heads, 1, S.head_dim), kc, vc, enable_gqa=True)


def make_step(S: Shapes, mode: str, layers, caches, states, x, slots, pos):
    B = x.shape[0]

    def step():
        h = x
        for lw, (kc, vc), (sm, sc) in zip(layers, caches, states):
            a = rms(h)
            q = a @ lw["wq"].T
            k, v = kv_of(mode, a, q, lw, sm, sc, slots)
            kc.index_copy_(2, pos, k.view(B, S.kv_heads, 1, S.head_dim))
            vc.index_copy_(2, pos, v.view(B, S.kv_heads, 1, S.head_dim))
            o = attend(S, q, kc, vc)
            h = h + o.reshape(B, S.dq) @ lw["wo"].T
            m = rms(h)
            h = h + (F.silu(m @ lw["wg"].T) * (m @ lw["wu"].T)) @ lw["wd"].T
        return h
    return step


def make_caches(S: Shapes, n: int, B: int, L: int, dev):
    caches = [(torch.randn(B, S.kv_heads, L, S.head_dim, device=dev, dtype=DT),
               torch.randn(B, S.kv_heads, L, S.head_dim, device=dev, dtype=DT)) for _ in range(n)]
    states = [(torch.zeros(B, S.hidden, device=dev), torch.full((B,), L - 1, device=dev, dtype=torch.int64))
              for _ in range(n)]
    return caches, states


# ---------------------------------------------------------------------------------------------
# bytes each stage must move (one layer), and the floor at the copy rate
# ---------------------------------------------------------------------------------------------
def stage_bytes(S: Shapes, B: int, L: int, n_split: int) -> dict[str, int]:
    """Bytes per layer each stage reads + writes at least (bf16 weights and activations, fp32 summary rows)."""
    D, Dq, N, R = S.hidden, S.dq, 2 * S.nkv, S.router_hidden
    routing = R * Dq * 2 + B * Dq * 2
    summary = B * D * (2 + 4 + 4)                                   # x, L2 row read + write
    fused_kv = N * D * 2 + B * D * (2 + 4) + B * N * 2               # both weights, x + L2 row, k / v
    part = n_split * B * max(16, R) * 4
    return {"norm+q_proj": Dq * D * 2 + B * D * 2 * 2 + B * Dq * 2,
            "kv_proj": N * D * 2 + B * D * 2 + B * N * 2,
            "route_update": routing + summary + part, "fuse_project": fused_kv + part,
            "v1_route_update_fuse": routing + summary + B * D * 4, "v1_project": N * D * 2 + B * D * 4 + B * N * 2,
            "routing_mlp": routing, "summary": summary, "fuse+kv_proj": fused_kv,
            "cache_write": 2 * 2 * B * S.nkv * 2,
            "attention": 2 * B * L * S.nkv * 2 + 2 * B * Dq * 2,
            "o_proj": D * Dq * 2 + B * (Dq + 2 * D) * 2,
            "mlp": 3 * S.ffn * D * 2 + B * D * 2 * 4}


MODE_STAGES = {"base": ("kv_proj",), "mka": ("route_update", "fuse_project"),
               "mka_v1": ("v1_route_update_fuse", "v1_project"), "mka_unfused": ("routing_mlp", "summary", "fuse+kv_proj")}


def stage_fns(S: Shapes, mode: str, layers, caches, states, x, slots, pos) -> dict[str, list]:
    """Per stage of ``mode``'s step, one callable per layer over that layer's weights, cache and state rows
    (inputs computed once here; each callable does exactly what that stage of ``make_step`` does)."""
    B = x.shape[0]
    a = rms(x)
    per = []
    for lw, (kc, vc), (sm, sc) in zip(layers, caches, states):
        q = a @ lw["wq"].T
        k, v = a @ lw["wk"].T, a @ lw["wv"].T
        lam = unfused_router(q, lw)
        m1 = sm[slots].clone()
        plan = RouteFusedPlan(*op_args(a, q, lw, sm, sc, slots))
        v1 = RouteFusedV1(*op_args(a, q, lw, sm, sc, slots))
        o = attend(S, q, kc, vc).reshape(B, S.dq)
        per.append(dict(lw=lw, q=q, k=k, v=v, kc=kc, vc=vc, sm=sm, sc=sc, lam=lam, m1=m1, plan=plan, v1=v1, o=o))
    common = {
        "norm+q_proj": lambda p: rms(x) @ p["lw"]["wq"].T,
        "cache_write": lambda p: (p["kc"].index_copy_(2, pos, p["k"].view(B, S.kv_heads, 1, S.head_dim)),
                                  p["vc"].index_copy_(2, pos, p["v"].view(B, S.kv_heads, 1, S.head_dim))),
        "attention": lambda p: attend(S, p["q"], p["kc"], p["vc"]),
        "o_proj": lambda p: x + p["o"] @ p["lw"]["wo"].T,
        "mlp": lambda p: (lambda m: x + (F.silu(m @ p["lw"]["wg"].T) * (m @ p["lw"]["wu"].T)) @ p["lw"]["wd"].T)(rms(x)),
    }
    own = {
        "kv_proj": lambda p: (a @ p["lw"]["wk"].T, a @ p["lw"]["wv"].T),
        "route_update": lambda p: p["plan"].route_update(),
        "fuse_project": lambda p: p["plan"].fuse_project(),
        "v1_route_update_fuse": lambda p: p["v1"].route(),
        "v1_project": lambda p: p["v1"].project(),
        "routing_mlp": lambda p: unfused_router(p["q"], p["lw"]),
        "summary": lambda p: unfused_summary(a, p["sm"], p["sc"], slots),
        "fuse+kv_proj": lambda p: unfused_fuse_kv(a, p["lam"], p["m1"], p["lw"]),
    }
    order = ["norm+q_proj", *MODE_STAGES[mode], "cache_write", "attention", "o_proj", "mlp"]
    table = {**common, **own}
    return {name: [lambda p=p, f=table[name]: f(p) for p in per] for name in order}


# ---------------------------------------------------------------------------------------------
# sections
# ---------------------------------------------------------------------------------------------
def op_inputs(S: Shapes, layers, B: int, dev):
    x = torch.randn(B, S.hidden, device=dev, dtype=DT)
    slots = torch.arange(B, device=dev)
    a = rms(x)
    qs = [a @ lw["wq"].T for lw in layers]
    states = [(torch.randn(B, S.hidden, device=dev), torch.randint(1, 100, (B,), device=dev)) for _ in layers]
    return a, qs, states, slots


def op_rel_err(fn, a, q, lw, slots, B, S: Shapes, dev) -> float:
    """|k - k_ref| / |k_ref| of ``fn(*op_args)`` against the fp64 reference, on fresh state rows."""
    m, c = torch.randn(B, S.hidden, device=dev), torch.randint(1, 100, (B,), device=dev)
    m2, c2 = m.double(), c.clone()
    k = fn(*op_args(a, q, lw, m, c, slots))[0]
    args = [t.double() if torch.is_tensor(t) and t.is_floating_point() else t for t in op_args(a, q, lw, m, c, slots)]
    args[7], args[8] = m2, c2
    k_r = route_fused_decode_reference(*args, compute_dtype=torch.float64)[0]
    return ((k.double() - k_r).norm() / k_r.norm()).item()


def op_alone(S: Shapes, layers, B: int, reps: int, dev) -> dict:
    """The op per layer (rotated over every layer): the torch op (current kernels), v1, the unfused torch math."""
    a, qs, states, slots = op_inputs(S, layers, B, dev)
    n = len(layers)
    calls = {
        "op_triton_us": lambda i: torch.ops.macattn.route_fused_attention(*op_args(a, qs[i], layers[i], *states[i], slots)),
        "op_v1_us": lambda i: RouteFusedV1(*op_args(a, qs[i], layers[i], *states[i], slots)).run(),
        "op_unfused_torch_us": lambda i: unfused(a, qs[i], layers[i], *states[i], slots),
    }
    row = {"batch": B, "layers_rotated": n}
    for name, call in calls.items():
        row[name] = per_call_us([lambda i=i, c=call: c(i) for i in range(n)], reps)
    row["op_over_unfused"] = row["op_triton_us"] / row["op_unfused_torch_us"]
    from macattn.plugins.route_fused.op import route_fused_attention_triton
    row["k_rel_err_vs_fp64"] = op_rel_err(route_fused_attention_triton, a, qs[0], layers[0], slots, B, S, dev)
    row["k_rel_err_vs_fp64_v1"] = op_rel_err(lambda *t: RouteFusedV1(*t).run(), a, qs[0], layers[0], slots, B, S, dev)
    print(f"op B={B}: triton {row['op_triton_us']:.1f} us  v1 {row['op_v1_us']:.1f} us  unfused torch "
          f"{row['op_unfused_torch_us']:.1f} us  ({row['op_over_unfused']:.3f}x)  rel err {row['k_rel_err_vs_fp64']:.2e}"
          f" (v1 {row['k_rel_err_vs_fp64_v1']:.2e})", flush=True)
    return row


def grid(S: Shapes, layers, batches, contexts, reps: int, dev) -> tuple[list, list]:
    rows, op_rows = [], []
    n = len(layers)
    for B in batches:
        op_rows.append(op_alone(S, layers, B, reps, dev))
        x = torch.randn(B, S.hidden, device=dev, dtype=DT)
        slots = torch.arange(B, device=dev)
        for L in contexts:
            caches, states = make_caches(S, n, B, L, dev)
            pos = torch.tensor([L - 1], device=dev)
            row = dict(batch=B, context=L, layers=n)
            for mode in MODES:
                row[f"{mode}_step_us"] = per_call_us([make_step(S, mode, layers, caches, states, x, slots, pos)], reps)
            kv = n * 2 * L * S.nkv * torch.finfo(DT).bits // 8
            row["kv_bytes_per_request_base"] = kv
            row["kv_bytes_per_request_mka"] = kv + n * (S.hidden * 4 + 8)
            row["kv_bytes_ratio_mka_over_base"] = row["kv_bytes_per_request_mka"] / kv
            row["mka_over_base_latency"] = row["mka_step_us"] / row["base_step_us"]
            row["mka_unfused_over_base_latency"] = row["mka_unfused_step_us"] / row["base_step_us"]
            rows.append(row)
            print(f"B={B:2d} ctx={L:6d}  base {row['base_step_us']:8.1f} us  mka {row['mka_step_us']:8.1f} us "
                  f"({row['mka_over_base_latency']:.3f}x)  unfused {row['mka_unfused_step_us']:8.1f} us "
                  f"({row['mka_unfused_over_base_latency']:.3f}x)  KV/request {kv / 2**20:.1f} MiB "
                  f"(+{n * (S.hidden * 4 + 8)} B state)", flush=True)
            del caches, states
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    return rows, op_rows


def profile(S: Shapes, layers, points, reps: int, copy_bw, dev) -> list:
    out = []
    n = len(layers)
    for B, L in points:
        x = torch.randn(B, S.hidden, device=dev, dtype=DT)
        slots = torch.arange(B, device=dev)
        caches, states = make_caches(S, n, B, L, dev)
        pos = torch.tensor([L - 1], device=dev)
        n_split = RouteFusedPlan(*op_args(rms(x), rms(x) @ layers[0]["wq"].T, layers[0], *states[0], slots)).n_split
        nbytes = stage_bytes(S, B, L, n_split)
        res = {"batch": B, "context": L, "layers": n, "modes": {}}
        for mode in PROFILE_MODES:
            stages = {name: per_call_us(fns, reps)
                      for name, fns in stage_fns(S, mode, layers, caches, states, x, slots, pos).items()}
            step = per_call_us([make_step(S, mode, layers, caches, states, x, slots, pos)], reps) / n
            res["modes"][mode] = {"stages_us_per_layer": stages, "sum_of_stages_us": sum(stages.values()),
                                  "step_us_per_layer": step}
        res["bytes_per_layer"] = {k: nbytes[k] for k in {s for m in res["modes"].values() for s in m["stages_us_per_layer"]}}
        res["floor_us_per_layer"] = ({k: v / copy_bw * 1e6 for k, v in res["bytes_per_layer"].items()} if copy_bw else None)
        out.append(res)
        print_profile(res)
        del caches, states
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return out


def print_profile(res: dict) -> None:
    modes = list(res["modes"])
    names = []
    for m in modes:
        names += [s for s in res["modes"][m]["stages_us_per_layer"] if s not in names]
    fl = res["floor_us_per_layer"]
    print(f"\nprofile B={res['batch']} ctx={res['context']} (µs per layer, {res['layers']} layers rotated)")
    print(f"{'stage':22s}" + "".join(f"{m:>13s}" for m in modes) + f"{'MiB':>9s}{'floor':>9s}")
    for s in names:
        cells = "".join(f"{res['modes'][m]['stages_us_per_layer'][s]:13.1f}" if s in res["modes"][m]["stages_us_per_layer"]
                        else f"{'':13s}" for m in modes)
        print(f"{s:22s}{cells}{res['bytes_per_layer'][s] / 2**20:9.2f}" + (f"{fl[s]:9.1f}" if fl else f"{'-':>9s}"))
    print(f"{'sum of stages':22s}" + "".join(f"{res['modes'][m]['sum_of_stages_us']:13.1f}" for m in modes))
    print(f"{'whole step / layers':22s}" + "".join(f"{res['modes'][m]['step_us_per_layer']:13.1f}" for m in modes))
    base = res["modes"]["base"]["step_us_per_layer"]
    print(f"{'step / base':22s}" + "".join(f"{res['modes'][m]['step_us_per_layer'] / base:13.3f}" for m in modes), flush=True)


def sweep(S: Shapes, layers, batches, reps: int, dev, configs) -> list:
    """Each kernel's launch constants alone (per layer, rotated over every layer), then the op with the best
    route and best project constants against ``DEFAULT_LAUNCH``."""
    route_cfgs, project_cfgs = configs
    out = []
    n = len(layers)
    for B in batches:
        a, qs, states, slots = op_inputs(S, layers, B, dev)

        def plans(launch):
            return [RouteFusedPlan(*op_args(a, qs[i], layers[i], *states[i], slots), launch=launch) for i in range(n)]

        def timed(launch, what):
            try:
                return per_call_us([getattr(p, what) for p in plans(launch)], reps)
            except Exception as e:  # noqa: BLE001  (a configuration that does not compile is a row, not the end)
                print(f"  {launch}: {type(e).__name__}: {e}"[:300], flush=True)
                return None

        rows = {"batch": B, "route_update": [], "fuse_project": []}
        for kw in route_cfgs:
            launch = dataclasses.replace(DEFAULT_LAUNCH, **kw)
            rows["route_update"].append({**kw, "us": timed(launch, "route_update")})
        for kw in project_cfgs:
            launch = dataclasses.replace(DEFAULT_LAUNCH, **kw)
            rows["fuse_project"].append({**kw, "us": timed(launch, "fuse_project")})
        best = {}
        for kernel in ("route_update", "fuse_project"):
            ok = [r for r in rows[kernel] if r["us"] is not None]
            best[kernel] = min(ok, key=lambda r: r["us"]) if ok else {"us": None}
            for r in rows[kernel]:
                print(f"  B={B} {kernel:13s} " + " ".join(f"{k}={v}" for k, v in r.items() if k != "us")
                      + (f"  {r['us']:8.2f} us" if r["us"] is not None else "  failed"), flush=True)
        pick = {k: v for b in best.values() for k, v in b.items() if k != "us"}
        best_launch = dataclasses.replace(DEFAULT_LAUNCH, **pick)
        rows["best_launch"] = dataclasses.asdict(best_launch)
        rows["op_best_us"] = timed(best_launch, "run")
        rows["op_default_us"] = timed(DEFAULT_LAUNCH, "run")
        rows["default_launch"] = dataclasses.asdict(DEFAULT_LAUNCH)
        print(f"sweep B={B}: best {best_launch}  op {rows['op_best_us']} us  (default {rows['op_default_us']} us)",
              flush=True)
        out.append(rows)
    return out


def versions(dev) -> dict:
    import triton
    v = {"torch": torch.__version__, "python": platform.python_version(), "triton": triton.__version__,
         "cuda": torch.version.cuda}
    if dev.type == "cuda":
        v["sms"] = torch.cuda.get_device_properties(dev).multi_processor_count
    return v


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--grid", action="store_true", help="the step grid and the op alone (default when no section)")
    ap.add_argument("--profile", action="store_true", help="per-stage profile at --profile-points")
    ap.add_argument("--sweep", action="store_true", help="the op's launch-constant sweep")
    ap.add_argument("--contexts", default="4096,8192,16384,32768")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--profile-points", default="1x32768,8x32768", help="BxCONTEXT,...")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--quick", action="store_true", help="contexts 4096,32768, batch 1, 4 layers")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU (Triton interpreter); no timing")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/bench_mka_decode.json; "
                                                "a temp file for --dry-run)")
    args = ap.parse_args()
    if args.dry_run:
        args.grid = args.profile = args.sweep = True
    elif not (args.grid or args.profile or args.sweep):
        args.grid = True
    S = Shapes()
    if args.quick:
        args.contexts, args.batches, args.layers = "4096,32768", "1", 4
    sweep_cfgs = (SWEEP_ROUTE, SWEEP_PROJECT)
    if args.dry_run:
        S, args.layers, args.reps, sweep_cfgs = TINY, 2, 1, SWEEP_DRY
        args.contexts, args.batches, args.profile_points = "32", "1,3", "1x32,3x32"
        args.out = args.out or str(Path(tempfile.gettempdir()) / "bench_mka_decode_dry.json")
    out_path = Path(args.out or "benchmarks/results/bench_mka_decode.json")
    dev = torch.device("cpu" if args.dry_run else "cuda")
    torch.manual_seed(0)
    t0 = time.time()
    layers = [make_layer(S, i, dev) for i in range(args.layers)]
    batches = [int(b) for b in args.batches.split(",")]
    copy_bw = copy_bandwidth(dev)
    out = dict(device=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (dry run)", versions=versions(dev),
               shapes=dict(dataclasses.asdict(S), dtype=str(DT)), layers=args.layers, copy_bw_bytes_per_s=copy_bw,
               timing="CUDA-graph replay median, CUDA events; per layer = one graph over every layer's stage / layers",
               reps=args.reps, default_launch=dataclasses.asdict(DEFAULT_LAUNCH))
    if copy_bw:
        print(f"D2D copy: {copy_bw / 1e12:.2f} TB/s (read + write)", flush=True)
    if args.sweep:
        out["sweep"] = sweep(S, layers, batches, args.reps, dev, sweep_cfgs)
    if args.grid:
        out["rows"], out["op"] = grid(S, layers, batches, [int(c) for c in args.contexts.split(",")], args.reps, dev)
    if args.profile:
        points = [tuple(int(v) for v in p.split("x")) for p in args.profile_points.split(",")]
        out["profile"] = profile(S, layers, points, args.reps, copy_bw, dev)
    out["seconds"] = time.time() - t0
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(out, indent=1))
    print("wrote", out_path)


if __name__ == "__main__":
    main()
