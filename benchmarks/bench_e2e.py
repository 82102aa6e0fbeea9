"""End-to-end decode step as a user of the runtime gets it: ``LLMEngine`` on CUDA, LLaMA-3.1-8B shapes
(32 layers, random bf16 weights), the whole step — embedding, 32 layers, final norm, logits, sampler —
one CUDA graph per batch bucket, timed as graph replays.

    python benchmarks/bench_e2e.py                       # H100: B in {1, 2, 4} x {32K, 128K} where it fits
    python benchmarks/bench_e2e.py --grid 4x131072       # H200: the point that needs its memory
    python benchmarks/bench_e2e.py --paths hf_compile    # the torch.compile peer alone
    python benchmarks/bench_e2e.py --paths full full_hf mka_full mka_mac --weights bf16 --hit-rates 1   # FastMKA
    python benchmarks/bench_e2e.py --dry-run             # CPU, tiny shapes: checks the script runs

Requests are admitted through the engine's scheduler (slots, KV blocks) and their ``context`` tokens
of KV are random values written into the paged pool (no prefill is timed or needed); every request
decodes the token at position ``m = context``. Paths (the attention inside the same engine step):

* ``no_attention``: the attention returns its query (same inputs and outputs): the non-attention
  part of the step, with the bytes it streams (``weight_bytes``) and its fraction of the copy
  bandwidth.
* ``full``: the registered full-attention method (our split-KV kernel over the pages).
* ``mac@p``: MAC with per-head hit rate ``p`` (1.0 = all hit; 0.99 / 0.9 / 0.5 = each (request,
  head) hits with probability p, seeded; ``--draws`` fresh patterns per rate, each timed). A hit
  head's ring holds its own pre-RoPE query at gap ``--gap``, a missed head's the negated query;
  rings are seeded layer by layer (a layer's queries depend on the earlier layers' outputs). The
  measured hit rate (the kernels' own ``match_pos``) is reported.
* ``flashinfer``: FlashInfer's ``BatchDecodeWithPagedKVCacheWrapper`` (tensor cores) over the same
  paged pool (``(k, v)`` pages, NHD), planned once for the requests' block tables.
* ``full_hf``: ``full`` through the model's own transformers forward (``RuntimeConfig(fused_weights=False)``:
  separate Q/K/V and gate/up projections), the forward a FastMKA-patched model runs: the baseline of the
  two FastMKA paths.
* ``mka_full`` / ``mka_mac@p``: the model patched with FastMKA (``patch_mka``, gate ``MKA_GATE``), composed
  with full attention / with MAC (hit rates as for ``mac``): each layer's routing, session summary and fused
  K/V through ``macattn::route_fused_attention`` inside the captured step.
* ``hf_compile``: the peer for the whole step: the unmodified transformers model with SDPA and a
  ``StaticCache`` of ``context + 16`` random positions under ``torch.compile(mode="max-autotune-no-cudagraphs")``,
  captured in a CUDA graph by this script (the same replay timing as ours).

Weights: ``bf16`` and ``fp8`` (``RuntimeConfig(quantization="fp8")``, weight-only E4M3 projections).
Points that do not fit in free GPU memory are skipped with the bytes they need. The run first times a
device-to-device copy (read + write); ``no_attention`` / ``full`` / ``flashinfer`` rows carry the bytes
they must stream (weights, + every KV) and the fraction of that copy rate and of nominal HBM they reach.
JSON with every figure (device and its UUID, versions), rewritten after every path, and a PNG beside it
under ``benchmarks/results/``; a table is printed. ``--append`` adds to an existing JSON of the same GPU
(a grid split over several calls of a machine's time limit); ``--plot JSON`` redraws a PNG.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import ClassVar

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cuda_timing import copy_bandwidth, graph_replay_us, replay_us  # noqa: E402

from macattn.methods.base import AttentionMethod, Capabilities, ModelDims  # noqa: E402
from macattn.methods.full.config import FullConfig  # noqa: E402
from macattn.models.transformers_api import CACHE_KWARG  # noqa: E402
from macattn.methods.mac.config import MacConfig  # noqa: E402
from macattn.methods.mka.config import MkaConfig  # noqa: E402
from macattn.models.mka import patch_mka, unpatch_mka  # noqa: E402
from macattn.models.attention import unbind  # noqa: E402
from macattn.runtime.config import RuntimeConfig  # noqa: E402
from macattn.runtime.engine import LLMEngine  # noqa: E402

LLAMA_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=500000.0,
                max_position_embeddings=131072 + 1024, tie_word_embeddings=False)
TINY = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
            num_key_value_heads=2, head_dim=32, rope_theta=10000.0, max_position_embeddings=4096,
            tie_word_embeddings=False)
HBM_BYTES_PER_S = {"H100": 3.35e12, "H200": 4.8e12}
DEFAULT_PATHS = ("no_attention", "full", "mac", "flashinfer", "hf_compile")
PATHS = DEFAULT_PATHS + ("full_hf", "mka_full", "mka_mac")      # the last three: --paths (issue 38's grid)
MKA_GATE = 0.5          # the FastMKA paths' routing gate: L1 and L2 both weigh in (0 would be the plain model)


# --- the bench-only attention paths (AttentionMethod subclasses handed to the engine) ------------
class NoAttention(AttentionMethod):
    """The attention returns its query: what the step costs without attention."""

    name: ClassVar[str] = "no_attention"
    config_type: ClassVar[type] = FullConfig
    capabilities: ClassVar[Capabilities] = Capabilities(paged_kv=True, cuda_graphs=True, head_sharded=True)

    def decode(self, module, layer, query, key, value, q_pre, attention_mask, scale, step, fallback, **kwargs):
        return query.transpose(1, 2)


class FlashInferAttention(AttentionMethod):
    """FlashInfer's batch decode over the engine's paged pool (``plan`` before the first step)."""

    name: ClassVar[str] = "flashinfer"
    config_type: ClassVar[type] = FullConfig
    capabilities: ClassVar[Capabilities] = Capabilities(paged_kv=True, cuda_graphs=True, head_sharded=True)
    wrapper = None

    def plan(self, flashinfer, seqs, block_size: int) -> None:
        dev, d = self.dims.device, self.dims.head_dim
        pages = [s.block_table[: -(-s.num_tokens // block_size)] for s in seqs]   # positions 0 .. m
        indptr = torch.tensor([0] + [sum(len(p) for p in pages[:i + 1]) for i in range(len(pages))],
                              dtype=torch.int32, device=dev)
        indices = torch.tensor([b for p in pages for b in p], dtype=torch.int32, device=dev)
        last = torch.tensor([(s.num_tokens - 1) % block_size + 1 for s in seqs], dtype=torch.int32, device=dev)
        ws = torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device=dev)
        self.wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            ws, "NHD", use_cuda_graph=True, use_tensor_cores=True, paged_kv_indptr_buffer=indptr,
            paged_kv_indices_buffer=indices, paged_kv_last_page_len_buffer=last)
        self.wrapper.plan(indptr, indices, last, self.dims.num_q_heads, self.dims.num_kv_heads, d, block_size,
                          q_data_type=self.dims.dtype, kv_data_type=self.dims.dtype)

    def decode(self, module, layer, query, key, value, q_pre, attention_mask, scale, step, fallback, **kwargs):
        return self.wrapper.run(query[:, :, 0].contiguous(), (key, value)).unsqueeze(1)


# --- setup ----------------------------------------------------------------------------------------
def build_model(shapes: dict, dtype, device):
    from transformers import AutoModelForCausalLM, LlamaConfig

    with torch.device(device):
        model = AutoModelForCausalLM.from_config(LlamaConfig(**shapes), dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def make_engine(model, path: str, B: int, context: int, weights: str, args, device) -> LLMEngine:
    rc = RuntimeConfig(max_batch_size=B, max_seq_len=context + 64, device=str(device),
                       use_cuda_graphs=device.type == "cuda", quantization="fp8" if weights == "fp8" else None)
    mac = MacConfig(window=args.window, band=args.band, tau=args.tau)
    if path.startswith("mka_"):
        patch_mka(model, MkaConfig()).set_gate(MKA_GATE)
    if path in ("full_hf", "mka_full", "mka_mac"):
        rc = dataclasses.replace(rc, fused_weights=False)
    if path in ("mac", "mka_mac"):
        return LLMEngine(model, mac, rc)
    if path in ("full", "full_hf", "mka_full"):
        return LLMEngine(model, None, rc, method="full")
    cls = {"no_attention": NoAttention, "flashinfer": FlashInferAttention}[path]
    return LLMEngine(model, None, rc, method=lambda n: cls(FullConfig(), ModelDims.of(model), num_slots=n))


def admit_synthetic(eng: LLMEngine, B: int, context: int, seed: int = 0) -> list:
    """``B`` running requests of ``context`` prompt tokens whose KV is random (written straight into
    the pool: nothing is prefilled), each with one generated token, so the next step decodes at ``m = context``."""
    g = torch.Generator().manual_seed(seed)
    vocab = eng.vocab_size
    for _ in range(B):
        eng.submit(eng.make_request(torch.randint(0, vocab, (context,), generator=g), max_new_tokens=8))
    seqs = eng.scheduler.admit()
    assert len(seqs) == B, "the engine could not admit the batch"
    for s in seqs:
        s.output.append(int(torch.randint(0, vocab, (1,), generator=g)))
    kv = eng.executor.kv
    gen = torch.Generator(device=kv.k[0].device).manual_seed(seed)
    for t in kv.k + kv.v:
        t.normal_(generator=gen)
    return seqs


def _record_queries(eng, seqs) -> dict[int, torch.Tensor]:
    """One eager step; every layer's pre-RoPE query ``[B, Hq, d]`` (the rings are appended to, at ``m``)."""
    method, rec = eng.method, {}
    original = method.decode

    def recording(module, layer, query, key, value, q_pre, *a, **kw):
        rec[layer] = q_pre[:, :, 0].detach().clone()
        return original(module, layer, query, key, value, q_pre, *a, **kw)

    paged = eng.executor.decoder
    graphs = paged is not None and paged.use_cuda_graphs
    method.decode = recording
    if graphs:
        paged.use_cuda_graphs = False          # an eager step: the recorder must run (and not be captured)
    try:
        eng.executor.decode_step(seqs)
    finally:
        del method.decode
        if graphs:
            paged.use_cuda_graphs = True
    return rec


def seed_rings(eng, seqs, rate: float, gap: int, gen: torch.Generator) -> None:
    """Each (request, head) of every layer hits with probability ``rate`` at gap ``gap`` (module doc)."""
    state, m = eng.method.state, seqs[0].num_tokens - 1
    for layer in range(eng.executor.num_layers):
        q = _record_queries(eng, seqs)[layer]
        qring, oring, lse, pos = state.layer(layer)
        K = qring.shape[2]
        hit = torch.rand(q.shape[:2], generator=gen) < rate                       # [B, Hq]
        for b, s in enumerate(seqs):
            sign = torch.where(hit[b], 1.0, -1.0).to(q.device, q.dtype).view(-1, 1)
            qring[s.slot, :, (m - gap) % K] = (q[b] * sign).to(qring.dtype)
            oring[s.slot, :, (m - gap) % K] = 0.01
            lse[s.slot, :, (m - gap) % K] = 0.0
            pos[s.slot, (m - gap) % K] = m - gap


def time_step(eng, seqs, reps: int) -> tuple[list[float], torch.Tensor | None]:
    """Capture (through the engine's own step) and time the bucket's greedy graph."""
    eng.executor.decode_step(seqs)                             # captures the bucket's whole-step graph
    paged = eng.executor.decoder
    if paged is None:
        return [], None
    bucket = paged.buckets[paged.bucket_size(len(seqs))]
    us = graph_replay_us(bucket.graphs[paged.step_key(seqs)], reps)
    mp = getattr(eng.method, "last_match_pos", {})     # MAC: views of the bucket's buffers, [B, Hq] per layer
    hits = torch.stack(list(mp.values())) >= 0 if mp else None
    return us, hits


def user_step_us(eng, seqs, reps: int) -> dict:
    """Wall-clock µs of the step a user of the engine gets (``decode_step``: inputs written into the
    bucket, the replay, the tokens read back, MAC's diagnostics), with MAC's diagnostics on and off."""
    out = {}
    method = eng.method
    settings = [("user_step", None)] + ([("user_step_no_diagnostics", False)]
                                        if hasattr(method, "collect_diagnostics") else [])
    for name, diag in settings:
        saved = getattr(method, "collect_diagnostics", None)
        if diag is not None:
            method.collect_diagnostics = diag
        try:
            for _ in range(3):
                eng.executor.decode_step(seqs)
            wall = []
            for _ in range(reps):
                t0 = time.perf_counter()
                eng.executor.decode_step(seqs)
                wall.append((time.perf_counter() - t0) * 1e6)
        finally:
            if diag is not None:
                method.collect_diagnostics = saved
        out[f"{name}_us_median"] = statistics.median(wall)
    return out


def _summary(us: list[float]) -> dict:
    return {"step_us_median": statistics.median(us), "step_us_p10": sorted(us)[len(us) // 10],
            "step_us_p90": sorted(us)[(9 * len(us)) // 10]}


def run_path(model, path: str, B: int, context: int, weights: str, args, device, flashinfer) -> list[dict]:
    base = {"path": path, "weights": weights, "batch": B, "context": context}
    rows = []
    try:
        eng = make_engine(model, path, B, context, weights, args, device)
        seqs = admit_synthetic(eng, B, context)
        ex = eng.executor
        base["weight_bytes"] = ex.fused.weight_bytes() if ex.fused is not None else None
        base["kv_bytes_read_full"] = 2 * ex.num_layers * B * (context + 1) * model.config.num_key_value_heads * \
            ex.head_dim * ex.kv.k[0].element_size()
        if path == "flashinfer":
            eng.method.plan(flashinfer, seqs, eng.config.block_size)
        if path not in ("mac", "mka_mac"):
            us, _ = time_step(eng, seqs, args.reps)
            rows.append({**base, **_summary(us), **user_step_us(eng, seqs, args.reps)} if us else
                        {**base, "note": "no graph (CPU dry run)"})
            return rows
        for rate in args.hit_rates:
            draws = 1 if rate in (0.0, 1.0) else args.draws
            gen = torch.Generator().manual_seed(int(rate * 1000))
            for draw in range(draws):
                seed_rings(eng, seqs, rate, args.gap, gen)
                us, hits = time_step(eng, seqs, args.reps)
                rec = {**base, "path": f"{path}@{rate:g}", "hit_rate_target": rate, "draw": draw,
                       "window": args.window, "band": args.band, "tau": args.tau, "gap": args.gap}
                if hits is not None:
                    rec["hit_rate_measured"] = float(hits.float().mean())
                if us and rate == 1.0:
                    rec.update(user_step_us(eng, seqs, args.reps))
                rows.append({**rec, **_summary(us)} if us else {**rec, "note": "no graph (CPU dry run)"})
                print(json.dumps(rows[-1]), flush=True)
        return rows
    finally:
        if "eng" in locals():
            unbind(eng.executor.model)
            eng.executor.close()
            del eng
        if getattr(model, "_mka_ctx", None) is not None:
            unpatch_mka(model)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def run_hf_compile(model, B: int, context: int, args, device) -> dict:
    """The peer: the transformers model itself, SDPA over a random ``StaticCache``, ``torch.compile``d."""
    from transformers import StaticCache

    rec = {"path": "hf_compile", "weights": "bf16", "batch": B, "context": context,
           "compile_mode": args.compile_mode}
    T = context + 16
    cache = StaticCache(config=model.config, max_cache_len=T)
    ids = torch.full((B, 1), 7, dtype=torch.int64, device=device)
    pos = torch.full((B, 1), context, dtype=torch.int64, device=device)
    cache_pos = torch.tensor([context], device=device)

    def step():
        return model(input_ids=ids, position_ids=pos, cache_position=cache_pos, **{CACHE_KWARG: cache},
                     use_cache=True, logits_to_keep=1).logits.argmax(-1)

    with torch.inference_mode():
        step()                                                   # allocates the cache's tensors
        for layer in cache.layers:
            layer.keys.normal_()
            layer.values.normal_()
        compiled = torch.compile(step, mode=args.compile_mode) if device.type == "cuda" else step
        side = torch.cuda.Stream() if device.type == "cuda" else None
        if side is None:
            compiled()
            return {**rec, "note": "no graph (CPU dry run)"}
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                compiled()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            compiled()
        us = graph_replay_us(graph, args.reps)
    del graph, cache
    torch._dynamo.reset()
    gc.collect()
    torch.cuda.empty_cache()
    return {**rec, **_summary(us)}


def bytes_needed(shapes, B, context, weights: str) -> int:
    L, hkv, d = shapes["num_hidden_layers"], shapes["num_key_value_heads"], shapes["head_dim"]
    kv = 2 * L * B * (context + 64 + 16) * hkv * d * 2
    fp8 = 0 if weights == "bf16" else L * (shapes["hidden_size"] * (shapes["num_attention_heads"] + 2 * hkv) * d * 2
                                          + 3 * shapes["hidden_size"] * shapes["intermediate_size"])
    rings = L * B * shapes["num_attention_heads"] * 1024 * (d * 6 + 4)
    return kv + fp8 + rings + (1 << 30)


def annotate(r: dict, copy_bw: float | None, hbm: float | None) -> dict:
    """Bytes a path must stream per step (weights; + every KV for ``full`` / ``flashinfer``) and the
    fraction of the copy bandwidth and of the nominal HBM bandwidth that the step time reaches."""
    if "step_us_median" in r and r.get("weight_bytes") and r["path"] in ("no_attention", "full", "flashinfer"):
        moved = r["weight_bytes"] + (r["kv_bytes_read_full"] if r["path"] != "no_attention" else 0)
        rate = moved / (r["step_us_median"] * 1e-6)
        r["streamed_bytes"], r["streamed_bytes_per_s"] = moved, rate
        r["fraction_of_copy_bw"] = rate / copy_bw if copy_bw else None
        r["fraction_of_hbm_peak"] = rate / hbm if hbm else None
    return r


def _table(rows: list[dict]) -> str:
    out = [f"{'B x ctx':>12} {'weights':>7} {'path':>14} {'step ms':>9} {'hit':>6} {'x flashinfer':>12} "
           f"{'x hf_compile':>12} {'% copy':>6} {'% HBM':>6}"]
    ref = {(r["batch"], r["context"], r["weights"], r["path"]): r.get("step_us_median") for r in rows}
    pct = lambda v: f"{100 * v:.0f}" if v else ""  # noqa: E731
    for r in rows:
        if "step_us_median" not in r:
            continue
        key = (r["batch"], r["context"])
        fi = ref.get((*key, r["weights"], "flashinfer"))
        hf = ref.get((*key, "bf16", "hf_compile"))
        t = r["step_us_median"]
        out.append(f"{r['batch']:>4} x {r['context']:>6} {r['weights']:>7} {r['path']:>14} {t / 1e3:>9.3f} "
                   f"{r.get('hit_rate_measured', float('nan')):>6.3f} {(fi / t if fi else float('nan')):>12.2f} "
                   f"{(hf / t if hf else float('nan')):>12.2f} {pct(r.get('fraction_of_copy_bw')):>6} "
                   f"{pct(r.get('fraction_of_hbm_peak')):>6}")
    return "\n".join(out)


def plot(report: dict, path: Path) -> None:
    """Step ms per path at every (batch, context, weights) point of ``report``, one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = ["no_attention", "mac@1", "mac@0.99", "mac@0.9", "mac@0.5", "full", "flashinfer", "hf_compile", "full_hf",
             "mka_full", "mka_mac@1"]
    med: dict[tuple, list[float]] = {}
    for r in report["rows"]:
        if "step_us_median" in r:
            med.setdefault((r["batch"], r["context"], r["weights"], r["path"]), []).append(r["step_us_median"])
    points = sorted({k[:3] for k in med}, key=lambda k: (k[2], k[1], k[0]))
    fig, ax = plt.subplots(figsize=(max(8, 1.3 * len(points)), 5))
    width = 0.85 / len(shown)
    for i, name in enumerate(shown):
        ys = [statistics.mean(med[(*p, name)]) / 1e3 if (*p, name) in med else float("nan") for p in points]
        ax.bar([j + i * width for j in range(len(points))], ys, width, label=name)
    ax.set_xticks([j + 0.425 - width / 2 for j in range(len(points))],
                  [f"{b}×{c // 1024}K\n{w}" for b, c, w in points])
    ax.set_yscale("log")
    ax.set_ylabel("ms per decode step (CUDA-graph replay, median)")
    ax.set_title(f"bench_e2e: whole decode step, {report['model']}, {report['device']}")
    ax.legend(ncol=4, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _row_key(r: dict) -> tuple:
    return r["path"], r["weights"], r["batch"], r["context"], r.get("draw", 0)


def merge_reports(old: dict, new: dict) -> dict:
    """``new`` with the rows of ``old`` it does not replace (by path, weights, batch, context, draw);
    ``ValueError`` if the two ran on different devices or software (their timings must not mix)."""
    same = ("device", "device_uuid", "torch", "triton", "transformers", "shapes")
    if any(old.get(k) != new.get(k) for k in same):
        raise ValueError(f"--append: rows of {old.get('device')} {old.get('device_uuid')} (torch {old.get('torch')}) "
                         f"cannot join a run on {new.get('device')} {new.get('device_uuid')} (torch {new.get('torch')})")
    fresh = {_row_key(r) for r in new["rows"]}
    rows = [r for r in old["rows"] if _row_key(r) not in fresh] + new["rows"]
    return {**new, "rows": rows, "runs": old.get("runs", 1) + 1,
            "flashinfer": new["flashinfer"] or old.get("flashinfer"),
            "flashinfer_error": new["flashinfer_error"] if new["flashinfer"] else old.get("flashinfer_error")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes: checks the script")
    ap.add_argument("--grid", nargs="+", default=None, help="BxCTX points (default 1x32768 2x32768 4x32768 "
                                                            "1x131072 2x131072 4x131072; dry: 1x128 2x128)")
    ap.add_argument("--paths", nargs="+", default=list(DEFAULT_PATHS), choices=PATHS)
    ap.add_argument("--weights", nargs="+", default=["bf16", "fp8"], choices=["bf16", "fp8"])
    ap.add_argument("--fp8-paths", nargs="+", default=["no_attention", "full", "mac", "flashinfer"])
    ap.add_argument("--hit-rates", type=float, nargs="+", default=[1.0, 0.99, 0.9, 0.5])
    ap.add_argument("--draws", type=int, default=2, help="random hit patterns per rate below 1")
    ap.add_argument("--window", type=int, default=None, help="ring window K (default 1024; dry 32)")
    ap.add_argument("--band", type=int, default=None, help="band r (default 256; dry 8)")
    ap.add_argument("--tau", type=float, default=0.45)
    ap.add_argument("--gap", type=int, default=None, help="reuse gap m - p of a hit (default 64; dry 4)")
    ap.add_argument("--reps", type=int, default=None, help="timed replays (default 40)")
    ap.add_argument("--compile-mode", default="max-autotune-no-cudagraphs")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/bench_e2e_<gpu>.json; "
                                                "dry run: none)")
    ap.add_argument("--plot", metavar="JSON", default=None, help="only draw JSON's PNG beside it")
    ap.add_argument("--append", action="store_true",
                    help="keep the rows already in --out (same device only) that this run does not replace: "
                         "a grid split over several calls of a machine's time limit")
    args = ap.parse_args(argv)
    if args.plot:
        plot(json.loads(Path(args.plot).read_text()), Path(args.plot).with_suffix(".png"))
        return 0
    dry = args.dry_run
    pick = lambda v, full, tiny: v if v is not None else (tiny if dry else full)  # noqa: E731
    grid = pick(args.grid, ["1x32768", "2x32768", "4x32768", "1x131072", "2x131072", "4x131072"], ["1x128", "2x128"])
    points = [tuple(int(x) for x in p.lower().split("x")) for p in grid]
    args.window, args.band, args.gap = pick(args.window, 1024, 32), pick(args.band, 256, 8), pick(args.gap, 64, 4)
    args.reps = pick(args.reps, 40, 2)
    if not dry and not torch.cuda.is_available():
        print("no CUDA device: run on an H100 or use --dry-run", file=sys.stderr)
        return 2
    device = torch.device("cpu" if dry else "cuda")
    shapes = dict(TINY if dry else LLAMA_8B)
    flashinfer, fi_err = None, None
    if "flashinfer" in args.paths and not dry:
        try:
            import flashinfer
        except Exception as exc:                              # noqa: BLE001 - reported in the JSON
            fi_err = f"{type(exc).__name__}: {exc}"
    paths = [p for p in args.paths if not (p == "flashinfer" and flashinfer is None)]
    model = build_model(shapes, torch.float32 if dry else torch.bfloat16, device)
    name = torch.cuda.get_device_name() if not dry else f"{platform.machine()} CPU"
    uuid = str(torch.cuda.get_device_properties(device).uuid) if not dry else None   # --append: one GPU only
    hbm = next((v for k, v in HBM_BYTES_PER_S.items() if k in name), None)
    import transformers
    import triton

    out = args.out
    if out is None and not dry:
        out = Path(__file__).parent / "results" / f"bench_e2e_{name.split()[1].lower() if len(name.split()) > 1 else 'gpu'}.json"
    previous = json.loads(Path(out).read_text()) if out and args.append and Path(out).exists() else None

    def save(rows: list[dict], final: bool = False) -> dict:
        """The report so far, written after every path (a run cut off by a time limit keeps its rows)."""
        report = {"benchmark": "bench_e2e", "dry_run": dry, "device": name, "device_uuid": uuid, "hbm_bytes_per_s": hbm,
                  "torch": torch.__version__, "triton": triton.__version__, "transformers": transformers.__version__,
                  "flashinfer": getattr(flashinfer, "__version__", None), "flashinfer_error": fi_err,
                  "copy_bytes_per_s": copy_bw, "model": "LLaMA-3.1-8B shapes, random weights" if not dry else "tiny LLaMA (dry run)",
                  "shapes": shapes, "reps": args.reps, "complete": final, "rows": rows}
        if previous is not None:
            report = merge_reports(previous, report)
            for r in report["rows"]:
                annotate(r, copy_bw, hbm)
        if final:
            print(_table(report["rows"]))
        if out:
            Path(out).parent.mkdir(parents=True, exist_ok=True)
            Path(out).write_text(json.dumps(report, indent=2) + "\n")
            if final:
                plot(report, Path(out).with_suffix(".png"))
                print(f"wrote {out} and its .png")
        return report

    copy_bw = copy_bandwidth(device)
    rows: list[dict] = []
    save(rows)                                                # --append: refuses another GPU's rows up front
    for B, context in points:
        for weights in args.weights:
            for path in paths:
                if (weights == "fp8" and path not in args.fp8_paths) or (path == "hf_compile" and weights != "bf16"):
                    continue
                gc.collect()                                  # the last path's engine (reference cycles)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                    free = torch.cuda.mem_get_info()[0]
                    need = bytes_needed(shapes, B, context, weights)
                    if need > free:
                        rows.append({"path": path, "weights": weights, "batch": B, "context": context,
                                     "skipped": f"needs {need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free"})
                        print(json.dumps(rows[-1]), flush=True)
                        continue
                try:
                    if path == "hf_compile":
                        got = [run_hf_compile(model, B, context, args, device)]
                    else:
                        got = run_path(model, path, B, context, weights, args, device, flashinfer)
                except Exception as exc:                      # noqa: BLE001 - one path failing must not stop the rest
                    got = [{"path": path, "weights": weights, "batch": B, "context": context,
                            "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-2000:]}]
                    gc.collect()
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                if device.type == "cuda":
                    for r in got:
                        r["cuda_allocated_gib_after"] = torch.cuda.memory_allocated() / 2**30
                for r in got:
                    annotate(r, copy_bw, hbm)
                    if "@" not in r["path"]:
                        print(json.dumps({k: v for k, v in r.items() if k != "trace"}), flush=True)
                rows += got
                save(rows)
    report = save(rows, final=True)
    return 1 if dry and any("error" in r for r in report["rows"]) else 0


if __name__ == "__main__":
    sys.exit(main())
