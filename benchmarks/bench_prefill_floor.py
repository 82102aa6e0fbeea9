"""The hardware floor of serving on the current device, measured (never assumed): what one prefill of a
prompt mix and one decode step cost at the least, for the shapes of the model being served.

    python benchmarks/bench_prefill_floor.py                          # GPU: LLaMA-3.1-8B shapes, every mix
    python benchmarks/bench_prefill_floor.py --mixes 1x32K 4x32K --decode 4x32768
    python benchmarks/bench_prefill_floor.py --dry-run                # CPU, the built-in model, tiny mixes

Importable: ``bench_serving.py`` calls ``measure_floor`` in its own run, so each serving figure sits
beside the floor of the same device and software.

* **Prefill floor of a mix** ``NxL`` (N prompts of L tokens): the GEMM chain of one forward over the
  ``N L`` tokens — per layer the fused QKV ``[T, D] x [D, (Hq + 2 Hkv) d]``, O ``[T, Hq d] x [Hq d, D]``,
  gate/up ``[T, D] x [D, 2 I]`` and down ``[T, I] x [I, D]`` through ``F.linear`` on random weights of the
  model's dtype (bf16 on the GPU), times the layer count; the LM head ``[N, D] x [D, V]`` for the last row
  of each prompt only — plus causal GQA attention of the prompts through torch SDPA, every backend tried
  (cuDNN, flash, memory-efficient; ``enable_gqa=True`` first, K/V heads expanded if that errors), the
  fastest taken, times the layer count. The N equal-length prompts of a mix run as one batched SDPA call
  ``[N, Hq, L, d]`` (what a varlen kernel does at best); nothing else of a forward (norms, RoPE, SiLU,
  residuals, embedding, sampling) is counted. On CUDA the GEMM chain of one layer is one CUDA graph,
  timed as replays; attention runs eagerly, enough calls back to back between two CUDA events for
  >= 2 ms (median of ``--reps`` after ``--warmup``), per call x the layer count; the kernels a backend
  launched are read from the profiler (``kernels``), so a backend that silently dispatched elsewhere shows.
  The best backend is timed once more on token-major storage (``token_major``: the layout the engine's packed
  prefill passes), which shows what the engine's layout costs against the floor's contiguous operands.
* **Chunked-prefill probe**: the query chunk ``[1, Hq, Q, d]`` at offset ``C - Q`` over all ``C`` keys
  with ``torch.nn.attention.bias.causal_lower_right(Q, C)`` (what the engine runs for a chunk after
  earlier ones; default Q = 8K, C = 32K), per backend, against the chunk's share of a whole ``C``-token
  causal prefill of the same backend (its fraction of the causal score area, ``share_fraction``).
* **Decode floor** at batch B, context C: ``LLMEngine`` with MAC off (``MacConfig(enabled=False)``: the
  full-attention step over the paged pool), B synthetic requests admitted as ``bench_e2e`` does (random
  KV, nothing prefilled), the whole step replayed from its CUDA graph (``cuda_timing``); on the CPU the
  eager step's wall clock.

Reported (JSON with every figure, the device and its UUID, torch / triton / transformers / cuDNN
versions; a table): per mix the GEMM ms and TFLOP/s, every backend's attention ms (or its error) and the
best, the floor ms and tokens/s; the probe; decode step ms per point. Shapes and FLOP counts are in the
JSON. ``--dry-run`` (CPU, the built-in model's shapes, tiny mixes; the backends that run on the CPU are
recorded) checks the script in seconds.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import platform
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

__all__ = ["FloorShapes", "MIXES", "DRY_MIXES", "parse_mix", "mix_name", "measure_floor", "prefill_floor",
           "gemm_chain_floor", "attention_floor", "chunk_probe", "decode_floor", "environment", "format_table"]

MIXES = ("1x1K", "16x1K", "1x8K", "1x32K", "4x32K")
DRY_MIXES = ("1x32", "2x32", "1x128")
DECODE_POINTS = ("16x1024", "4x32768")
DRY_DECODE_POINTS = ("2x32",)
GPU_BACKENDS = ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION")
CPU_BACKENDS = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH")   # the dry run: whatever runs on the CPU


@dataclass(frozen=True)
class FloorShapes:
    """The shapes a forward of the served model multiplies by (from its config)."""

    layers: int
    hidden: int
    intermediate: int
    q_heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def of(cls, config) -> "FloorShapes":
        """From a transformers config or a dict of its fields (``bench_e2e.LLAMA_8B``'s keys)."""
        get = (lambda k, default=None: config.get(k, default)) if isinstance(config, dict) else \
            (lambda k, default=None: getattr(config, k, default))
        hq = get("num_attention_heads")
        return cls(layers=get("num_hidden_layers"), hidden=get("hidden_size"),
                   intermediate=get("intermediate_size"), q_heads=hq,
                   kv_heads=get("num_key_value_heads") or hq,
                   head_dim=get("head_dim") or get("hidden_size") // hq, vocab=get("vocab_size"))

    def layer_gemm_flops(self, tokens: int) -> int:
        """FLOPs of one layer's four projections over ``tokens`` rows (2 per multiply-add)."""
        D, d, inter = self.hidden, self.head_dim, self.intermediate
        return 2 * tokens * (D * (self.q_heads + 2 * self.kv_heads) * d + self.q_heads * d * D + D * 2 * inter
                             + inter * D)

    def causal_attention_flops(self, batch: int, seq: int) -> int:
        """FLOPs of one layer's causal attention (QK^T and PV over the lower triangle incl. the diagonal)."""
        return 4 * batch * self.q_heads * self.head_dim * seq * (seq + 1) // 2


def parse_mix(text: str) -> tuple[int, int]:
    """``"16x1K"`` / ``"4x32768"`` -> ``(prompts, tokens per prompt)`` (``K`` = 1024)."""
    n, length = text.lower().split("x")
    length = int(length[:-1]) * 1024 if length.endswith("k") else int(length)
    return int(n), length


def mix_name(n: int, length: int) -> str:
    """``(16, 1024)`` -> ``"16x1K"`` (the inverse of ``parse_mix``)."""
    return f"{n}x{length // 1024}K" if length % 1024 == 0 else f"{n}x{length}"


# --- timing ---------------------------------------------------------------------------------------
def time_ms(fn, *, reps: int, warmup: int, device: torch.device) -> list[float]:
    """ms per call of ``fn`` (``warmup`` untimed calls first): CUDA events around each call on CUDA, the
    wall clock on the CPU. ``fn`` may itself loop (e.g. over layers)."""
    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        out = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e3)
        return out
    torch.cuda.synchronize(device)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for s, e in zip(starts, ends):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize(device)
    return [s.elapsed_time(e) for s, e in zip(starts, ends)]


def _graph_ms(fn, *, reps: int, warmup: int, device: torch.device) -> tuple[list[float], str]:
    """ms per call of ``fn`` as CUDA-graph replays (``cuda_timing.replay_us``) on CUDA, eager elsewhere or
    when the capture fails. Returns ``(ms list, how it was timed)``."""
    if device.type == "cuda":
        try:
            from cuda_timing import replay_us

            return [u / 1e3 for u in replay_us([fn], reps, warmup=warmup, eager=max(1, warmup))], "cuda graph replay"
        except Exception as exc:                              # noqa: BLE001 - reported, eager fallback
            torch.cuda.synchronize(device)
            return time_ms(fn, reps=reps, warmup=warmup, device=device), f"eager (graph failed: {type(exc).__name__})"
    return time_ms(fn, reps=reps, warmup=warmup, device=device), "cpu wall clock"


def _summary(ms: list[float]) -> dict:
    s = sorted(ms)
    return {"median_ms": statistics.median(s), "min_ms": s[0], "max_ms": s[-1], "reps": len(s)}


def kernels_ran(fn, device: torch.device, top: int = 3) -> list[str] | str:
    """The names of the ``top`` kernels (CUDA) or ops (CPU) by device time of one call of ``fn``, read
    from ``torch.profiler`` (an error string if the profiler could not run)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    try:
        with profile(activities=acts) as prof:
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        rows = []
        for ev in prof.key_averages():
            if device.type == "cuda":
                t = getattr(ev, "self_device_time_total", None)
                if t is None:
                    t = getattr(ev, "self_cuda_time_total", 0)
            else:
                t = ev.self_cpu_time_total
            skip = ("cudaLaunch", "cuLaunch", "cudaDeviceSynchronize", "ProfilerStep")
            if t and t > 0 and not ev.key.startswith(skip):
                rows.append((t, ev.key))
        return [k[:160] for _, k in sorted(rows, reverse=True)[:top]]
    except Exception as exc:                                  # noqa: BLE001 - reported in the JSON
        return f"profiler failed: {type(exc).__name__}: {exc}"


def _free_bytes(device: torch.device) -> int | None:
    return torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None


def _pick_best(out: dict) -> bool:
    """Set ``out["best"]`` / ``out["best_ms"]`` to the fastest backend that ran; False when none did."""
    ok = {n: r["ms"] for n, r in out["backends"].items() if "ms" in r}
    if ok:
        out["best"] = min(ok, key=ok.get)
        out["best_ms"] = ok[out["best"]]
    return bool(ok)


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# --- the GEMM chain -------------------------------------------------------------------------------
def gemm_chain_floor(shapes: FloorShapes, tokens: int, last_rows: int, *, dtype: torch.dtype,
                     device: torch.device, reps: int, warmup: int) -> dict:
    """One forward's projections over ``tokens`` rows. Per layer (random ``dtype`` weights, ``F.linear``):
    x ``[T, D]`` -> QKV ``[T, (Hq + 2 Hkv) d]``; attention output ``[T, Hq d]`` -> O ``[T, D]``; x -> gate/up
    ``[T, 2 I]``; act ``[T, I]`` -> down ``[T, D]``. One layer is timed (CUDA graph replays on CUDA) and
    multiplied by the layer count (every layer has the same shapes); the LM head ``[last_rows, D] x [D, V]``
    is timed alone. Returns ms and FLOP figures (``total_ms`` = layers x layer + LM head)."""
    D, inter, d, Hq, Hkv, V = (shapes.hidden, shapes.intermediate, shapes.head_dim, shapes.q_heads,
                               shapes.kv_heads, shapes.vocab)
    el = torch.tensor([], dtype=dtype).element_size()
    need = el * (tokens * (D + (Hq + 2 * Hkv) * d + Hq * d + 2 * inter + inter + D)
                 + D * ((Hq + 2 * Hkv) * d + Hq * d + 2 * inter + inter) + V * D + last_rows * V)
    free = _free_bytes(device)
    base = {"tokens": tokens, "lm_head_rows": last_rows, "bytes_needed": need}
    if free is not None and need > 0.9 * free:
        return {**base, "skipped": f"needs {need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free"}
    g = torch.Generator(device=device).manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g, device=device, dtype=torch.float32).mul_(0.02).to(dtype)

    w_qkv, w_o, w_gu, w_down = rand((Hq + 2 * Hkv) * d, D), rand(D, Hq * d), rand(2 * inter, D), rand(D, inter)
    x, a, h = rand(tokens, D), rand(tokens, Hq * d), rand(tokens, inter)
    w_lm, last = rand(V, D), rand(last_rows, D)

    def layer():
        F.linear(x, w_qkv)
        F.linear(a, w_o)
        F.linear(x, w_gu)
        F.linear(h, w_down)

    try:
        layer_ms, how = _graph_ms(layer, reps=reps, warmup=warmup, device=device)
        lm_ms, _ = _graph_ms(lambda: F.linear(last, w_lm), reps=reps, warmup=warmup, device=device)
    finally:
        del w_qkv, w_o, w_gu, w_down, x, a, h, w_lm, last
        _release(device)
    layer_med, lm_med = statistics.median(layer_ms), statistics.median(lm_ms)
    flops = shapes.layers * shapes.layer_gemm_flops(tokens) + 2 * last_rows * D * V
    total = shapes.layers * layer_med + lm_med
    return {**base, "timing": how, "layer": _summary(layer_ms), "lm_head": _summary(lm_ms),
            "layer_ms": layer_med, "lm_head_ms": lm_med, "total_ms": total, "flops": flops,
            "tflops_per_s": flops / (total * 1e-3) / 1e12 if total > 0 else None}


# --- attention ------------------------------------------------------------------------------------
def _backends(device: torch.device, names=None) -> list[str]:
    return list(names) if names else list(GPU_BACKENDS if device.type == "cuda" else CPU_BACKENDS)


def _sdpa_call(backend: str, q, k, v, *, gqa_native: bool, **kw):
    """``fn()`` running SDPA under ``sdpa_kernel(backend)``; GQA native (``enable_gqa``) or K/V expanded."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    be = getattr(SDPBackend, backend)
    if not gqa_native and k.shape[1] != q.shape[1]:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)

    def fn():
        with sdpa_kernel([be]):
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa_native and k.shape[1] != q.shape[1], **kw)
    return fn


def _time_backend(backend: str, q, k, v, *, layers: int, reps: int, warmup: int, device, **kw) -> dict:
    """One backend (native GQA, else K/V expanded): ``inner`` calls back to back per timed rep, ``inner`` =
    enough calls for >= 2 ms of device time (at most ``layers``: a short call's launch gaps then hide behind
    the queue), ms per call = rep / inner, ``ms`` = per call x ``layers``. Returns ``{"ms", "ms_per_layer",
    "inner", "gqa": "native"|"expanded", "kernels": [...]}`` or ``{"error": ...}``."""
    errors = []
    for native in (True, False):
        try:
            fn = _sdpa_call(backend, q, k, v, gqa_native=native, **kw)
            est = statistics.median(time_ms(fn, reps=1, warmup=1, device=device))   # raises if the backend cannot run
            inner = max(1, min(layers, math.ceil(2.0 / max(est, 1e-3))))

            def calls():
                for _ in range(inner):
                    fn()
            ms = [t / inner for t in time_ms(calls, reps=reps, warmup=max(0, warmup - 1), device=device)]
            per = statistics.median(ms)
            return {"gqa": "native" if native else "expanded", "inner": inner, **_summary(ms), "ms_per_layer": per,
                    "ms": per * layers, "kernels": kernels_ran(fn, device),
                    **({"native_gqa_error": errors[0]} if errors else {})}
        except Exception as exc:                              # noqa: BLE001 - recorded per backend
            errors.append(f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}")
            _release(device)
    return {"error": " | ".join(errors)}


def attention_floor(shapes: FloorShapes, batch: int, seq: int, *, dtype: torch.dtype, device: torch.device,
                    reps: int, warmup: int, backends=None) -> dict:
    """Causal GQA attention of ``batch`` prompts of ``seq`` tokens (q ``[B, Hq, S, d]``, k / v
    ``[B, Hkv, S, d]``, ``dtype``, contiguous), every SDPA backend of ``backends`` (``_time_backend``). Returns
    per backend its figures (or error) and ``best`` / ``best_ms`` (all layers: per call x layer count), and
    ``token_major``: the best backend again on the same values stored token-major (``[B, S, H, d]`` memory
    viewed as ``[B, H, S, d]``, the layout the engine's packed prefill hands it), which the floor does not take."""
    g = torch.Generator(device=device).manual_seed(1)
    mk = lambda h: torch.randn(batch, h, seq, shapes.head_dim, generator=g, device=device, dtype=dtype)  # noqa: E731
    q, k, v = mk(shapes.q_heads), mk(shapes.kv_heads), mk(shapes.kv_heads)
    out = {"batch": batch, "seq": seq, "flops": shapes.layers * shapes.causal_attention_flops(batch, seq),
           "backends": {}}
    try:
        for be in _backends(device, backends):
            out["backends"][be] = _time_backend(be, q, k, v, layers=shapes.layers, reps=reps, warmup=warmup,
                                                device=device, is_causal=True)
        if _pick_best(out):
            out["tflops_per_s"] = out["flops"] / (out["best_ms"] * 1e-3) / 1e12
            q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
            out["token_major"] = {"backend": out["best"], **_time_backend(
                out["best"], q, k, v, layers=shapes.layers, reps=reps, warmup=warmup, device=device, is_causal=True)}
    finally:
        del q, k, v
        _release(device)
    return out


def prefill_floor(shapes: FloorShapes, n: int, length: int, *, dtype, device, reps: int, warmup: int,
                  backends=None) -> dict:
    """The floor of prefilling ``n`` prompts of ``length`` tokens: GEMM chain over ``n * length`` tokens
    (LM head for ``n`` rows) + the best backend's causal attention, all layers. ``floor_ms`` is None
    when either part could not run."""
    gemm = gemm_chain_floor(shapes, n * length, n, dtype=dtype, device=device, reps=reps, warmup=warmup)
    attn = attention_floor(shapes, n, length, dtype=dtype, device=device, reps=reps, warmup=warmup,
                           backends=backends)
    rec = {"mix": mix_name(n, length), "prompts": n, "prompt_len": length, "gemm": gemm, "attention": attn}
    if "total_ms" in gemm and "best_ms" in attn:
        rec["floor_ms"] = gemm["total_ms"] + attn["best_ms"]
        rec["tokens_per_s"] = n * length / (rec["floor_ms"] * 1e-3)
        rec["attention_share"] = attn["best_ms"] / rec["floor_ms"]
    else:
        rec["floor_ms"] = None
    return rec


def _lower_right_share(chunk: int, context: int) -> float:
    """The chunk's share of a whole causal prefill's score area: rows ``context - chunk .. context - 1``
    (row ``i`` sees ``i + 1`` keys) over all ``context`` rows."""
    start = context - chunk
    rows = chunk * (start + 1) + chunk * (chunk - 1) // 2
    return rows / (context * (context + 1) / 2)


def chunk_probe(shapes: FloorShapes, chunk: int, context: int, *, dtype, device, reps: int, warmup: int,
                backends=None, whole: dict | None = None) -> dict:
    """A query chunk ``[1, Hq, chunk, d]`` at offset ``context - chunk`` over ``context`` keys with
    ``causal_lower_right(chunk, context)``, per backend, vs the chunk's share of a whole ``context``-token
    causal prefill of the same backend (``whole``: ``attention_floor(shapes, 1, context)``'s result, measured
    here when None). Times are all layers."""
    from torch.nn.attention.bias import causal_lower_right

    if whole is None:
        whole = attention_floor(shapes, 1, context, dtype=dtype, device=device, reps=reps, warmup=warmup,
                                backends=backends)
    g = torch.Generator(device=device).manual_seed(2)
    q = torch.randn(1, shapes.q_heads, chunk, shapes.head_dim, generator=g, device=device, dtype=dtype)
    k = torch.randn(1, shapes.kv_heads, context, shapes.head_dim, generator=g, device=device, dtype=dtype)
    v = torch.randn_like(k)
    frac = _lower_right_share(chunk, context)
    out = {"chunk": chunk, "context": context, "offset": context - chunk, "share_fraction": frac,
           "mask": f"causal_lower_right({chunk}, {context})", "backends": {}}
    try:
        for be in _backends(device, backends):
            r = _time_backend(be, q, k, v, layers=shapes.layers, reps=reps, warmup=warmup, device=device,
                              attn_mask=causal_lower_right(chunk, context))
            w = whole["backends"].get(be, {})
            if "ms" in r and "ms" in w:
                r["whole_ms"] = w["ms"]
                r["share_ms"] = w["ms"] * frac
                r["ratio_to_share"] = r["ms"] / r["share_ms"]
            out["backends"][be] = r
    finally:
        del q, k, v
        _release(device)
    if _pick_best(out):
        if "best_ms" in whole:
            out["best_whole_ms"] = whole["best_ms"]
            out["best_share_ms"] = whole["best_ms"] * frac
            out["best_ratio_to_share"] = out["best_ms"] / out["best_share_ms"]
    return out


# --- decode ---------------------------------------------------------------------------------------
def decode_floor(model, batch: int, context: int, *, reps: int, device: torch.device) -> dict:
    """One decode step of ``batch`` requests at context ``context`` through ``LLMEngine`` with MAC off
    (``MacConfig(enabled=False)``; full attention over the paged pool), requests admitted with random KV
    (``bench_e2e.admit_synthetic``). CUDA: the bucket's whole-step graph replayed (``bench_e2e.time_step``);
    CPU: the eager step's wall clock. ``model`` is bound for the measurement and unbound after."""
    from bench_e2e import admit_synthetic, time_step

    from macattn.methods.mac.config import MacConfig
    from macattn.models.attention import unbind
    from macattn.runtime.config import RuntimeConfig
    from macattn.runtime.engine import LLMEngine

    rec = {"batch": batch, "context": context, "mac": "off"}
    rc = RuntimeConfig(max_batch_size=batch, max_seq_len=context + 64, device=str(device),
                       use_cuda_graphs=device.type == "cuda")
    eng = LLMEngine(model, MacConfig(enabled=False), rc)
    try:
        if hasattr(eng.method, "collect_diagnostics"):    # the floor: no per-step bookkeeping in the graph
            eng.method.collect_diagnostics = False
        seqs = admit_synthetic(eng, batch, context)
        if device.type == "cuda":
            us, _ = time_step(eng, seqs, reps)
            if not us:
                raise RuntimeError("the engine captured no decode graph")
            ms, how = [u / 1e3 for u in us], "cuda graph replay (bench_e2e.time_step)"
        else:
            ms = time_ms(lambda: eng.executor.decode_step(seqs), reps=reps, warmup=1, device=device)
            how = "cpu wall clock (eager step)"
        rec.update(timing=how, **_summary(ms), step_ms=statistics.median(ms))
        rec["tokens_per_s"] = batch / (rec["step_ms"] * 1e-3)
    finally:
        unbind(eng.executor.model)
        del eng
        _release(device)
    return rec


# --- everything -----------------------------------------------------------------------------------
def environment(device: torch.device) -> dict:
    """Device name and UUID, driver-side versions and the software that ran (for the JSON)."""
    env = {"device": f"{platform.machine()} CPU", "device_uuid": None, "torch": torch.__version__,
           "python": platform.python_version(), "cuda": torch.version.cuda}
    try:
        import triton
        env["triton"] = triton.__version__
    except Exception:                                          # noqa: BLE001 - optional on the CPU
        env["triton"] = None
    try:
        import transformers
        env["transformers"] = transformers.__version__
    except Exception:                                          # noqa: BLE001
        env["transformers"] = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(device=torch.cuda.get_device_name(device), device_uuid=str(props.uuid),
                   total_memory_gib=props.total_memory / 2**30, cudnn=torch.backends.cudnn.version(),
                   sm_count=props.multi_processor_count)
    return env


def measure_floor(shapes: FloorShapes, *, mixes=(), decode_points=(), model=None, device="cuda",
                  dtype=torch.bfloat16, reps: int = 5, warmup: int = 2, backends=None,
                  probe: tuple[int, int] | None = None, log=print) -> dict:
    """Every floor asked for, on ``device``: ``mixes`` (``"NxL"`` strings or ``(N, L)``) -> prefill floors,
    ``decode_points`` (``"BxC"`` or ``(B, C)``) -> decode floors (needs ``model``, a ``*ForCausalLM`` on
    ``device``; skipped without), ``probe`` ``(chunk, context)`` -> the chunked-prefill probe. Each entry
    that fails carries ``error`` (the others still run). Returns the JSON-ready dict."""
    device = torch.device(device)
    report = {"benchmark": "bench_prefill_floor", **environment(device), "dtype": str(dtype).replace("torch.", ""),
              "shapes": asdict(shapes), "reps": reps, "warmup": warmup,
              "backends_tried": _backends(device, backends), "prefill": {}, "decode": {}, "chunk_probe": None}
    for m in mixes:
        n, length = parse_mix(m) if isinstance(m, str) else m
        name = mix_name(n, length)
        t0 = time.perf_counter()
        try:
            rec = prefill_floor(shapes, n, length, dtype=dtype, device=device, reps=reps, warmup=warmup,
                                backends=backends)
        except Exception as exc:                              # noqa: BLE001 - one mix failing must not stop the rest
            rec = {"mix": name, "floor_ms": None, "error": f"{type(exc).__name__}: {exc}",
                   "trace": traceback.format_exc()[-1500:]}
            _release(device)
        rec["measure_s"] = time.perf_counter() - t0
        report["prefill"][name] = rec
        log(f"prefill floor {name}: {_fmt(rec.get('floor_ms'))} ms "
            f"(gemm {_fmt(rec.get('gemm', {}).get('total_ms'))}, "
            f"attention {_fmt(rec.get('attention', {}).get('best_ms'))} "
            f"{rec.get('attention', {}).get('best', '')}){' ' + rec['error'] if 'error' in rec else ''}")
    if probe is not None:
        chunk, context = probe
        whole = next((r["attention"] for r in report["prefill"].values()
                      if r.get("prompts") == 1 and r.get("prompt_len") == context and "attention" in r), None)
        try:
            report["chunk_probe"] = chunk_probe(shapes, chunk, context, dtype=dtype, device=device, reps=reps,
                                                warmup=warmup, backends=backends, whole=whole)
        except Exception as exc:                              # noqa: BLE001
            report["chunk_probe"] = {"chunk": chunk, "context": context, "error": f"{type(exc).__name__}: {exc}"}
            _release(device)
        cp = report["chunk_probe"]
        log(f"chunk probe {chunk} at {context - chunk} of {context}: best {cp.get('best')} "
            f"{_fmt(cp.get('best_ms'))} ms "
            f"vs share {_fmt(cp.get('best_share_ms'))} ms")
    for p in decode_points:
        B, C = parse_mix(p) if isinstance(p, str) else p
        key = f"{B}x{C}"
        if model is None:
            report["decode"][key] = {"batch": B, "context": C, "step_ms": None, "skipped": "no model given"}
            continue
        t0 = time.perf_counter()
        try:
            rec = decode_floor(model, B, C, reps=max(reps, 10) if device.type == "cuda" else reps, device=device)
        except Exception as exc:                              # noqa: BLE001
            rec = {"batch": B, "context": C, "step_ms": None, "error": f"{type(exc).__name__}: {exc}",
                   "trace": traceback.format_exc()[-1500:]}
            _release(device)
        rec["measure_s"] = time.perf_counter() - t0
        report["decode"][key] = rec
        log(f"decode floor {key}: {_fmt(rec.get('step_ms'))} ms/step{' ' + rec['error'] if 'error' in rec else ''}")
    return report


def _fmt(v, spec: str = ".2f") -> str:
    return format(v, spec) if isinstance(v, (int, float)) else "-"


def format_table(report: dict) -> str:
    """The floors as a table (prefill per mix with every backend's attention ms, the probe, decode)."""
    bes = report.get("backends_tried", [])
    cols = " ".join(f"{b.split('_')[0].lower() + ' ms':>11}" for b in bes)
    head = f"{'mix':>7} {'gemm ms':>9} {'TFLOP/s':>8} {cols} {'best':>10} {'floor ms':>9} {'tok/s':>9}"
    lines = [f"prefill floor ({report.get('device')}, {report.get('dtype')}, {report['shapes']['layers']} layers; "
             "attention ms are all layers)", head]
    for name, r in report["prefill"].items():
        g, a = r.get("gemm", {}), r.get("attention", {})
        cells = []
        for b in bes:
            br = a.get("backends", {}).get(b, {})
            cells.append(f"{_fmt(br.get('ms')) if 'ms' in br else 'err':>11}")
        lines.append(f"{name:>7} {_fmt(g.get('total_ms')):>9} {_fmt(g.get('tflops_per_s'), '.0f'):>8} "
                     + " ".join(cells) + f" {str(a.get('best', '-')).split('_')[0].lower():>10} "
                     f"{_fmt(r.get('floor_ms')):>9} {_fmt(r.get('tokens_per_s'), '.0f'):>9}")
        tm = a.get("token_major", {})
        if "ms" in tm:
            lines.append(f"{'':>7} the best backend on token-major operands (the engine's layout): {_fmt(tm['ms'])} ms "
                         f"({_fmt(tm['ms'] / a['best_ms'])}x the contiguous call)")
    cp = report.get("chunk_probe")
    if cp:
        lines.append(f"chunk probe: {cp['chunk']} queries at offset {cp.get('offset')} over {cp['context']} keys "
                     f"({cp.get('mask')}); share of a whole causal prefill {_fmt(cp.get('share_fraction'), '.4f')}")
        for b, r in cp.get("backends", {}).items():
            lines.append(f"  {b:<20} chunk {_fmt(r.get('ms')):>9} ms  share {_fmt(r.get('share_ms')):>9} ms  "
                         f"ratio {_fmt(r.get('ratio_to_share')):>6}  gqa {r.get('gqa', '-')}"
                         + (f"  error {r['error'][:80]}" if "error" in r else ""))
    if report.get("decode"):
        lines.append(f"{'decode BxC':>12} {'step ms':>9} {'tok/s':>9}  (MAC off)")
        for key, r in report["decode"].items():
            lines.append(f"{key:>12} {_fmt(r.get('step_ms'), '.3f'):>9} {_fmt(r.get('tokens_per_s'), '.0f'):>9}"
                         + (f"  {r.get('error') or r.get('skipped')}" if r.get("step_ms") is None else ""))
    return "\n".join(lines)


def load_model(name: str, device: torch.device, dtype: torch.dtype):
    """``"llama8b-random"`` (LLaMA-3.1-8B shapes, random weights, ``bench_e2e.build_model``), ``"builtin"``
    (the packaged checkpoint) or a transformers directory -> ``(model on device, tokenizer or None)``."""
    if name == "llama8b-random":
        from bench_e2e import LLAMA_8B, build_model

        return build_model(LLAMA_8B, dtype, device), None
    if name == "builtin":
        from macattn.models.checkpoint import load_builtin_checkpoint

        model, tok = load_builtin_checkpoint(dtype=dtype)
        return model.to(device).eval(), tok
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype, attn_implementation="sdpa").to(device).eval()
    return model, AutoTokenizer.from_pretrained(name)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="llama8b-random (default on CUDA), builtin (dry run) or a directory")
    ap.add_argument("--mixes", nargs="+", default=None, help=f"NxL prompt mixes (default {' '.join(MIXES)})")
    ap.add_argument("--decode", nargs="*", default=None, help=f"BxC decode points (default {' '.join(DECODE_POINTS)})")
    ap.add_argument("--probe", default=None, help="CHUNKxCONTEXT of the chunked-prefill probe (default 8192x32768; "
                                                  "'none' skips)")
    ap.add_argument("--backends", nargs="+", default=None, help="SDPBackend names (default: cuDNN, flash, efficient)")
    ap.add_argument("--reps", type=int, default=None, help="timed reps (default 5; dry 2)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed calls first (default 2; dry 1)")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/bench_prefill_floor_<gpu>.json; "
                                                "dry run: none)")
    ap.add_argument("--dry-run", action="store_true", help="CPU, the built-in model's shapes, tiny mixes")
    args = ap.parse_args(argv)
    dry = args.dry_run
    if not dry and not torch.cuda.is_available():
        print("no CUDA device: run on a GPU or use --dry-run", file=sys.stderr)
        return 2
    device = torch.device("cpu" if dry else "cuda")
    dtype = torch.float32 if dry else torch.bfloat16
    mixes = args.mixes or list(DRY_MIXES if dry else MIXES)
    points = args.decode if args.decode is not None else list(DRY_DECODE_POINTS if dry else DECODE_POINTS)
    probe_arg = args.probe or ("32x128" if dry else "8192x32768")
    probe = None if probe_arg == "none" else parse_mix(probe_arg)
    name = args.model or ("builtin" if dry else "llama8b-random")
    model = None
    if points or name != "llama8b-random":         # the random 8B is built only when a decode point needs it
        model, _ = load_model(name, device, dtype)
    if model is not None:
        shapes = FloorShapes.of(model.config)
    else:
        from bench_e2e import LLAMA_8B

        shapes = FloorShapes.of(LLAMA_8B)
    report = measure_floor(shapes, mixes=mixes, decode_points=points, model=model, device=device, dtype=dtype,
                           reps=args.reps or (2 if dry else 5), warmup=args.warmup or (1 if dry else 2),
                           backends=args.backends, probe=probe)
    report["model"] = name
    report["dry_run"] = dry
    print(format_table(report))
    out = args.out
    if out is None and not dry:
        tag = report["device"].split()[1].lower() if len(report["device"].split()) > 1 else "gpu"
        out = Path(__file__).parent / "results" / f"bench_prefill_floor_{tag}.json"
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(report, indent=2, default=str) + "\n")
        print(f"wrote {out}")
    failed = [k for k, r in report["prefill"].items() if r.get("floor_ms") is None]
    failed += [k for k, r in report["decode"].items() if r.get("step_ms") is None and "skipped" not in r]
    if failed:
        print(f"no floor for: {', '.join(failed)}", file=sys.stderr)
    return 1 if dry and failed else 0


if __name__ == "__main__":
    sys.exit(main())
