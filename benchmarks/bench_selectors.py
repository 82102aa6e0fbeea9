"""The new selection kernels alone, against what they replace, as CUDA-graph replays (H100):

* MAC's match: the exact match (``MacMatchLauncher``, streams the bf16 ring) vs the two-stage match
  (``TwoStageMatchLauncher``: top-C over a sketch ring, exact distances of the C) per sketch,
  LLaMA-3.1-8B attention shapes (32 query heads, d = 128), ring K = 1024, B in {1, 8, 32};
* the offloaded decode's page selector (``select_pages``: Quest bounds per KV head + radix select)
  vs ``torch.topk`` over the same bounds' scores, 8 KV heads, 16-token pages, 32K / 128K contexts.

    python benchmarks/bench_selectors.py            # GPU: table + benchmarks/results/bench_selectors_<gpu>.json
    python benchmarks/bench_selectors.py --dry-run  # CPU: tiny shapes through Triton's interpreter, checked
                                                    # against the references, no timing

Bytes per call: what each kernel must read (ring or sketch ring + the C candidates' entries; the
page bounds), and the fraction of the H100's 3.35 TB/s that the time reaches.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

if "--dry-run" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"      # before any kernel is defined

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cuda_timing import replay_us  # noqa: E402

from macattn.methods.completion.reference import page_bounds, page_upper_bounds, select_pages_reference  # noqa: E402
from macattn.methods.mac.match_sketch import sketch, sketch_dtype, sketch_projection_of  # noqa: E402
from macattn.methods.mac.reference import mac_match_reference, mac_match_two_stage_reference  # noqa: E402

HBM_BYTES_PER_S = 3.35e12
SKETCHES = (("fp8", 4), ("proj32", 16), ("proj32_fp8", 16))


def match_problem(B, Hq, K, d, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    qring = torch.randn(B, Hq, K, d, generator=g).to(torch.bfloat16)
    m = 4 * K
    t = torch.arange(m - K, m)
    ring_pos = torch.empty(B, K, dtype=torch.int64)
    ring_pos[:, t % K] = t
    lse = torch.randn(B, Hq, K, generator=g)
    q = (qring[:, :, 7].float() + 0.05 * torch.randn(B, Hq, d, generator=g)).to(torch.bfloat16)
    host = (q, qring, lse, ring_pos, torch.arange(B), torch.full((B,), m))
    return host, tuple(x.to(device) for x in host)


def bench_match(points, reps, device, dry) -> list[dict]:
    from macattn.plugins.triton_util import num_sms
    from macattn.plugins.mac.match_op import MacMatchLauncher, TwoStageMatchLauncher
    from macattn.plugins.mac.two_stage import two_stage_meta

    rows, exact, two = [], MacMatchLauncher(), TwoStageMatchLauncher()
    for B, Hq, K, d in points:
        host, (q, qring, lse, pos, slots, m) = match_problem(B, Hq, K, d, device)
        ring_bytes = qring.numel() * 2
        want = mac_match_reference(*host, band=64, tau=0.45)[0]
        got = exact(q, qring, lse, pos, slots, m, 64, 0.45)[0].cpu()
        assert torch.equal(got, want), "exact match kernel != reference"
        us = None if dry else statistics.median(replay_us([lambda: exact(q, qring, lse, pos, slots, m, 64, 0.45)], reps))
        rows.append({"kernel": "match", "variant": "exact", "batch": B, "heads": Hq, "window": K, "head_dim": d,
                     "bytes": ring_bytes, "us": us})
        for kind, C in SKETCHES:
            proj = sketch_projection_of(kind, d, device)
            sr = sketch(qring, kind).to(sketch_dtype(kind))
            got, _, qs = two(q, proj, qring, sr, lse, pos, slots, m, 64, 0.45, C)
            want = mac_match_two_stage_reference(*host, band=64, tau=0.45, sketch=kind, candidates=C,
                                                 q_sketch=qs.cpu())[0]
            assert torch.equal(got.cpu(), want), f"two-stage ({kind}) kernel != reference"
            # the query's sketch is computed in the step (the ring's is kept by the append)
            us = None if dry else statistics.median(replay_us(
                [lambda: two(q, proj, qring, sr, lse, pos, slots, m, 64, 0.45, C)], reps))
            splits = two_stage_meta(B, Hq, K, d, C, num_sms(torch.device(device)), sketch_dims=sr.shape[3],
                                    sketch_itemsize=sr.element_size()).NS
            rows.append({"kernel": "match", "variant": f"two_stage {kind} C={C}", "batch": B, "heads": Hq,
                         "window": K, "head_dim": d, "us": us,   # the sketch ring + every split's C exact entries
                         "bytes": sr.numel() * sr.element_size() + B * Hq * splits * C * d * 2})
    return rows


def bench_pages(points, reps, device, dry) -> list[dict]:
    from macattn.plugins.page_select.op import select_pages

    rows = []
    for B, Hq, Hkv, T, d, page, budget in points:
        g = torch.Generator().manual_seed(1)
        k = torch.randn(B, Hkv, T, d, generator=g).to(torch.bfloat16)
        lo, hi = page_bounds(k, page, torch.float32)
        q = torch.randn(B, Hq, d, generator=g).to(torch.bfloat16)
        n = torch.full((B,), lo.shape[2])
        host = (q, lo, hi, n)
        qd, lod, hid, nd = (x.to(device) for x in host)
        got = select_pages(qd, lod, hid, nd, budget).cpu()
        assert torch.equal(got, select_pages_reference(*host, budget)), "page selector kernel != reference"
        base = {"kernel": "page_select", "batch": B, "q_heads": Hq, "kv_heads": Hkv, "context": T, "page": page,
                "budget_pages": budget, "bytes": 2 * lod.numel() * 4}
        us = None if dry else statistics.median(replay_us([lambda: select_pages(qd, lod, hid, nd, budget)], reps))
        rows.append({**base, "variant": "fused bounds + radix select", "us": us})
        if not dry:
            G = Hq // Hkv

            def topk():
                s = torch.maximum(qd.view(B, Hkv, G, 1, d).float() * lod[:, :, None],
                                  qd.view(B, Hkv, G, 1, d).float() * hid[:, :, None]).sum(-1).amax(2)
                return s.topk(budget, dim=-1).indices

            rows.append({**base, "variant": "torch bounds + topk", "us": statistics.median(replay_us([topk], reps))})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    dry = args.dry_run
    if not dry and not torch.cuda.is_available():
        print("no CUDA device: run on an H100 or use --dry-run", file=sys.stderr)
        return 2
    device = "cpu" if dry else "cuda"
    match_points = [(1, 4, 64, 32)] if dry else [(1, 32, 1024, 128), (8, 32, 1024, 128), (32, 32, 1024, 128)]
    page_points = [(1, 4, 2, 300, 32, 16, 6)] if dry else [(1, 32, 8, 32768, 128, 16, 41),
                                                           (1, 32, 8, 131072, 128, 16, 164),
                                                           (4, 32, 8, 131072, 128, 16, 164)]
    rows = bench_match(match_points, args.reps, device, dry) + bench_pages(page_points, args.reps, device, dry)
    print(f"{'kernel':<12} {'variant':<28} {'B':>3} {'shape':<22} {'µs':>9} {'GB/s':>8} {'% HBM':>6}")
    for r in rows:
        shape = (f"K={r['window']} d={r['head_dim']}" if r["kernel"] == "match"
                 else f"T={r['context']} budget={r['budget_pages']}")
        us = r["us"]
        rate = r["bytes"] / (us * 1e-6) if us else None
        r["bytes_per_s"] = rate
        print(f"{r['kernel']:<12} {r['variant']:<28} {r['batch']:>3} {shape:<22} "
              f"{(f'{us:.1f}' if us else '-'):>9} {(f'{rate / 1e9:.0f}' if rate else '-'):>8} "
              f"{(f'{100 * rate / HBM_BYTES_PER_S:.0f}' if rate else '-'):>6}")
    if dry:
        print("dry run: every kernel equals its reference")
        return 0
    name = torch.cuda.get_device_name()
    import triton

    report = {"benchmark": "bench_selectors", "device": name, "torch": torch.__version__, "triton": triton.__version__,
              "reps": args.reps, "rows": rows}
    out = Path(args.out or Path(__file__).parent / "results" / f"bench_selectors_{name.split()[1].lower()}.json")
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
