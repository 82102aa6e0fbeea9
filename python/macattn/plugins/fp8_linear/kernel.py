"""The FP8 weight-only GEMV: ``out [M, N] = (x [M, K] @ wq [N, K]^T) * scale [N] (+ bias [N])``, M <= 16.

One kernel, ``fp8_gemv``, grid ``(cdiv(N, BLOCK_N),)``: program ``p`` owns the weight rows
``[p*BLOCK_N, (p+1)*BLOCK_N)`` and streams them once over K, ``BLOCK_K`` FP8 bytes per row per step
(16-byte vector loads when K % 16 == 0). Decode is bound by these bytes, so ``BLOCK_N`` is small
(4-32 rows: N = 4096 gives 128-1024 programs for the 132 SMs). The rows of x (re-read from L2 by
every program) are one constexpr block ``BLOCK_M``:

* ``BLOCK_M == 1`` (batch-1 decode), CUDA cores: each weight tile is converted to fp32 in registers
  and multiply-added into an fp32 ``[BLOCK_N, BLOCK_K]`` accumulator, reduced over K once at the end.
* ``BLOCK_M == MMA_ROWS`` (2-16 rows, padded), tensor cores: ``tl.dot(w [BLOCK_N, BLOCK_K], x^T)``
  with the weight converted to x's dtype (exact: every E4M3 value is a bf16 and an fp16 value; the
  conversion goes through fp32, which compiles to cheaper instructions than E4M3 -> f16 -> bf16) and
  fp32 accumulation, software-pipelined (``num_stages``) through shared memory. The padding rows are
  masked off the loads and stores; they cost MMA issue slots only, which a weight-bound GEMV has
  to spare. ``DOT_F32`` (fp32 x, or Triton's interpreter, whose bf16 ``tl.dot`` is wrong) multiplies
  in IEEE fp32 instead (no tensor cores: correct, slower).

The per-row scale and the bias are applied once, in fp32, before the cast to out's dtype.
Pointers: ``x`` fp32/fp16/bf16 ``[M, K]``, row stride ``stride_xm``, unit column stride; ``w``
``*fp8e4nv`` (torch.float8_e4m3fn) ``[N, K]`` contiguous; ``s`` fp32 ``[N]``; ``b`` ``[N]`` any float
dtype, read only if ``HAS_BIAS``; ``out`` ``[M, N]`` contiguous. ``M`` and ``N`` are not specialised
on (they only bound masks), ``K`` is (its divisibility by 16 gives the vector loads).

``BLOCK_N``, ``BLOCK_K``, warps and stages are autotuned per ``(BLOCK_M, N, K)`` and the tensors'
dtypes (``triton.autotune``: the first call of a key benchmarks the configs, with host syncs, so it
must not be inside a CUDA-graph capture; later calls launch the cached best config, capturable).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

__all__ = ["launch_fp8_gemv", "fp8_gemv", "MMA_ROWS"]

MMA_ROWS = 16    # BLOCK_M of the tensor-core variant: tl.dot's smallest tile side

# (BLOCK_N, BLOCK_K, num_warps, num_stages). The CUDA-core loop's loads are not software-pipelined
# by Triton (only loads feeding tl.dot are), so its latency hiding is occupancy: programs per SM.
_ROW_CONFIGS = [triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=s)
                for n, k, w, s in ((4, 1024, 4, 1), (8, 512, 4, 1), (8, 1024, 4, 1), (8, 1024, 8, 1), (16, 1024, 8, 1))]
_MMA_CONFIGS = [triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=s)
                for n, k, w, s in ((16, 256, 4, 4), (16, 512, 4, 3), (32, 256, 4, 4), (32, 512, 4, 3))]


def _fitting(block_m: int, N: int, K: int) -> list[triton.Config]:
    """The configs of the variant ``block_m`` selects, less those with a block larger than the
    problem rounded up to a power of two (masked lanes only); at least the variant's first one."""
    mine = _MMA_CONFIGS if block_m > 1 else _ROW_CONFIGS
    n, k = triton.next_power_of_2(N), triton.next_power_of_2(K)
    return [c for c in mine if c.kwargs["BLOCK_N"] <= n and c.kwargs["BLOCK_K"] <= k] or mine[:1]


def _prune(configs, named_args, **meta):
    return _fitting(meta["BLOCK_M"], named_args["N"], named_args["K"])


@triton.autotune(configs=_ROW_CONFIGS + _MMA_CONFIGS, key=["BLOCK_M", "N", "K"],
                 prune_configs_by={"early_config_prune": _prune},
                 do_bench=functools.partial(do_bench, warmup=5, rep=20))
@triton.jit(do_not_specialize=["M", "N"])
def fp8_gemv(x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, M, N, K, stride_xm,
              HAS_BIAS: tl.constexpr, DOT_F32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    nmask = rn < N
    mmask = rm < M
    w_rows = w_ptr + rn[:, None].to(tl.int64) * K
    if BLOCK_M == 1:
        acc_k = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            kmask = rk < K
            w = tl.load(w_rows + rk[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0,
                        eviction_policy="evict_first")
            x = tl.load(x_ptr + rk, mask=kmask, other=0.0)
            acc_k += w.to(tl.float32) * x.to(tl.float32)[None, :]
        acc = tl.sum(acc_k, axis=1)[:, None]
    else:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            kmask = rk < K
            w = tl.load(w_rows + rk[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0,
                        eviction_policy="evict_first")
            x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=mmask[:, None] & kmask[None, :],
                        other=0.0)
            if DOT_F32:
                acc = tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)), acc, input_precision="ieee")
            else:
                acc = tl.dot(w.to(tl.float32).to(x.dtype), tl.trans(x), acc)
    acc = acc * tl.load(s_ptr + rn, mask=nmask, other=0.0)[:, None]
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=nmask, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptr + rm[None, :] * N + rn[:, None], acc.to(out_ptr.dtype.element_ty),
             mask=nmask[:, None] & mmask[None, :])


def launch_fp8_gemv(x: torch.Tensor, wq: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                    out: torch.Tensor, *, interpret: bool) -> None:
    """Write ``out [M, N]`` for ``x [M, K]`` (1 <= M <= MMA_ROWS, unit column stride), ``wq [N, K]``,
    ``scale [N]``, ``bias [N]`` or None (all contiguous, checked by the caller). ``interpret``
    (Triton's interpreter, no GPU to autotune on): the variant's first config that fits."""
    M, K = x.shape
    N = wq.shape[0]
    block_m = 1 if M == 1 else MMA_ROWS
    args = (x, wq, scale, scale if bias is None else bias, out, M, N, K, x.stride(0))
    meta = dict(HAS_BIAS=bias is not None, DOT_F32=interpret or x.dtype == torch.float32, BLOCK_M=block_m)
    if interpret:
        config = _fitting(block_m, N, K)[0]
        fp8_gemv.fn[(triton.cdiv(N, config.kwargs["BLOCK_N"]),)](*args, **meta, **config.kwargs)
    else:
        fp8_gemv[lambda m: (triton.cdiv(N, m["BLOCK_N"]),)](*args, **meta)
