"""CUDA implementation of ``macattn::route_fused_attention`` (registered by
``macattn.methods.mka.ops.register_cuda_kernels``; the JIT impl of the ``mac::route_fused`` plugin).

Two launches (``kernel.py``): ``mka_route_partial_update`` (routing MLP split over ``Dq`` + the memory
summary update) and ``mka_fuse_project`` (routing finished, ``f`` formed in registers, K and V projected in
one grid). ``RouteFusedLaunch`` holds the launch constants (swept by ``benchmarks/bench_mka_decode.py
--sweep``); ``RouteFusedPlan`` is one call's shapes, scratch and grids, its two launches callable one by
one (the benchmark's per-kernel profile).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton

from macattn.core.validation import check_int

from ..aot import destination
from ..triton_util import interpreting
from .checks import check_route_fused_inputs
from .kernel import mka_fuse_project, mka_route_partial_update

__all__ = ["RouteFusedLaunch", "DEFAULT_LAUNCH", "RouteFusedPlan", "route_fused_attention_triton"]

_alloc = torch.empty   # the tests swap in a NaN-filling allocator to check every output element is written
_HALVES = (torch.float16, torch.bfloat16)


def _pow2(name: str, v: int, lo: int) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or v & (v - 1):
        raise ValueError(f"{name} must be a power of two >= {lo}, got {v!r}")


@dataclass(frozen=True)
class RouteFusedLaunch:
    """Launch constants of the two kernels.

    split: ``q`` / ``x`` columns per program of ``mka_route_partial_update`` (grid ``cdiv(max(D, Dq), split)``);
    route_warps: its warps. block_n: K/V outputs per program of ``mka_fuse_project`` (grid
    ``cdiv(Nk, block_n) + cdiv(Nv, block_n)`` by row blocks); block_d: its ``D`` step; warps / stages: its
    warps and software-pipeline depth. max_block_b: most request rows per program (rows are padded to
    16, the tensor cores' smallest M; 32 spills at the default block_d on sm_90a); s_block: partial sums
    reduced per step of the routing prologue. A kernel whose dot runs in IEEE fp32 takes these capped by
    ``F32_CAPS`` (``RouteFusedPlan.launch`` is what ran).

    The default (sm_90a, Triton 3.9, bf16, 8B shapes): ``mka_fuse_project`` 255 registers, no spills, 96 KiB of
    shared memory for 4 stages; ``mka_route_partial_update`` 158 registers (``ptxas -v``; the table is in
    ``benchmarks/notes/mka_decode.md``).
    """

    split: int = 128
    route_warps: int = 4
    block_n: int = 16
    block_d: int = 256
    warps: int = 4
    stages: int = 4
    max_block_b: int = 16
    s_block: int = 8

    def __post_init__(self):
        for name, lo in (("split", 16), ("block_n", 16), ("block_d", 16), ("max_block_b", 16), ("s_block", 1),
                         ("route_warps", 1), ("warps", 1)):
            _pow2(name, getattr(self, name), lo)
        check_int("stages", self.stages, 1)


DEFAULT_LAUNCH = RouteFusedLaunch()


# Caps on the constants where a kernel's dot runs in IEEE fp32 on the GPU (fp32 weights, or the patched model's fp32
# router against bf16 queries): its operands take 2x the registers and shared memory (sm_90a, Triton 3.9: the
# route kernel spills 4 KiB at split 128, the projection asks 288 KiB of shared memory at block_d 256 x 4 stages)
F32_CAPS = {"route": dict(split=64), "project": dict(block_n=16, block_d=128, stages=2)}


def _needs_f32(*dtypes: torch.dtype) -> bool:
    """Whether a dot over operands of these dtypes must run in IEEE fp32: any fp32 operand, or two different
    half types; else the tensor cores on one half type (fp32 holds their products exactly)."""
    return not (len(set(dtypes)) == 1 and dtypes[0] in _HALVES)


def _capped(launch: RouteFusedLaunch, kernel: str) -> RouteFusedLaunch:
    caps = F32_CAPS[kernel]
    return dataclasses.replace(launch, **{k: min(getattr(launch, k), v) for k, v in caps.items()})


class RouteFusedPlan:
    """One call of the op: checked inputs, outputs, scratch and both grids. ``route_update()`` then
    ``fuse_project()`` is the op; each alone is one launch (its state effects: the first updates the
    summary rows, the second the counts)."""

    def __init__(self, x, q, w1, b1, w2, b2, gate, state_mean, state_count, slots, wk, bk, wv, bv, mode: int,
                 beta: float, *, out=None, launch: RouteFusedLaunch | None = None):
        check_route_fused_inputs(x, q, w1, b1, w2, b2, gate, state_mean, state_count, slots, wk, bk, wv, bv, mode,
                                 beta)
        for name, t in (("state_mean", state_mean), ("state_count", state_count), ("b1", b1), ("b2", b2),
                        ("bk", bk), ("bv", bv), ("slots", slots)):
            if not t.is_contiguous():
                raise ValueError(f"{name} must be contiguous")
        self.launch = lc = DEFAULT_LAUNCH if launch is None else launch
        if not isinstance(lc, RouteFusedLaunch):
            raise TypeError(f"launch must be a RouteFusedLaunch, got {type(lc).__name__}")
        B, D = x.shape
        dev = x.device
        k_out, v_out, lam_out = (None, None, None) if out is None else out
        self.k = destination(k_out, "out[0] (k)", (B, wk.shape[0]), x.dtype, dev, _alloc)
        self.v = destination(v_out, "out[1] (v)", (B, wv.shape[0]), x.dtype, dev, _alloc)
        self.lam = destination(lam_out, "out[2] (lam)", (B, 3), torch.float32, dev, _alloc)
        self.B, self.D, self.Dq, self.R = B, D, q.shape[1], w1.shape[0]
        self.Nk, self.Nv = wk.shape[0], wv.shape[0]
        self.mode, self.beta = int(mode), float(beta)
        self.x, self.q, self.w1, self.w2, self.wk, self.wv = (t.contiguous() for t in (x, q, w1, w2, wk, wv))
        self.b1, self.b2, self.gate, self.bk, self.bv = b1, b2, gate, bk, bv
        self.state_mean, self.state_count, self.slots = state_mean, state_count, slots
        route_f32, proj_f32 = _needs_f32(self.q.dtype, self.w1.dtype), _needs_f32(self.wk.dtype, self.wv.dtype)
        # the interpreter's bf16 tl.dot is wrong (triton_util.interpreting): every dot in fp32 there, uncapped
        self.route_f32, self.proj_f32 = route_f32 or interpreting(), proj_f32 or interpreting()
        if not interpreting():
            for kernel, f32 in (("route", route_f32), ("project", proj_f32)):
                if f32:
                    lc = _capped(lc, kernel)
            self.launch = lc
        self.r_p = max(triton.next_power_of_2(self.R), 16)
        self.n_split = triton.cdiv(max(D, self.Dq), lc.split)
        self.block_b = min(max(triton.next_power_of_2(max(B, 1)), 16), lc.max_block_b)
        self.part = _alloc(self.n_split, B, self.r_p, dtype=torch.float32, device=dev) if B else None

    @property
    def grids(self) -> dict[str, tuple[int, int]]:
        lc = self.launch
        return {"route_update": (self.n_split, 1),
                "fuse_project": (triton.cdiv(self.Nk, lc.block_n) + triton.cdiv(self.Nv, lc.block_n),
                                 triton.cdiv(self.B, self.block_b))}

    def route_update(self) -> None:
        """Launch 1: routing partial sums over ``Dq`` and the summary rows updated in place."""
        if self.B == 0:
            return
        mka_route_partial_update[self.grids["route_update"][:1]](
            self.x, self.q, self.w1, self.state_mean, self.state_count, self.slots, self.part, self.B, self.D,
            self.Dq, self.R, self.beta, MODE=self.mode, R_P=self.r_p, BLOCK_B=self.block_b, SPLIT=self.launch.split,
            DOT_F32=self.route_f32, num_warps=self.launch.route_warps)

    def fuse_project(self) -> None:
        """Launch 2: routing finished, ``lam`` and the counts written, fused K/V projected."""
        if self.B == 0:
            return
        lc = self.launch
        mka_fuse_project[self.grids["fuse_project"]](
            self.x, self.state_mean, self.state_count, self.slots, self.part, self.b1, self.w2, self.b2, self.gate,
            self.wk, self.bk, self.wv, self.bv, self.k, self.v, self.lam, self.B, self.D, self.R, self.Nk, self.Nv,
            self.n_split, R_P=self.r_p, S_BLOCK=min(lc.s_block, triton.next_power_of_2(self.n_split)),
            BLOCK_B=self.block_b, BLOCK_N=lc.block_n, BLOCK_D=lc.block_d, DOT_F32=self.proj_f32,
            num_warps=lc.warps, num_stages=lc.stages)

    def run(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        self.route_update()
        self.fuse_project()
        return self.k, self.v, self.lam


def route_fused_attention_triton(x, q, w1, b1, w2, b2, gate, state_mean, state_count, slots, wk, bk, wv, bv,
                                 mode: int, beta: float, *,
                                 out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                                 launch: RouteFusedLaunch | None = None):
    """Same contract as ``macattn.methods.mka.ops.route_fused_attention``: ``(k [B, Nk], v [B, Nv])`` in x's
    dtype and ``lam [B, 3]`` fp32, the state rows updated in place; two launches, no host sync
    (CUDA-graph capturable). Values of ``slots`` are not range-checked. ``out``: optional contiguous
    destinations ``(k, v, lam)`` (TensorRT's output buffers), returned. ``launch``: the launch constants
    (``DEFAULT_LAUNCH`` when None)."""
    return RouteFusedPlan(x, q, w1, b1, w2, b2, gate, state_mean, state_count, slots, wk, bk, wv, bv, mode, beta,
                          out=out, launch=launch).run()
