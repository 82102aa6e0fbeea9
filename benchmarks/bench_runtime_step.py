"""The runtime's own decode step, as a user gets it: ``LLMEngine`` on CUDA with CUDA graphs per batch
bucket, an 8B-shaped LLaMA (random bf16 weights), MAC on and off, with and without fused weights
(``RuntimeConfig(fused_weights=True)``: Q/K/V and gate/up as one projection each).

    python benchmarks/bench_runtime_step.py                  # H100: 1 x 32K, 32 layers
    python benchmarks/bench_runtime_step.py --dry-run        # CPU, tiny shapes: checks the script runs

Each configuration prefills ``B`` requests of ``context`` random tokens through the engine, runs
decode steps through ``LLMEngine.step`` (which captures the bucket's graph), then times replays
of that captured step (``benchmarks/cuda_timing.graph_replay_us``, CUDA events). MAC's hits depend on the
random queries (mostly misses on random weights): this measures the step's fixed cost, not MAC's
attention savings (``bench_e2e.py`` / ``bench_mac_decode.py`` do). JSON with every figure.
"""
from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cuda_timing import graph_replay_us  # noqa: E402

from macattn.methods.mac.config import MacConfig  # noqa: E402
from macattn.models.attention import unbind  # noqa: E402
from macattn.runtime.config import RuntimeConfig  # noqa: E402
from macattn.runtime.engine import LLMEngine  # noqa: E402

SHAPES_8B = dict(num_hidden_layers=32, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                 num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=131072 + 64,
                 rope_theta=500000.0)
SHAPES_DRY = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=512)


def build(shapes: dict, device: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, LlamaConfig

    with torch.device(device):
        model = AutoModelForCausalLM.from_config(LlamaConfig(**shapes), dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def _weight_bytes(ex) -> int:
    """Bytes of the distinct storages behind the model's and the fused forward's parameters."""
    params = list(ex.model.parameters()) + (list(ex.fused.parameters()) if ex.fused is not None else [])
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in params}
    return sum(storages.values())


def measure(model, *, mac: MacConfig | None, fused: bool, B: int, context: int, device: str, reps: int) -> dict:
    rc = RuntimeConfig(max_batch_size=B, max_seq_len=context + 16, device=device,
                       use_cuda_graphs=device == "cuda", fused_weights=fused)
    eng = LLMEngine(model, mac, rc)
    g = torch.Generator().manual_seed(0)
    for _ in range(B):
        eng.add_request(torch.randint(0, model.config.vocab_size, (context,), generator=g), max_new_tokens=8)
    for _ in range(3):                                   # admissions, then decode steps (bucket captured)
        eng.step()
    rec = {"mac": mac is not None, "fused_weights": fused, "batch": B, "context": context}
    ex = eng.executor
    if ex.decoder is not None:
        bucket = ex.decoder.buckets[ex.decoder.bucket_size(B)]
        us = graph_replay_us(bucket.graphs[ex.decoder.step_key(eng.scheduler.running)], reps)   # the engine's step
        rec.update(step_us_median=statistics.median(us), step_us_p10=sorted(us)[len(us) // 10],
                   weight_bytes=_weight_bytes(ex))
    else:
        rec["note"] = "CPU dry run: no graph to time"
    eng.run_to_completion()
    unbind(ex.model)
    del eng, ex
    if device == "cuda":
        torch.cuda.empty_cache()
    return rec


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes")
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--out", default="benchmarks/results/bench_runtime_step_h100.json")
    args = ap.parse_args(argv)
    device = "cpu" if args.dry_run else "cuda"
    shapes = SHAPES_DRY if args.dry_run else SHAPES_8B
    context = 64 if args.dry_run else args.context
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    model = build(shapes, device, dtype)
    mac = MacConfig(window=32 if args.dry_run else 1024, band=8 if args.dry_run else 256, tau=0.45)
    rows = []
    for use_mac in (False, True):
        for fused in (False, True):
            rows.append(measure(model, mac=mac if use_mac else None, fused=fused, B=args.batch, context=context,
                                device=device, reps=args.reps))
            print(json.dumps(rows[-1]), flush=True)
            gc.collect()
    report = {"device": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
              "torch": torch.__version__, "python": platform.python_version(), "shapes": shapes, "rows": rows}
    if device == "cuda":
        print(f"\n{'MAC':>5} {'fused':>6} {'step ms':>9}")
        for r in rows:
            print(f"{str(r['mac']):>5} {str(r['fused_weights']):>6} {r['step_us_median'] / 1e3:>9.3f}")
    if args.out and not args.dry_run:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
