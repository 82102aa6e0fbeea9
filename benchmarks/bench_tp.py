"""Tensor-parallel decode step: one model over TP ranks (``RuntimeConfig(tensor_parallel_size=TP)``,
NCCL on GPUs), MAC vs full attention, LLaMA-3.1-8B shapes (and 70B where memory allows), random bf16
weights — every rank draws its own shard (``runtime.tensor_parallel.RandomWeights``).

    python benchmarks/bench_tp.py --tp 1                 # one H100: TP = 1, 1 x 128K (4 x 128K where it fits)
    python benchmarks/bench_tp.py --tp 1 2 4 --shapes 8b 70b   # a node with >= 4 GPUs
    python benchmarks/bench_tp.py --dry-run              # CPU, gloo, tiny shapes, TP in {1, 2}: checks the script

Per point (shapes, TP, path, B x context): ``B`` requests of ``context`` prompt tokens are admitted
through the engine's scheduler, their KV is random values written into every rank's paged pool (nothing
is prefilled), and every request decodes the token at ``m = context``. ``mac`` seeds every head of every
rank's rings with its own pre-RoPE query at gap ``--gap`` (layer by layer: a layer's queries depend on the
earlier layers), so each step is an all-hit MAC step (the measured hit rate, gathered from the ranks, is in
the row); ``full`` is the full-attention method. The figure is what a user of the engine waits for:
the wall-clock ``decode_step`` on rank 0 — the step broadcast to the workers, every rank's CUDA-graph
replay (embedding, layers with their two all-reduces, LM head + gather, sampler), the tokens read back —
median over ``--reps``. Points that need more memory per GPU than is free are skipped with the bytes they
need; TP values above the visible GPUs are skipped. JSON (device, versions, every figure) under
``benchmarks/results/bench_tp_<gpu>.json`` (dry run: a temporary file); a table is printed.
"""
from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_e2e import LLAMA_8B, TINY, FlashInferAttention, build_model  # noqa: E402

from macattn.methods.mac.config import MacConfig  # noqa: E402
from macattn.methods.registry import register  # noqa: E402
from macattn.models.attention import unbind  # noqa: E402
from macattn.runtime.config import RuntimeConfig  # noqa: E402
from macattn.runtime.engine import LLMEngine  # noqa: E402
from macattn.runtime.tensor_parallel import RandomWeights  # noqa: E402
from macattn.runtime.tensor_parallel.comm import rank_function  # noqa: E402

LLAMA_70B = dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                 num_attention_heads=64, num_key_value_heads=8, head_dim=128, rope_theta=500000.0,
                 max_position_embeddings=131072 + 1024, tie_word_embeddings=False)
SHAPES = {"8b": LLAMA_8B, "70b": LLAMA_70B}
TINY_TP = {**TINY, "num_key_value_heads": 4}        # divisible by the dry run's TP = 2 (and 4)
register(FlashInferAttention)   # at import: spawned ranks import this script too and build it by name


# --- per-rank functions (run on every rank through TensorParallelExecutor.run_on_ranks) --------------
@rank_function
def fill_kv(executor, seed: int) -> None:
    """Random K/V in the rank's whole paged pool."""
    gen = torch.Generator(device=executor.kv.k[0].device).manual_seed(seed)
    for t in executor.kv.k + executor.kv.v:
        t.normal_(generator=gen)


@rank_function
def seed_layer_all_hit(executor, seqs, layer: int, gap: int) -> None:
    """One eager step recording ``layer``'s pre-RoPE queries, written into the rank's rings at ``m - gap``
    (every head of every request then hits in that layer)."""
    method, rec = executor.method, {}
    original = method.decode

    def recording(module, lyr, query, key, value, q_pre, *a, **kw):
        rec[lyr] = q_pre[:, :, 0].detach().clone()
        return original(module, lyr, query, key, value, q_pre, *a, **kw)

    dec = executor.decoder
    graphs = dec is not None and dec.use_cuda_graphs
    method.decode = recording
    if graphs:
        dec.use_cuda_graphs = False
    try:
        executor.decode_step(seqs)
    finally:
        del method.decode
        if graphs:
            dec.use_cuda_graphs = True
    q = rec[layer]
    qring, oring, lse, pos = method.state.layer(layer)
    K, m = qring.shape[2], seqs[0].num_tokens - 1
    for b, s in enumerate(seqs):
        qring[s.slot, :, (m - gap) % K] = q[b].to(qring.dtype)
        oring[s.slot, :, (m - gap) % K] = 0.01
        lse[s.slot, :, (m - gap) % K] = 0.0
        pos[s.slot, (m - gap) % K] = m - gap


@rank_function
def plan_flashinfer(executor, seqs) -> None:
    """The rank's FlashInfer decode plan over its pool (its heads), before the graphs are captured."""
    import flashinfer

    executor.method.plan(flashinfer, seqs, executor.config.block_size)


@rank_function
def hit_counts(executor) -> list[int]:
    """``[hits, heads x rows x layers]`` of the rank's latest decode step."""
    mp = list(getattr(executor.method, "last_match_pos", {}).values())
    return [sum(int((t >= 0).sum()) for t in mp), sum(t.numel() for t in mp)]


def _on_ranks(eng, fn, *args) -> list:
    if eng.config.tensor_parallel_size > 1:
        return eng.executor.run_on_ranks(fn, *args)
    return [fn(eng.executor, *args)]


# --- one point ---------------------------------------------------------------------------------------
def bytes_per_rank(shapes: dict, tp: int, B: int, context: int, window: int) -> int:
    """Weights, KV (bf16) and MAC rings one rank holds, plus 2 GiB of workspace."""
    L, D, I, V = shapes["num_hidden_layers"], shapes["hidden_size"], shapes["intermediate_size"], shapes["vocab_size"]
    hq, hkv, d = shapes["num_attention_heads"], shapes["num_key_value_heads"], shapes["head_dim"]
    weights = 2 * (L * (D * (hq + 2 * hkv) * d + hq * d * D + 3 * D * I) + 2 * V * D) // tp
    kv = 2 * L * B * (context + 64 + 16) * hkv * d * 2 // tp
    rings = L * (B + 1) * hq * window * (d * 6 + 4) // tp
    return weights + kv + rings + (2 << 30)


def make_engine(shapes: dict, tp: int, path: str, B: int, context: int, args, device: str, dtype) -> LLMEngine:
    from transformers import LlamaConfig

    rc = RuntimeConfig(max_batch_size=B, max_seq_len=context + 64, device=device,
                       use_cuda_graphs=device.startswith("cuda"), tensor_parallel_size=tp, tp_timeout_s=args.timeout)
    mac = MacConfig(window=args.window, band=args.band, tau=args.tau) if path == "mac" else None
    model = (build_model(shapes, dtype, torch.device(device)) if tp == 1 else
             RandomWeights(LlamaConfig(**shapes), dtype=dtype, seed=0))
    return LLMEngine(model, mac, rc, method=path)


def run_point(shapes: dict, tp: int, path: str, B: int, context: int, args, device: str, dtype) -> dict:
    row = {"tp": tp, "path": path, "batch": B, "context": context}
    eng = make_engine(shapes, tp, path, B, context, args, device, dtype)
    try:
        g = torch.Generator().manual_seed(0)
        for _ in range(B):
            eng.submit(eng.make_request(torch.randint(0, eng.vocab_size, (context,), generator=g), max_new_tokens=8))
        seqs = eng.scheduler.admit()
        assert len(seqs) == B, "the engine could not admit the batch"
        for s in seqs:
            s.output.append(int(torch.randint(0, eng.vocab_size, (1,), generator=g)))
        _on_ranks(eng, fill_kv, 0)
        if path == "flashinfer":
            _on_ranks(eng, plan_flashinfer, seqs)
        if path == "mac":
            row.update(window=args.window, band=args.band, tau=args.tau, gap=args.gap)
            for layer in range(eng.executor.num_layers):
                _on_ranks(eng, seed_layer_all_hit, seqs, layer, args.gap)
        for _ in range(3):                                       # capture + warm-up
            eng.executor.decode_step(seqs)
        wall = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            eng.executor.decode_step(seqs)
            wall.append((time.perf_counter() - t0) * 1e3)
        if path == "mac":
            counts = _on_ranks(eng, hit_counts)
            row["hit_rate_measured"] = sum(c[0] for c in counts) / max(1, sum(c[1] for c in counts))
        row.update(step_ms_median=statistics.median(wall), step_ms_p10=sorted(wall)[len(wall) // 10],
                   step_ms_p90=sorted(wall)[(9 * len(wall)) // 10])
        return row
    finally:
        eng.close()
        if tp == 1:
            unbind(eng.executor.model)
        del eng
        gc.collect()
        if device.startswith("cuda"):
            torch.cuda.empty_cache()


def ratios(rows: list[dict]) -> list[dict]:
    """Per (shapes, B x context): each TP's step over TP = 1's per path, and MAC's speed-up over the
    full and FlashInfer paths per TP (the issue's targets: TP = 2 MAC step <= 0.6x TP = 1's at 4 x 128K,
    and MAC's ratio over full at TP = 2 no lower than at TP = 1)."""
    ms = {(r["shapes"], r["batch"], r["context"], r["tp"], r["path"]): r["step_ms_median"]
          for r in rows if "step_ms_median" in r}
    out = []
    for shapes, B, ctx in sorted({k[:3] for k in ms}):
        point = {"shapes": shapes, "batch": B, "context": ctx}
        for (s_, b_, c_, tp, path), v in sorted(ms.items()):
            if (s_, b_, c_) != (shapes, B, ctx):
                continue
            base = ms.get((shapes, B, ctx, 1, path))
            if tp > 1 and base:
                point[f"{path}_tp{tp}_over_tp1"] = v / base
            if path == "mac":
                for peer in ("full", "flashinfer"):
                    if (shapes, B, ctx, tp, peer) in ms:
                        point[f"mac_speedup_over_{peer}_tp{tp}"] = ms[(shapes, B, ctx, tp, peer)] / v
        out.append(point)
    return out


def _table(rows: list[dict]) -> str:
    head = f"{'shapes':>6} {'TP':>3} {'path':>10} {'B x ctx':>12} {'step ms':>9} {'hit':>6}  note"
    lines = [head, "-" * len(head)]
    for r in rows:
        ms = f"{r['step_ms_median']:.3f}" if "step_ms_median" in r else "-"
        hit = f"{r['hit_rate_measured']:.3f}" if "hit_rate_measured" in r else "-"
        lines.append(f"{r['shapes']:>6} {r['tp']:>3} {r['path']:>10} {r['batch']}x{r['context']:<10} {ms:>9} {hit:>6}  "
                     f"{r.get('note', '')}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="CPU, gloo, tiny shapes: checks the script")
    ap.add_argument("--tp", type=int, nargs="+", default=None, help="TP sizes (default 1 2 4; dry: 1 2)")
    ap.add_argument("--shapes", nargs="+", default=["8b", "70b"], choices=list(SHAPES))
    ap.add_argument("--grid", nargs="+", default=None, help="BxCTX points (default 1x131072 4x131072; dry: 1x64 2x64)")
    ap.add_argument("--paths", nargs="+", default=None, choices=["full", "mac", "flashinfer"],
                    help="default full mac flashinfer (dry: full mac)")
    ap.add_argument("--window", type=int, default=None, help="ring window K (default 1024; dry 32)")
    ap.add_argument("--band", type=int, default=None, help="band r (default 256; dry 8)")
    ap.add_argument("--tau", type=float, default=0.45)
    ap.add_argument("--gap", type=int, default=None, help="reuse gap m - p of a hit (default 64; dry 4)")
    ap.add_argument("--reps", type=int, default=None, help="timed steps (default 50; dry 2)")
    ap.add_argument("--timeout", type=float, default=600.0, help="tp_timeout_s: seconds per collective at most")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/bench_tp_<gpu>.json; "
                                                "dry run: a temporary file)")
    args = ap.parse_args(argv)
    dry = args.dry_run
    pick = lambda v, full, tiny: v if v is not None else (tiny if dry else full)  # noqa: E731
    tps = pick(args.tp, [1, 2, 4], [1, 2])
    points = [tuple(int(x) for x in p.lower().split("x")) for p in pick(args.grid, ["1x131072", "4x131072"],
                                                                          ["1x64", "2x64"])]
    args.window, args.band, args.gap = pick(args.window, 1024, 32), pick(args.band, 256, 8), pick(args.gap, 64, 4)
    args.reps = pick(args.reps, 50, 2)
    args.paths = pick(args.paths, ["full", "mac", "flashinfer"], ["full", "mac"])
    if not dry and not torch.cuda.is_available():
        print("no CUDA device: run on a GPU or use --dry-run", file=sys.stderr)
        return 2
    device = "cpu" if dry else "cuda"
    dtype = torch.float32 if dry else torch.bfloat16
    visible = torch.cuda.device_count() if not dry else None
    name = torch.cuda.get_device_name() if not dry else f"{platform.machine()} CPU"
    free = torch.cuda.mem_get_info()[0] if not dry else None
    import transformers

    versions = {"torch": torch.__version__, "transformers": transformers.__version__,
                "nccl": ".".join(map(str, torch.cuda.nccl.version())) if not dry else None,
                "cuda": torch.version.cuda, "python": platform.python_version()}
    try:
        import triton

        versions["triton"] = triton.__version__
    except ImportError:
        versions["triton"] = None
    try:
        import flashinfer

        versions["flashinfer"] = flashinfer.__version__
    except ImportError as exc:
        versions["flashinfer"] = None
        flashinfer_error = f"skipped: flashinfer not importable ({exc})"
    out = Path(args.out) if args.out else (
        Path(tempfile.mkdtemp()) / "bench_tp_dry.json" if dry else
        Path(__file__).parent / "results" / f"bench_tp_{name.split()[1].lower() if len(name.split()) > 1 else 'gpu'}.json")
    shape_sets = {"tiny": TINY_TP} if dry else {k: SHAPES[k] for k in args.shapes}
    rows: list[dict] = []

    def save(final: bool) -> None:
        report = {"benchmark": "bench_tp", "dry_run": dry, "device": name, "visible_gpus": visible,
                  "backend": "gloo" if dry else "nccl", **versions, "shapes": shape_sets, "reps": args.reps,
                  "figure": "wall-clock decode_step on rank 0 (ms): broadcast, every rank's replay, tokens back",
                  "complete": final, "rows": rows, "ratios": ratios(rows)}
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1))

    for label, shapes in shape_sets.items():
        for tp in tps:
            for B, context in points:
                for path in args.paths:
                    base = {"shapes": label, "tp": tp, "path": path, "batch": B, "context": context}
                    if path == "flashinfer" and versions["flashinfer"] is None:
                        rows.append({**base, "note": flashinfer_error})
                        continue
                    if not dry and tp > visible:
                        rows.append({**base, "note": f"skipped: TP={tp} > {visible} visible GPUs"})
                        continue
                    need = bytes_per_rank(shapes, tp, B, context, args.window)
                    if not dry and need > free:
                        rows.append({**base, "bytes_per_rank_needed": need, "bytes_free": free,
                                     "note": f"skipped: needs {need / 2**30:.1f} GiB per GPU, {free / 2**30:.1f} free"})
                        continue
                    try:
                        rows.append({**base, **run_point(shapes, tp, path, B, context, args, device, dtype),
                                     "bytes_per_rank_estimate": need})
                    except torch.cuda.OutOfMemoryError as exc:
                        rows.append({**base, "note": f"out of memory: {str(exc).splitlines()[0]}"})
                    print(json.dumps(rows[-1]), flush=True)
                    save(False)
    save(True)
    print(_table(rows))
    for r in ratios(rows):
        print(json.dumps(r))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
