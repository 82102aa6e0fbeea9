"""End-to-end decode-step benchmark: an 8B-shaped LLaMA, MAC vs full attention vs FlashInfer.

    python benchmarks/bench_e2e.py                 # H100: 32 layers, 32K and 128K, B in {1, 4}
    python benchmarks/bench_e2e.py --dry-run       # CPU, tiny shapes: checks the script runs

Model: LLaMA-3.1-8B shapes (32 layers, hidden 4096, 32 query / 8 KV heads, d=128, MLP
14336, vocab 128256), random bf16 weights (timing does not depend on the values). KV for
``context`` positions is filled with random bf16 values (no prefill is timed); every
request of the batch decodes the token at position ``m = context``. One timed step =
the whole model forward for ``B`` tokens (embedding, 32 layers, norm, last-token logits).

Attention paths (one registered transformers attention function, switched per run):

* ``mac``: MAC step (match, complete, rectify-append). ``macattn.plugins.MacDecodePlan``
  when importable on CUDA (plan once per bucket, capture-safe), else ``torch.ops.macattn``
  (the CUDA impls registered by ``macattn.methods.kernels.register_kernels``, or the CPU reference in --dry-run).
  Two ring states: ``hit`` (each layer's ring seeded so every head matches at reuse gap
  ``--gap``: the best case, reads ``band + gap`` KV tokens) and ``miss`` (empty rings: full
  attention plus MAC's match/append overhead).
* ``full_triton``: ``MacDecodePlan.run_full`` (the same attention kernel, no ring).
* ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention(enable_gqa=True)``.
* ``flashinfer``: ``BatchDecodeWithPagedKVCacheWrapper`` (NHD, tensor cores) over its own
  paged cache of 16-token pages holding the same number of random tokens (one
  ``T``-token page per request measured its scheduling, not its bandwidth: 62 ms/step at
  B=1 x 128K on the H100, first run).

Steps are captured in a CUDA graph and replayed (``--no-cuda-graphs`` for eager); a path
that cannot be captured is timed eagerly and says why. Configurations that do not fit in
free GPU memory are skipped with the bytes they need (B=4 x 128K needs ~82 GiB: H200).
Results: JSON in ``benchmarks/results/`` (``--out``).
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

import torch

LLAMA_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=500000.0,
                max_position_embeddings=131072 + 1024, tie_word_embeddings=False)
TINY = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
            num_key_value_heads=2, head_dim=32, rope_theta=10000.0, max_position_embeddings=4096,
            tie_word_embeddings=False)
IMPL = "macattn_bench"
PATHS = ("mac", "full_triton", "sdpa", "flashinfer")

# What the attention function needs for the current run (set before each run).
B_ = SimpleNamespace(path=None, m=0, positions=None, slots=None, state=None, plan=None, fi=None, fi_kv=None, q_pre={},
                     record=None, hits=None)


# --- optional GPU pieces (import-guarded) -----------------------------------------------------
def _try_import_plugins():
    try:
        from macattn.methods.kernels import register_kernels
        from macattn.plugins.decode_plan import MacDecodePlan
        return register_kernels(), MacDecodePlan, None
    except Exception as exc:                         # noqa: BLE001 - reported in the JSON
        return None, None, f"{type(exc).__name__}: {exc}"


def _try_import_flashinfer():
    try:
        import flashinfer
        return flashinfer, None
    except Exception as exc:                         # noqa: BLE001
        return None, f"{type(exc).__name__}: {exc}"


# --- the attention function and the static KV view ----------------------------------------------
def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """query ``[B, Hq, 1, d]``; key/value the static ``[B, Hkv, T, d]`` buffers. -> ``([B, 1, Hq, d], None)``."""
    layer = module.layer_idx
    q = query[:, :, 0]
    path = B_.path
    if path == "sdpa":
        m = B_.m
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key[:, :, :m + 1], value[:, :, :m + 1], scale=scaling, enable_gqa=True)[:, :, 0]
    elif path == "flashinfer":
        out = B_.fi.run(q.contiguous(), B_.fi_kv[layer])
    elif path == "full_triton":
        out = B_.plan.run_full(q, key, value, B_.positions, check=False)
    elif path == "mac":
        qp = B_.q_pre.pop(layer).view(q.shape)
        if B_.record is not None:
            B_.record[layer] = qp.detach().clone()
        rings = B_.state.layer(layer)
        if B_.plan is not None:
            out, match_pos, _ = B_.plan.run(q, qp, key, value, B_.positions, B_.slots, *rings, check=False)
        else:
            p = B_.state.config.for_layer(layer)
            match_pos, _ = torch.ops.macattn.mac_match(qp, rings[0], rings[2], rings[3], B_.slots, B_.positions,
                                                        p.band, p.tau)
            out = torch.ops.macattn.mac_attend(q, qp, key, value, B_.positions, match_pos, B_.slots, *rings,
                                               p.band, float(scaling))
        B_.hits += (match_pos >= 0).sum()
    else:
        raise RuntimeError(f"unknown path {path!r}")
    return out.unsqueeze(1), None


def _capture_q_pre(module, inputs, output):
    if B_.path == "mac":
        B_.q_pre[module._bench_layer] = output


class StaticKV:
    """Per layer ``k, v [B, Hkv, T, d]``; ``update`` writes the new token at position ``m`` (static index)."""

    def __init__(self, layers: int, B: int, hkv: int, T: int, d: int, dtype, device, m: int):
        g = torch.Generator(device=device).manual_seed(0)
        self.k = [torch.randn(B, hkv, T, d, dtype=dtype, device=device, generator=g) for _ in range(layers)]
        self.v = [torch.randn(B, hkv, T, d, dtype=dtype, device=device, generator=g) for _ in range(layers)]
        self.idx = torch.tensor([m], device=device)

    def update(self, key, value, layer_idx, *args, **kwargs):
        self.k[layer_idx].index_copy_(2, self.idx, key)
        self.v[layer_idx].index_copy_(2, self.idx, value)
        return self.k[layer_idx], self.v[layer_idx]


# --- setup ---------------------------------------------------------------------------------------
def build_model(shapes: dict, dtype, device):
    from transformers import AttentionInterface, AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**shapes)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    model.eval()
    AttentionInterface.register(IMPL, _attention)   # no mask function registered: transformers builds no mask
    model.set_attn_implementation(IMPL)
    for i, layer in enumerate(model.model.layers):
        layer.self_attn.q_proj._bench_layer = i
        layer.self_attn.q_proj.register_forward_hook(_capture_q_pre)
    return model


def _bytes_needed(shapes, B, T, window, n_params) -> int:
    L, hkv, hq, d = (shapes[k] for k in ("num_hidden_layers", "num_key_value_heads", "num_attention_heads", "head_dim"))
    kv = 2 * L * B * hkv * T * d * 2
    rings = L * B * hq * window * (d * 2 + d * 4 + 4) + L * B * window * 8
    return n_params * 2 + kv + rings


def _seed_hits(step, state, m: int, gap: int, layers: int) -> None:
    """Seed ring slot ``m - gap`` of every layer with that layer's own pre-RoPE query, one layer
    per pass (deeper layers' queries depend on the earlier layers' now-fixed hit outputs)."""
    for layer in range(layers):
        B_.record = {}
        step()
        qring, oring, lse, pos = state.layer(layer)
        K = qring.shape[2]
        col = (m - gap) % K
        for b in range(B_.slots.numel()):
            s = int(B_.slots[b])
            qring[s, :, col] = B_.record[layer][b].to(qring.dtype)
            oring[s, :, col] = 0.01
            lse[s, :, col] = 0.0
            pos[s, col] = m - gap
        B_.record = None


def _time(fn, steps: int, warmup: int, device) -> float:
    """Mean milliseconds per call."""
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / steps
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    return (time.perf_counter() - t0) * 1e3 / steps


def run_one(model, shapes, args, *, path: str, mode: str, context: int, B: int, kv: StaticKV, device, dtype,
            plan_cls, fi_mod) -> dict:
    from macattn.methods.mac.config import MacConfig
    from macattn.methods.mac.state import MacState

    L, hq, hkv, d = (shapes[k] for k in ("num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                                          "head_dim"))
    m = context
    T = kv.k[0].shape[2]
    rec = {"path": path, "mode": mode if path == "mac" else "-", "context": context, "batch": B}
    B_.path, B_.m = path, m
    B_.positions = torch.full((B,), m, dtype=torch.int64, device=device)
    B_.slots = torch.arange(B, dtype=torch.int64, device=device)
    B_.hits = torch.zeros((), dtype=torch.int64, device=device)
    B_.plan = B_.fi = B_.state = None
    B_.q_pre = {}
    mac = MacConfig(window=args.window, band=args.band, tau=args.tau)
    if path in ("mac", "full_triton") and plan_cls is not None and device.type == "cuda":
        B_.plan = plan_cls(batch_size=B, max_context=T, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                           window=args.window, band=args.band, tau=args.tau, q_dtype=dtype, device=device)
    if path == "full_triton" and B_.plan is None:
        return {**rec, "skipped": "needs macattn.plugins.MacDecodePlan on CUDA"}
    if path == "flashinfer":
        if fi_mod is None or device.type != "cuda":
            return {**rec, "skipped": "needs flashinfer on CUDA"}
        # FlashInfer's own paged cache (NHD, 16-token pages, random bf16), one per layer: a single
        # T-token page would defeat its split-KV scheduling and measure a layout, not the peer.
        page = 16
        per_req = -(-(m + 1) // page)
        ws = torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device=device)
        indptr = torch.arange(B + 1, dtype=torch.int32, device=device) * per_req
        indices = torch.arange(B * per_req, dtype=torch.int32, device=device)
        last = torch.full((B,), (m % page) + 1, dtype=torch.int32, device=device)
        B_.fi_kv = [torch.randn(B * per_req, 2, page, hkv, d, dtype=dtype, device=device) for _ in range(L)]
        B_.fi = fi_mod.BatchDecodeWithPagedKVCacheWrapper(
            ws, "NHD", use_cuda_graph=not args.no_cuda_graphs, use_tensor_cores=True,
            paged_kv_indptr_buffer=indptr, paged_kv_indices_buffer=indices, paged_kv_last_page_len_buffer=last)
        B_.fi.plan(indptr, indices, last, hq, hkv, d, page, q_data_type=dtype, kv_data_type=dtype)
    if path == "mac":
        B_.state = MacState.allocate(mac, num_layers=L, num_slots=B, num_q_heads=hq, head_dim=d,
                                     query_dtype=dtype, device=device)
        rec["mac_impl"] = "MacDecodePlan" if B_.plan is not None else "torch.ops.macattn"
    ids = torch.full((B, 1), 7, dtype=torch.int64, device=device)
    pos_ids = B_.positions.view(B, 1)

    @torch.inference_mode()
    def step():
        return model(input_ids=ids, position_ids=pos_ids, past_key_values=kv, use_cache=True,
                     logits_to_keep=1).logits

    if path == "mac" and mode == "hit":
        _seed_hits(step, B_.state, m, args.gap, L)
    fn, graph_note = step, None
    if device.type == "cuda" and not args.no_cuda_graphs:
        try:
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(2):
                    step()
            torch.cuda.current_stream().wait_stream(s)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            fn = graph.replay
        except Exception as exc:                      # noqa: BLE001 - timed eagerly instead
            graph_note = f"eager (capture failed: {type(exc).__name__}: {str(exc)[:200]})"
            torch.cuda.synchronize()
    B_.hits.zero_()
    ms = _time(fn, args.steps, args.warmup, device)
    calls = (args.steps + args.warmup) * L * B * hq
    rec.update(step_ms=ms, tokens_per_s=B / (ms / 1e3), cuda_graph=graph_note is None and device.type == "cuda")
    if graph_note:
        rec["note"] = graph_note
    if path == "mac":
        rec["hit_rate"] = float(B_.hits) / calls
        rec.update(window=args.window, band=args.band, tau=args.tau, gap=args.gap if mode == "hit" else None)
    return rec


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, few steps: checks the script")
    ap.add_argument("--contexts", type=int, nargs="+", default=None, help="default 32768 131072 (dry: 128 256)")
    ap.add_argument("--batches", type=int, nargs="+", default=None, help="default 1 4 (dry: 1 2)")
    ap.add_argument("--layers", type=int, default=None, help="default 32 (dry: 2)")
    ap.add_argument("--paths", nargs="+", default=list(PATHS), choices=PATHS)
    ap.add_argument("--modes", nargs="+", default=["hit", "miss"], choices=["hit", "miss"])
    ap.add_argument("--window", type=int, default=None, help="ring window K (default 1024; dry 32)")
    ap.add_argument("--band", type=int, default=None, help="band r (default 256; dry 8)")
    ap.add_argument("--tau", type=float, default=0.45)
    ap.add_argument("--gap", type=int, default=None, help="reuse gap m - p in 'hit' mode (default 64; dry 4)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default 50; dry 2)")
    ap.add_argument("--warmup", type=int, default=None, help="default 5 (dry 1)")
    ap.add_argument("--no-cuda-graphs", action="store_true")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/bench_e2e_<gpu>.json; "
                                                "dry run: print only)")
    args = ap.parse_args(argv)
    dry = args.dry_run
    d = lambda v, full, tiny: v if v is not None else (tiny if dry else full)  # noqa: E731
    args.contexts = d(args.contexts, [32768, 131072], [128, 256])
    args.batches = d(args.batches, [1, 4], [1, 2])
    args.window, args.band, args.gap = d(args.window, 1024, 32), d(args.band, 256, 8), d(args.gap, 64, 4)
    args.steps, args.warmup = d(args.steps, 50, 2), d(args.warmup, 5, 1)
    shapes = dict(TINY if dry else LLAMA_8B)
    shapes["num_hidden_layers"] = d(args.layers, shapes["num_hidden_layers"], 2)
    shapes["max_position_embeddings"] = max(shapes["max_position_embeddings"], max(args.contexts) + 64)
    if not dry and not torch.cuda.is_available():
        print("no CUDA device: run on an H100 or use --dry-run", file=sys.stderr)
        return 2
    device = torch.device("cpu" if dry else "cuda")
    dtype = torch.float32 if dry else torch.bfloat16

    plugins, plan_cls, plugins_err = _try_import_plugins()
    if device.type != "cuda":
        plan_cls = None
    fi_mod, fi_err = _try_import_flashinfer() if "flashinfer" in args.paths else (None, "not requested")
    model = build_model(shapes, dtype, device)
    n_params = sum(p.numel() for p in model.parameters())
    results = []
    for context in args.contexts:
        for B in args.batches:
            T = context + 64
            need = _bytes_needed(shapes, B, T, args.window, n_params)
            if device.type == "cuda":
                torch.cuda.empty_cache()
                free = torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_allocated(device) - n_params * 2
                if need - n_params * 2 > free * 0.95:
                    results.append({"context": context, "batch": B, "skipped":
                                    f"needs {need / 2**30:.1f} GiB (weights + KV + rings); "
                                    f"{(free + n_params * 2) / 2**30:.1f} GiB usable"})
                    print(results[-1], flush=True)
                    continue
            kv = StaticKV(shapes["num_hidden_layers"], B, shapes["num_key_value_heads"], T, shapes["head_dim"],
                          dtype, device, context)
            for path in args.paths:
                for mode in (args.modes if path == "mac" else ["-"]):
                    B_.fi = B_.fi_kv = B_.plan = B_.state = None   # free the previous path's buffers
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                    try:
                        rec = run_one(model, shapes, args, path=path, mode=mode, context=context, B=B, kv=kv,
                                      device=device, dtype=dtype, plan_cls=plan_cls, fi_mod=fi_mod)
                    except Exception as exc:          # noqa: BLE001 - one path failing must not stop the rest
                        rec = {"path": path, "mode": mode, "context": context, "batch": B,
                               "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-1500:]}
                    results.append(rec)
                    print({k: v for k, v in rec.items() if k != "trace"}, flush=True)
            del kv
    report = {
        "benchmark": "bench_e2e", "dry_run": dry, "model": "LLaMA-3.1-8B shapes, random weights" if not dry
        else "tiny LLaMA (dry run)", "shapes": shapes, "dtype": str(dtype), "n_params": n_params,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"{platform.machine()} CPU",
        "torch": torch.__version__, "steps": args.steps, "warmup": args.warmup,
        "cuda_graphs": device.type == "cuda" and not args.no_cuda_graphs,
        "plugins": list(plugins) if plugins is not None else None, "plugins_error": plugins_err,
        "flashinfer": getattr(fi_mod, "__version__", None) if fi_mod else None, "flashinfer_error": fi_err,
        "kv_bytes_per_token_per_layer": 2 * shapes["num_key_value_heads"] * shapes["head_dim"] * 2,
        "results": results,
    }
    out = args.out
    if out is None and not dry:
        name = torch.cuda.get_device_name(device).replace(" ", "_").lower()
        out = Path(__file__).parent / "results" / f"bench_e2e_{name}.json"
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {out}")
    else:
        print(json.dumps({k: v for k, v in report.items() if k != "results"}, indent=1))
    bad = [r for r in results if "error" in r]
    return 1 if bad and dry else 0


if __name__ == "__main__":
    sys.exit(main())
