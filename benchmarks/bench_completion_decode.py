"""Retrieval-completion decode attention on the GPU vs full-attention decode (FlashInfer 0.2.7, SDPA).

One attention layer's decode step, LLaMA-3.1-8B shapes (32 query heads, 8 KV heads, d=128, bf16 K/V),
``F = 64`` features, B requests whose prefill holds ``context`` tokens (sink 16, tail 64, 8 generated):

  ours          ``macattn::retrieval_completion`` (Triton mid logits -> torch.topk -> split-K exact +
                subtraction partials -> merge with the completion), Top-k = ``--frac`` of the mid region
  ours_logits   the first two launches alone (exhaustive mid logits + Top-k): the selection cost;
                ``of_which_topk`` is ``torch.topk`` alone on logits of that shape
  flashinfer    BatchDecodeWithPagedKVCacheWrapper (NHD, page 16, tensor cores), planned once
  sdpa          F.scaled_dot_product_attention(enable_gqa=True) over the contiguous cache

Every figure is a CUDA-graph replay median (CUDA events). The exhaustive selector reads every mid
key, so the step reads about half the KV bytes of full attention (K only, plus the retrieved V and
``log φ_k`` rows and the cache): this measures what that costs, it does not claim the paper's
token-equivalent budget in time. Checks: with ``top_k >= |mid|`` ours equals exact attention
(vs FlashInfer and SDPA on the same data); with the fraction, ours vs the fp64 reference on one
row (contexts up to 32K).

Usage: python benchmarks/bench_completion_decode.py [--quick] [--out benchmarks/results/bench_completion_decode.json]
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import macattn.methods.completion.ops  # noqa: F401
from macattn.methods.kernels import register_kernels

register_kernels()   # the Triton kernels as the ops' CUDA impls
from macattn.methods.completion.reference import retrieval_completion_step
from macattn.plugins.retrieval_completion import op as rc_op
from macattn.plugins.retrieval_completion.op import mid_topk_triton

from cuda_timing import time_graph

HQ, HKV, D, FEAT, PAGE = 32, 8, 128, 64, 16
N_SINK, N_TAIL, GEN = 16, 64, 8
DT = torch.bfloat16


def rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def make_problem(B: int, ctx: int, gen: torch.Generator, dev):
    T = ctx + GEN
    k = torch.randn(B, HKV, T, D, generator=gen, device=dev).mul_(1.5).to(DT)
    v = torch.randn(B, HKV, T, D, generator=gen, device=dev).to(DT)
    lpk = torch.randn(B, HKV, T, FEAT, generator=gen, device=dev).mul_(0.5)
    q = torch.randn(B, HQ, D, generator=gen, device=dev).to(DT)
    lpq = torch.randn(B, HQ, FEAT, generator=gen, device=dev).mul_(0.5)
    npf = torch.full((B,), ctx, device=dev, dtype=torch.int64)
    sl = torch.full((B,), T, device=dev, dtype=torch.int64)
    comp = torch.ops.macattn.completion_cache(lpk, v, npf, N_SINK, N_TAIL)
    return dict(q=q, k=k, v=v, sl=sl, npf=npf, lpq=lpq, lpk=lpk, comp=comp, T=T)


def flashinfer_step(p, B):
    import flashinfer

    dev = p["q"].device
    T = p["T"]
    per = -(-T // PAGE)
    pad = per * PAGE - T

    def paged(x):   # [B, Hkv, T, d] -> [B·per, PAGE, Hkv, d]
        x = F.pad(x, (0, 0, 0, pad))
        return x.permute(0, 2, 1, 3).reshape(B * per, PAGE, HKV, D).contiguous()

    kp, vp = paged(p["k"]), paged(p["v"])
    ws = torch.empty(128 * 2 ** 20, dtype=torch.uint8, device=dev)
    indptr = torch.arange(0, (B + 1) * per, per, dtype=torch.int32, device=dev)
    indices = torch.arange(B * per, dtype=torch.int32, device=dev)
    last = torch.full((B,), PAGE - pad, dtype=torch.int32, device=dev)
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        ws, "NHD", use_cuda_graph=True, use_tensor_cores=True, paged_kv_indptr_buffer=torch.empty_like(indptr),
        paged_kv_indices_buffer=torch.empty_like(indices), paged_kv_last_page_len_buffer=torch.empty_like(last))
    w.plan(indptr, indices, last, HQ, HKV, D, PAGE, q_data_type=DT, kv_data_type=DT)
    out = torch.empty(B, HQ, D, dtype=DT, device=dev)
    return (lambda: w.run(p["q"], (kp, vp), out=out)), out, (kp, vp, ws)


SWEEP = [dict(BLOCK_K=bk, num_warps=w, WAVES=waves, MIN_ITEMS=128) for bk in (32, 64) for w in (4, 8)
         for waves in (1, 2, 4)]


def time_topk(B: int, T: int, k: int, reps: int) -> float:
    """``torch.topk`` alone on ``[B, Hq, T]`` fp32 logits, as the op calls it."""
    logits = torch.randn(B, HQ, T, device="cuda")
    return time_graph(lambda: torch.topk(logits, k, dim=-1, sorted=False), reps)


def run_point(B: int, ctx: int, frac: float, reps: int, fi_ok: bool, sweep: bool) -> dict:
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(B * 1_000_003 + ctx)
    p = make_problem(B, ctx, gen, dev)
    mid = ctx - N_SINK - N_TAIL
    top_k = max(1, int(frac * mid))
    args = lambda k: (p["q"], p["k"], p["v"], p["sl"], p["npf"], p["lpq"], p["lpk"], *p["comp"],  # noqa: E731
                      N_SINK, N_TAIL, k, 0.0)
    row = dict(batch=B, context=ctx, top_k=top_k, mid=mid,
               exact_tokens_per_head=N_SINK + N_TAIL + GEN + top_k,
               exact_fraction=(N_SINK + N_TAIL + GEN + top_k) / p["T"])
    row["ours_us"] = time_graph(lambda: torch.ops.macattn.retrieval_completion(*args(top_k)), reps)
    row["ours_launch"] = dict(rc_op.DECODE_LAUNCH, splits=rc_op.num_splits(B * HQ, top_k + N_SINK + N_TAIL, "cuda"))
    if sweep:
        default = dict(rc_op.DECODE_LAUNCH)
        row["sweep"] = []
        for cfg in SWEEP:
            rc_op.DECODE_LAUNCH = cfg
            row["sweep"].append(dict(cfg, us=time_graph(lambda: torch.ops.macattn.retrieval_completion(*args(top_k)),
                                                         reps)))
        rc_op.DECODE_LAUNCH = default
    row["ours_logits_topk_us"] = time_graph(
        lambda: mid_topk_triton(p["q"], p["k"], p["npf"], N_SINK, N_TAIL, top_k, D ** -0.5), reps)
    row["of_which_topk_us"] = time_topk(B, p["T"], top_k, reps)
    q4 = p["q"].unsqueeze(2)
    row["sdpa_us"] = time_graph(lambda: F.scaled_dot_product_attention(q4, p["k"], p["v"], enable_gqa=True), reps)
    exact = torch.ops.macattn.retrieval_completion(*args(mid))      # top_k covers the mid: exact attention
    sdpa_out = F.scaled_dot_product_attention(q4, p["k"], p["v"], enable_gqa=True)[:, :, 0]
    row["check_exact_vs_sdpa_rel"] = rel(exact, sdpa_out)
    if fi_ok:
        try:
            fn, fi_out, keep = flashinfer_step(p, B)
            row["flashinfer_us"] = time_graph(fn, reps)
            fn()
            row["check_exact_vs_flashinfer_rel"] = rel(exact, fi_out)
            del keep
        except Exception as e:  # noqa: BLE001  (recorded, the other figures still count)
            row["flashinfer_error"] = f"{type(e).__name__}: {e}"[:400]
    if ctx <= 32768:    # the fp64 reference of one row (on the GPU, fp64)
        out = torch.ops.macattn.retrieval_completion(*args(top_k))
        one = lambda t: t[:1]  # noqa: E731
        ref = retrieval_completion_step(one(p["q"]), one(p["k"]), one(p["v"]), one(p["sl"]), one(p["npf"]),
                                        one(p["lpq"]), one(p["lpk"]), *(one(c) for c in p["comp"]), n_sink=N_SINK,
                                        n_tail=N_TAIL, top_k=top_k)
        row["check_ours_vs_fp64_reference_rel_row0"] = rel(out[:1], ref)
    peer = row.get("flashinfer_us", row["sdpa_us"])
    row["speedup_vs_flashinfer" if "flashinfer_us" in row else "speedup_vs_sdpa"] = peer / row["ours_us"]
    return row


def versions() -> dict:
    v = dict(torch=torch.__version__, cuda=torch.version.cuda, python=platform.python_version(),
             triton=__import__("triton").__version__)
    try:
        import flashinfer
        v["flashinfer"] = flashinfer.__version__
    except Exception as e:  # noqa: BLE001
        v["flashinfer"] = f"unavailable: {type(e).__name__}"
    return v


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="32768,131072")
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--frac", type=float, default=0.02, help="Top-k as a fraction of the mid region")
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--quick", action="store_true", help="context 32768, batch 1")
    ap.add_argument("--no-flashinfer", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="also time the decode kernel's launch alternatives")
    ap.add_argument("--out", default="benchmarks/results/bench_completion_decode.json")
    args = ap.parse_args()
    if args.quick:
        args.contexts, args.batches = "32768", "1"
    t0 = time.time()
    rows = []
    print(f"{'B':>2} {'ctx':>7} {'top_k':>6} {'ours us':>9} {'sel us':>8} {'FI us':>8} {'sdpa us':>8} {'x FI':>6}"
          f" {'rel(ref)':>9}")
    for B in [int(b) for b in args.batches.split(",")]:
        for ctx in [int(c) for c in args.contexts.split(",")]:
            r = run_point(B, ctx, args.frac, args.reps, fi_ok=not args.no_flashinfer, sweep=args.sweep)
            torch.cuda.empty_cache()
            rows.append(r)
            print(f"{B:>2} {ctx:>7} {r['top_k']:>6} {r['ours_us']:>9.1f} {r['ours_logits_topk_us']:>8.1f} "
                  f"{r.get('flashinfer_us', float('nan')):>8.1f} {r['sdpa_us']:>8.1f} "
                  f"{r.get('speedup_vs_flashinfer', float('nan')):>6.2f} "
                  f"{r.get('check_ours_vs_fp64_reference_rel_row0', float('nan')):>9.2e}")
    out = dict(device=torch.cuda.get_device_name(), versions=versions(),
               shapes=dict(q_heads=HQ, kv_heads=HKV, head_dim=D, features=FEAT, n_sink=N_SINK, n_tail=N_TAIL,
                           generated=GEN, kv_dtype=str(DT), frac=args.frac),
               timing="CUDA-graph replay median, CUDA events", reps=args.reps, rows=rows, seconds=time.time() - t0)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print("wrote", args.out)


if __name__ == "__main__":
    main()
