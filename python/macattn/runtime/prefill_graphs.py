"""CUDA graphs of a packed prefill's work around the attention (vLLM's piecewise graphs).

A packed prefill of a few thousand tokens is host-bound: at 8B shapes on an H100 a 1K-token call launches
~900 kernels, 66 ms of host time for 28 ms of GPU time under torch.profiler (``benchmarks/notes/serving.md``).
Everything but the attention is the same shape for every call of ``N`` tokens, so it is captured once per token
bucket and replayed; the attention — the method's, over each request's own segment and history — runs eagerly between
the pieces, as the method would run it without graphs.

Per bucket of ``Nb`` tokens (``graph_buckets``: ``PREFILL_GRAPH_BUCKETS``, and each plus the decode rows a mixed
step may carry), ``L + 1`` graphs:

* piece 0: embedding, RoPE tables, layer 0's norm, QKV projection, RoPE and the KV append;
* piece ``i`` (``1 .. L - 1``): layer ``i - 1`` after its attention (O projection, residual, MLP, residual,
  norm), then layer ``i``'s QKV projection, RoPE and KV append;
* piece ``L``: the last layer after its attention and the final norm.

Between pieces ``i`` and ``i + 1`` the eager attention of layer ``i`` reads ``q / k / v [1, H, N, d]`` (the
first ``N`` rows of the bucket's static buffers) and writes its output rows into the static input of the next
piece. The call's ``N`` tokens are padded to ``Nb`` with token 0 at position 0 whose K/V go to the pool's
scratch row; padded rows are never attended to and their logits never read. Every piece reads and writes
only the bucket's static buffers (its temporaries are freed inside the piece), so all buckets share one
memory pool. Not used under tensor parallelism (its collectives would have to replay on every rank alike).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from macattn.runtime.kv_cache import PrefillView

__all__ = ["PrefillGraphs", "PREFILL_GRAPH_BUCKETS", "graph_buckets"]

# Token counts with captured pieces: a packed call of N tokens replays the smallest bucket >= N (at most 255
# padded tokens, ~4 ms of GEMMs at 8B shapes). Calls above the largest are GPU-bound and run eagerly.
PREFILL_GRAPH_BUCKETS = (256, 512, 768, 1024, 1280, 1536, 1792, 2048)


def graph_buckets(decode_rows: int) -> tuple[int, ...]:
    """``PREFILL_GRAPH_BUCKETS`` and each of them plus ``decode_rows``: a mixed step's chunk of a bucket's size with
    up to that many decode rows after it (``core.ragged.DecodeTail``) replays a bucket of its own size, not the next
    one (1,024 + 11 tokens padded to 1,280 took a 1K mixed step from ~28 to ~35 ms on the H100)."""
    return tuple(sorted(set(PREFILL_GRAPH_BUCKETS) | {s + decode_rows for s in PREFILL_GRAPH_BUCKETS}))


@dataclass
class _Bucket:
    """One bucket's static tensors (token-major underneath; ``q / k / v`` are ``[1, H, Nb, d]`` views) and
    its ``L + 1`` graphs (empty when running eagerly)."""

    size: int
    host: torch.Tensor            # [3, Nb] int64 (pinned on CUDA): ids, positions, pool rows
    inputs: torch.Tensor          # [3, Nb] int64 on the device
    cos: torch.Tensor             # [1, Nb, d]
    sin: torch.Tensor
    residual: torch.Tensor        # [Nb, D]
    attn: torch.Tensor            # [Nb, Hq d]: the eager attention's output rows
    q: torch.Tensor               # [1, Hq, Nb, d]
    k: torch.Tensor               # [1, Hkv, Nb, d]
    v: torch.Tensor
    q_pre: torch.Tensor | None    # [1, Nb, Hq d] (methods that read the pre-RoPE query)
    h: torch.Tensor               # [Nb, D]: the final-normed hidden state
    graphs: list = field(default_factory=list)
    copied: torch.cuda.Event | None = None


class PrefillGraphs:
    """The piecewise graphs of ``fused`` (a ``FusedForward``) over ``cache`` (a ``PagedKVCache``).

    pad_row: the pool row padded tokens write their K/V to (the scratch block's); needs_q_pre: whether the
    bound method reads the pre-RoPE query; capture: False runs the same pieces eagerly (the CPU, tests)."""

    def __init__(self, fused, cache, *, pad_row: int, needs_q_pre: bool, capture: bool = True,
                 buckets: tuple[int, ...] = PREFILL_GRAPH_BUCKETS) -> None:
        self.fused, self.cache, self.pad_row = fused, cache, pad_row
        self.needs_q_pre, self.capture, self.sizes = needs_q_pre, capture, tuple(sorted(buckets))
        self.device = fused.lm_head.weight.device
        self.buckets: dict[int, _Bucket] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None

    @property
    def max_tokens(self) -> int:
        return self.sizes[-1]

    def bucket_size(self, n: int) -> int | None:
        """The bucket a call of ``n`` tokens replays (None: above the largest, eager)."""
        return next((s for s in self.sizes if s >= n), None)

    @torch.inference_mode()
    def prewarm(self) -> list[int]:
        """Build (and capture) every bucket now, so no request pays it; returns the sizes."""
        for s in self.sizes:
            self._bucket(s)
        return list(self.sizes)

    # --- one call ----------------------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor,
            logits_at: torch.Tensor, tail_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The fused forward of one packed call, inside the runtime's step context: ``ids / positions / rows
        [N]`` int64 on the CPU (token ids, their positions, their pool rows), ``logits_at [n]`` int64 on the
        device (indices < N); ``tail_ids [t]`` int64 on the device: the last ``t`` token ids instead of ``ids``'
        (a decode tail's, pending on the device). Returns the logits ``[n, V]``."""
        N = ids.numel()
        b = self._bucket(self.bucket_size(N))
        self._write_inputs(b, ids, positions, rows)
        if tail_ids is not None:
            b.inputs[0, N - tail_ids.numel():N].copy_(tail_ids)
        layers = self.fused.layers
        for i, layer in enumerate(layers):
            self._piece(b, i)
            q_pre = b.q_pre[:, :N] if b.q_pre is not None else None
            out = layer.attend(b.q[:, :, :N], b.k[:, :, :N], b.v[:, :, :N], q_pre, None)
            b.attn[:N].copy_(out)
        self._piece(b, len(layers))
        return self.fused.logits(b.h, 1, b.size, logits_at)

    def _write_inputs(self, b: _Bucket, ids, positions, rows) -> None:
        N = ids.numel()
        if b.copied is not None:
            b.copied.synchronize()        # the previous call's copy has left the pinned buffer
        h = b.host
        h[0, :N], h[1, :N], h[2, :N] = ids, positions, rows
        h[0, N:], h[1, N:], h[2, N:] = 0, 0, self.pad_row
        b.inputs.copy_(h, non_blocking=True)
        if b.copied is not None:
            b.copied.record()

    def _piece(self, b: _Bucket, i: int) -> None:
        if b.graphs:
            b.graphs[i].replay()
        else:
            self._run_piece(b, i)

    # --- the pieces --------------------------------------------------------------------------------------
    def _run_piece(self, b: _Bucket, i: int) -> None:
        """Piece ``i`` over ``b``'s static tensors (what graph ``i`` captures)."""
        f, n = self.fused, b.size
        layers = f.layers
        if i == 0:
            h, residual, cos, sin = f.begin(b.inputs[0].view(1, n), b.inputs[1].view(1, n))
            b.cos.copy_(cos)
            b.sin.copy_(sin)
        else:
            h, residual = f.finish_layer(i - 1, b.attn, b.residual)
        if i == len(layers):
            b.h.copy_(h)
            return
        b.residual.copy_(residual)
        q, k, v, q_pre = layers[i].project(h, 1, n, b.cos, b.sin, PrefillView(self.cache, b.inputs[2]), f.kernels)
        b.q.copy_(q)
        b.k.copy_(k)
        b.v.copy_(v)
        if b.q_pre is not None:
            b.q_pre.copy_(q_pre)

    def _bucket(self, size: int) -> _Bucket:
        b = self.buckets.get(size)
        if b is None:
            b = self.buckets[size] = self._new_bucket(size)
            if self.capture:
                self._capture(b)
        return b

    def _new_bucket(self, n: int) -> _Bucket:
        f, dev = self.fused, self.device
        layer = f.layers[0]
        hq, hkv, d = layer.num_q_heads, layer.num_kv_heads, layer.head_dim
        D, dt = f.norm.weight.shape[0], f.lm_head.weight.dtype
        cuda = dev.type == "cuda"
        zeros = lambda *shape: torch.zeros(*shape, dtype=dt, device=dev)   # noqa: E731 - finite padding rows
        return _Bucket(
            size=n, host=torch.zeros(3, n, dtype=torch.int64, pin_memory=cuda),
            inputs=torch.zeros(3, n, dtype=torch.int64, device=dev),
            cos=zeros(1, n, d), sin=zeros(1, n, d), residual=zeros(n, D), attn=zeros(n, hq * d),
            q=zeros(n, hq, d).transpose(0, 1).unsqueeze(0), k=zeros(n, hkv, d).transpose(0, 1).unsqueeze(0),
            v=zeros(n, hkv, d).transpose(0, 1).unsqueeze(0),
            q_pre=zeros(1, n, hq * d) if self.needs_q_pre else None, h=zeros(n, D),
            copied=torch.cuda.Event() if cuda else None)

    def _capture(self, b: _Bucket) -> None:
        """Warm every piece up once on a side stream (kernel compilation, library handles), then capture
        them in replay order into the shared pool. The inputs then are padding only: the pieces write the
        scratch row of the pool and the bucket's own buffers."""
        self._write_inputs(b, torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64),
                           torch.zeros(0, dtype=torch.int64))
        pieces = range(len(self.fused.layers) + 1)
        dev = self.device
        s = torch.cuda.Stream(dev)
        s.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(s):
            for i in pieces:
                self._run_piece(b, i)
        torch.cuda.current_stream(dev).wait_stream(s)
        graphs = []
        for i in pieces:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool, capture_error_mode="thread_local"):
                self._run_piece(b, i)
            graphs.append(g)
        b.graphs = graphs
