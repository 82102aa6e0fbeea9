"""FastMKA decode on the GPU vs the unmodified model: step latency and KV bytes at 4K-32K context.

Plain torch (no transformers) LLaMA-3.1-8B-shaped decoder layers (hidden 4096, 32 query heads,
8 KV heads, d=128, FFN 14336, RMSNorm, bf16; RoPE left out of both, it costs the same), ``--layers``
of them, one decode step for a batch of B requests whose KV caches hold ``context`` tokens:

  base      unmodified: q/k/v projections, cache write, SDPA (enable_gqa), o-proj, MLP
  mka       FastMKA: q projection, ``macattn::route_fused_attention`` (Triton: routing MLP 4096->64->3,
            L2 prefix-mean update, fused K/V projection), cache write, SDPA, o-proj, MLP
  mka_unfused  same with the step composed of ordinary torch ops in bf16 (router, state update,
            fuse, two cuBLAS projections): what FastMKA costs without the fused op

and the op alone (triton vs the unfused torch ops). Every figure is a CUDA-graph replay median (CUDA events).
KV bytes per request: K/V cache (identical shapes: the cache stores the fused K/V) plus FastMKA's
per-request L2 state (``D`` fp32 + one int64 per layer).

Usage: python benchmarks/bench_mka_decode.py [--quick] [--out benchmarks/results/bench_mka_decode.json]
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from macattn.methods.kernels import register_kernels

register_kernels()   # the Triton kernel as the op's CUDA impl
from macattn.methods.mka.reference import route_fused_decode_reference, router_reference
from macattn.methods.mka import ops as ops_mka  # noqa: F401

from cuda_timing import time_graph

HIDDEN, HQ, HKV, HD, FFN, R = 4096, 32, 8, 128, 14336, 64
DT = torch.bfloat16


def make_layer(gen_seed: int, dev) -> dict:
    g = torch.Generator(device=dev).manual_seed(gen_seed)
    w = lambda o, i: (torch.randn(o, i, generator=g, device=dev) / i ** 0.5).to(DT)  # noqa: E731
    return dict(wq=w(HQ * HD, HIDDEN), wk=w(HKV * HD, HIDDEN), wv=w(HKV * HD, HIDDEN), wo=w(HIDDEN, HQ * HD),
                wg=w(FFN, HIDDEN), wu=w(FFN, HIDDEN), wd=w(HIDDEN, FFN),
                w1=w(R, HQ * HD), b1=torch.zeros(R, device=dev, dtype=DT), w2=w(3, R),
                b2=torch.zeros(3, device=dev, dtype=DT), gate=torch.tensor(0.5, device=dev, dtype=DT),
                bk=torch.zeros(HKV * HD, device=dev, dtype=DT), bv=torch.zeros(HKV * HD, device=dev, dtype=DT))


def rms(x):
    return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5).to(x.dtype)


def unfused(a, q, lw, sm, sc, slots):
    """The op's math as ordinary torch ops (prefix mean), bf16 projections."""
    lam = router_reference(q, lw["w1"].float(), lw["b1"].float(), lw["w2"].float(), lw["b2"].float(), lw["gate"].float())
    m0 = sm[slots]
    m1 = m0 + (a.float() - m0) / (sc[slots] + 1).unsqueeze(1)
    sm[slots] = m1
    sc[slots] += 1
    f = (lam[:, 0:1] * a.float() + lam[:, 1:2] * m1).to(DT)
    return f @ lw["wk"].T + lw["bk"], f @ lw["wv"].T + lw["bv"], lam


def make_step(mode: str, layers, caches, states, x, slots, pos):
    B = x.shape[0]

    def step():
        h = x
        for lw, (kc, vc), (sm, sc) in zip(layers, caches, states):
            a = rms(h)
            q = a @ lw["wq"].T
            if mode == "base":
                k, v = a @ lw["wk"].T, a @ lw["wv"].T
            elif mode == "mka":
                k, v, _ = torch.ops.macattn.route_fused_attention(a, q, lw["w1"], lw["b1"], lw["w2"], lw["b2"], lw["gate"],
                                                                  sm, sc, slots, lw["wk"], lw["bk"], lw["wv"], lw["bv"], 0, 0.0)
            else:
                k, v, _ = unfused(a, q, lw, sm, sc, slots)
            kc.index_copy_(2, pos, k.view(B, HKV, 1, HD))
            vc.index_copy_(2, pos, v.view(B, HKV, 1, HD))
            o = F.scaled_dot_product_attention(q.view(B, HQ, 1, HD), kc, vc, enable_gqa=True)
            h = h + o.reshape(B, HQ * HD) @ lw["wo"].T
            m = rms(h)
            h = h + (F.silu(m @ lw["wg"].T) * (m @ lw["wu"].T)) @ lw["wd"].T
        return h
    return step


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="4096,8192,16384,32768")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--quick", action="store_true", help="contexts 4096,32768, batch 1, 2 layers")
    ap.add_argument("--out", default="benchmarks/results/bench_mka_decode.json")
    args = ap.parse_args()
    if args.quick:
        args.contexts, args.batches, args.layers = "4096,32768", "1", 2
    dev = torch.device("cuda")
    torch.manual_seed(0)
    layers = [make_layer(i, dev) for i in range(args.layers)]
    rows, op_rows = [], []
    t0 = time.time()
    for B in [int(b) for b in args.batches.split(",")]:
        x = torch.randn(B, HIDDEN, device=dev, dtype=DT)
        slots = torch.arange(B, device=dev)
        # op alone + correctness on these shapes
        lw = layers[0]
        a, q = rms(x), rms(x) @ lw["wq"].T
        st = lambda: (torch.randn(B, HIDDEN, device=dev), torch.randint(1, 100, (B,), device=dev))  # noqa: E731
        (m1, c1), (m2, c2) = st(), st()
        m2.copy_(m1)
        c2.copy_(c1)
        opargs = lambda m, c: (a, q, lw["w1"], lw["b1"], lw["w2"], lw["b2"], lw["gate"], m, c, slots,  # noqa: E731
                               lw["wk"], lw["bk"], lw["wv"], lw["bv"], 0, 0.0)
        k_t, _, _ = torch.ops.macattn.route_fused_attention(*opargs(m1, c1))
        k_r, _, _ = route_fused_decode_reference(*[t.double() if torch.is_tensor(t) and t.is_floating_point() and t is not m2
                                                   else t for t in opargs(m2, c2)], compute_dtype=torch.float64)
        rel = ((k_t.double() - k_r).norm() / k_r.norm()).item()
        op_rows.append(dict(batch=B, op_triton_us=time_graph(lambda: torch.ops.macattn.route_fused_attention(*opargs(m1, c1)), args.reps),
                            op_unfused_torch_us=time_graph(lambda: unfused(a, q, lw, m1, c1, slots), args.reps),
                            k_rel_err_vs_fp64=rel))
        print(f"op B={B}: triton {op_rows[-1]['op_triton_us']:.1f} us  unfused torch {op_rows[-1]['op_unfused_torch_us']:.1f} us"
              f"  rel err {rel:.2e}")
        for L in [int(c) for c in args.contexts.split(",")]:
            caches = [(torch.randn(B, HKV, L, HD, device=dev, dtype=DT), torch.randn(B, HKV, L, HD, device=dev, dtype=DT))
                      for _ in layers]
            states = [(torch.zeros(B, HIDDEN, device=dev), torch.full((B,), L - 1, device=dev, dtype=torch.int64))
                      for _ in layers]
            pos = torch.tensor([L - 1], device=dev)
            row = dict(batch=B, context=L, layers=args.layers)
            for mode in ("base", "mka", "mka_unfused"):
                row[f"{mode}_step_us"] = time_graph(make_step(mode, layers, caches, states, x, slots, pos), args.reps)
            kv = args.layers * 2 * L * HKV * HD * torch.finfo(DT).bits // 8
            row["kv_bytes_per_request_base"] = kv
            row["kv_bytes_per_request_mka"] = kv + args.layers * (HIDDEN * 4 + 8)
            row["kv_bytes_ratio_mka_over_base"] = row["kv_bytes_per_request_mka"] / kv
            row["mka_over_base_latency"] = row["mka_step_us"] / row["base_step_us"]
            rows.append(row)
            print(f"B={B:2d} ctx={L:6d}  base {row['base_step_us']:8.1f} us  mka {row['mka_step_us']:8.1f} us "
                  f"({row['mka_over_base_latency']:.3f}x)  unfused {row['mka_unfused_step_us']:8.1f} us  "
                  f"KV/request {kv / 2**20:.1f} MiB (+{args.layers * (HIDDEN * 4 + 8)} B state)")
            del caches, states
            torch.cuda.empty_cache()
    out = dict(device=torch.cuda.get_device_name(), versions=dict(torch=torch.__version__, python=platform.python_version(),
               triton=__import__("triton").__version__, cuda=torch.version.cuda),
               shapes=dict(hidden=HIDDEN, q_heads=HQ, kv_heads=HKV, head_dim=HD, ffn=FFN, router_hidden=R, dtype=str(DT)),
               timing="CUDA-graph replay median, CUDA events", reps=args.reps, rows=rows, op=op_rows,
               seconds=time.time() - t0)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print("wrote", args.out)


if __name__ == "__main__":
    main()
