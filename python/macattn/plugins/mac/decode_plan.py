"""``MacDecodePlan``: plan once per batch bucket, run every decode step (CUDA-graph safe).

In the spirit of FlashInfer's ``plan()/run()``: the constructor fixes the bucket (batch
``B``, max context, heads, head dim, ring window, KV layout, dtypes), picks the launch
parameters and allocates every scratch buffer and output; ``run`` launches

    match partials -> plan (one program: match decision + device-side work split)
    -> split-KV attention (partial summaries) -> merge + ring append

with no host synchronisation and no allocation, so a step can be captured in a CUDA graph
and replayed. ``run_full`` is the full-attention path of the same attention kernel (every
head a miss; static split of ``[0, m]``; no ring).

Outputs live in the plan (``plan.out [B, Hq, d]``, ``plan.match_pos [B, Hq]`` int64,
``plan.dist [B, Hq]`` fp32) and are overwritten by the next ``run``.
"""
from __future__ import annotations

import math

import torch

from macattn.core.threshold import match_threshold
from macattn.core.validation import check_int, check_tau

from ..triton_util import check_cuda_or_interp, default_pdl, interpreting, next_pow2, num_sms, resident_per_sm
from .attend_kernel import AttendMeta, attend_meta, launch_attend, launch_merge, launch_plan
from .match_kernel import MatchMeta, check_match_inputs, launch_match, match_meta
from .persistent import PERSISTENT_PLAN_LIMIT, launch_persistent_step
from .two_stage import TwoStageMeta, check_two_stage_inputs, launch_two_stage_match, two_stage_meta

__all__ = ["MacDecodePlan", "PLAN_BLOCK_LIMIT", "check_kv"]

# the plan (one program) holds [32 groups, heads per group, match splits] in registers at a time;
# the attention kernel's item lookup holds one vector of all KV groups
PLAN_BLOCK_LIMIT = 4096
MAX_GROUPS = 4096


def check_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, page_table: torch.Tensor | None,
             page_size: int | None, num_kv_heads: int | None = None) -> int:
    """Validate the KV layout; returns ``Hkv``.

    Contiguous: ``k, v [B, Hkv, T, d]``. Paged (``page_table [B, max_pages]`` int32):
    ``k, v [num_pages, page_size, Hkv, d]`` (FlashInfer NHD). Last dim contiguous.
    """
    B, Hq, d = q.shape
    if k.dim() != 4 or v.shape != k.shape:
        raise ValueError(f"k and v must be 4-D of equal shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.dtype != v.dtype or k.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"k and v must both be bf16 or fp16, got {k.dtype} and {v.dtype}")
    if k.shape[-1] != d or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError(f"k/v last dim must be d={d} and contiguous, got shape {tuple(k.shape)}")
    if page_table is None:
        if k.shape[0] != B:
            raise ValueError(f"contiguous k must be [B={B}, Hkv, T, d], got {tuple(k.shape)}")
        hkv = k.shape[1]
    else:
        if page_table.dim() != 2 or page_table.shape[0] != B or page_table.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"page_table must be int32 [B={B}, max_pages], got {page_table.dtype} "
                             f"{tuple(page_table.shape)}")
        if page_table.stride(1) != 1:
            raise ValueError("page_table needs a contiguous last dimension")
        if page_size is None or k.shape[1] != page_size:
            raise ValueError(f"paged k must be [num_pages, page_size={page_size}, Hkv, d], got {tuple(k.shape)}")
        hkv = k.shape[2]
        check_cuda_or_interp("page_table", page_table)
    if num_kv_heads is not None and hkv != num_kv_heads:
        raise ValueError(f"k has {hkv} KV heads, the plan was made for {num_kv_heads}")
    if Hq % hkv:
        raise ValueError(f"num query heads {Hq} is not a multiple of KV heads {hkv}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_cuda_or_interp(name, t)
    return hkv


class MacDecodePlan:
    """Scratch and launch parameters for one batch bucket.

    batch_size ``B``, max_context (largest ``m + 1`` a run may see; sizes the full path's
    static split), num_q_heads ``Hq``, num_kv_heads ``Hkv``, head_dim ``d`` (power of two),
    window ``K`` (ring capacity), band ``r``, tau (None: an attend-only plan — ``run_attend`` /
    ``run_full``; the match stages raise); page_size None = contiguous KV
    ``[B, Hkv, T, d]``, else paged NHD with that page size (16/32/64 tested).
    programs_per_sm: attention work items per SM the device-side plan aims at.
    pdl: programmatic dependent launch between the step's kernels (default: on for sm90+).
    block_n / num_warps / num_stages / maxnreg: the attention kernel's launch parameters;
    b_items: part-B work items per KV group (default: from the SM count); early_b: with PDL,
    the plan lets the attention kernel (its part-B items) start before the plan's own wait
    (default: when ``B * Hkv >= SMs``).
    residency: attention programs resident per SM (MAC kernel, full-path kernel); by default
    read off the compiled kernels' registers and shared memory at the first run (outside any
    graph capture), so that the work split is one wave.
    persistent: the whole step as one persistent launch (``persistent.py``: match, plan,
    attention and merge separated by grid barriers) instead of four kernels: exact match only, where
    its register plan fits (``B * Hkv`` groups x heads per group x match splits <= PERSISTENT_PLAN_LIMIT).
    Off by default: measured slower than the four kernels (``benchmarks/NOTES.md``).
    match_candidates: None = the exact match; a power of two = the two-stage match with that many
    candidates (``MacConfig(match="two_stage")``): ``run`` then takes the sketch ring ``sring`` (and
    ``proj`` for a projected sketch), computes the query's sketch into ``q_sketch`` and appends it to
    ``sring`` with the ring entry; match_sketch_dims / match_sketch_itemsize: one sketch entry's
    elements and their bytes (size the candidate scan's split).
    """

    def __init__(self, *, batch_size: int, max_context: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
                 window: int, band: int, tau: float | None = None, page_size: int | None = None,
                 q_dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cuda",
                 scale: float | None = None, programs_per_sm: int = 4, match_programs_per_sm: int = 8,
                 block_n: int | None = None, num_warps: int = 4, num_stages: int | None = None,
                 pdl: bool | None = None, maxnreg: int | None = None, b_items: int | None = None,
                 early_b: bool | None = None,
                 residency: tuple[int, int] | None = None, match_candidates: int | None = None,
                 match_sketch_dims: int | None = None, match_sketch_itemsize: int = 2,
                 persistent: bool = False) -> None:
        for name, val, lo in (("batch_size", batch_size, 1), ("max_context", max_context, 1),
                              ("num_q_heads", num_q_heads, 1), ("num_kv_heads", num_kv_heads, 1),
                              ("head_dim", head_dim, 16), ("window", window, 1), ("band", band, 0),
                              ("programs_per_sm", programs_per_sm, 1), ("match_programs_per_sm", match_programs_per_sm, 1)):
            check_int(name, val, lo)
        if head_dim & (head_dim - 1):
            raise ValueError(f"head_dim must be a power of two, got {head_dim}")
        if num_q_heads % num_kv_heads:
            raise ValueError(f"num_q_heads {num_q_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        if page_size is not None:
            check_int("page_size", page_size, 1)
        if tau is not None:
            check_tau("tau", tau)
        self.device = torch.device(device)
        self.B, self.Hq, self.Hkv, self.d = batch_size, num_q_heads, num_kv_heads, head_dim
        self.K, self.band, self.tau = window, band, None if tau is None else float(tau)
        self.max_context, self.page_size = max_context, page_size
        self.scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
        self.thr = None if tau is None else match_threshold(head_dim, tau)   # None: an attend-only plan
        sms = num_sms(self.device)
        hpg = num_q_heads // num_kv_heads
        ng = batch_size * num_kv_heads
        if ng > MAX_GROUPS:
            raise ValueError(f"batch_size {batch_size} x num_kv_heads {num_kv_heads} exceeds {MAX_GROUPS} KV groups; "
                             f"split the batch")
        block = min(next_pow2(ng), 32) * next_pow2(hpg)
        self.match: MatchMeta = match_meta(batch_size, num_q_heads, window, head_dim, sms,
                                           programs_per_sm=match_programs_per_sm,
                                           max_splits=max(1, PLAN_BLOCK_LIMIT // block))
        self.two_stage: TwoStageMeta | None = None
        if match_candidates is not None:
            if tau is None:
                raise ValueError("match_candidates needs a plan with tau (the two-stage match)")
            self.two_stage = two_stage_meta(batch_size, num_q_heads, window, head_dim, match_candidates, sms,
                                            sketch_dims=match_sketch_dims, sketch_itemsize=match_sketch_itemsize)
        if num_stages is None:       # measured: contiguous KV gains from a deeper pipeline, paged does not
            num_stages = 3 if page_size is not None else 4
        self.attend: AttendMeta = attend_meta(batch_size, num_q_heads, num_kv_heads, head_dim, max_context, band, sms,
                                              programs_per_sm=programs_per_sm, block_n=block_n,
                                              num_warps=num_warps, num_stages=num_stages, maxnreg=maxnreg,
                                              b_items=b_items)
        self.dot_f32 = interpreting()
        self.pdl = default_pdl(self.device) if pdl is None else bool(pdl)
        # measured on the H100: starting part B during the plan pays once the KV groups alone cover
        # the SMs (B=32: -4 us); at B=1 the early-launched attention programs cost 3 us instead
        self.early_b = (ng >= sms) if early_b is None else bool(early_b)
        plan_regs = next_pow2(ng) * next_pow2(hpg) * self.match.NS_P
        fits = self.two_stage is None and tau is not None and plan_regs <= PERSISTENT_PLAN_LIMIT
        if persistent and not fits:
            raise ValueError(f"persistent=True needs the exact match (tau set, no match_candidates) and a plan of at "
                             f"most {PERSISTENT_PLAN_LIMIT} partials (groups x heads x splits = {plan_regs}): "
                             f"lower batch_size")
        self.persistent = bool(persistent)
        self.persistent_programs: int | None = None     # the grid: sized to residency at the first run
        self.programs_per_sm = programs_per_sm
        dev, f32, i32 = self.device, torch.float32, torch.int32
        B, Hq, d = batch_size, num_q_heads, head_dim
        n_part = B * Hq * self.match.NS
        self.part_d2 = torch.empty(n_part, dtype=f32, device=dev)
        self.part_pos = torch.empty(n_part, dtype=torch.int64, device=dev)
        self.part_mlse = torch.empty(n_part, dtype=f32, device=dev)
        if self.two_stage is not None:
            n_two = B * Hq * self.two_stage.NS * self.two_stage.C
            self.part_a = torch.empty(n_two, dtype=f32, device=dev)
            self.part_e = torch.empty(n_two, dtype=f32, device=dev)
            self.part_k = torch.empty(n_two, dtype=i32, device=dev)
            self.q_sketch = torch.empty(B, Hq, match_sketch_dims or d, dtype=f32, device=dev)
        self.grp_start = torch.empty(ng + 1, dtype=i32, device=dev)
        self.grp_lo = torch.empty(ng, dtype=i32, device=dev)
        self.grp_na = torch.empty(ng, dtype=i32, device=dev)
        self.grp_chunk = torch.empty(ng, dtype=i32, device=dev)
        self.part_o = torch.empty(self.attend.rows * hpg * d, dtype=f32, device=dev)
        self.part_lse = torch.empty(self.attend.rows * hpg, dtype=f32, device=dev)
        self.out = torch.empty(B, Hq, d, dtype=q_dtype, device=dev)
        self.match_pos = torch.empty(B, Hq, dtype=torch.int64, device=dev)
        self.dist = torch.empty(B, Hq, dtype=f32, device=dev)
        self.sync = torch.zeros(2, dtype=i32, device=dev)     # the persistent step's barrier counters
        self._calibrated = not self.device.type == "cuda" or residency is not None
        if residency is not None:
            self.attend.set_residency(*residency)

    def __repr__(self) -> str:
        return (f"MacDecodePlan(B={self.B}, Hq={self.Hq}, Hkv={self.Hkv}, d={self.d}, K={self.K}, r={self.band}, "
                f"max_context={self.max_context}, page_size={self.page_size}, {self.match}, {self.attend})")

    # -- checks (shapes only: value checks would synchronise with the host) -------------------
    def _check_step(self, q, q_pre, k, v, positions, slots, qring, oring, ring_lse, ring_pos, page_table):
        if q.shape != (self.B, self.Hq, self.d):
            raise ValueError(f"q must be [B, Hq, d] = {(self.B, self.Hq, self.d)}, got {tuple(q.shape)}")
        if q_pre.shape != q.shape:
            raise ValueError(f"q_pre must be {tuple(q.shape)}, got {tuple(q_pre.shape)}")
        if q.stride(-1) != 1:
            raise ValueError("q needs a contiguous last dimension")
        check_match_inputs(q_pre, qring, ring_lse, ring_pos, slots, positions)
        if qring.shape[2] != self.K:
            raise ValueError(f"ring window K={qring.shape[2]} differs from the plan's window {self.K}")
        if oring.shape != qring.shape or oring.stride(-1) != 1:
            raise ValueError(f"oring must be {tuple(qring.shape)} with a contiguous last dim, got {tuple(oring.shape)}")
        self._check_kv(q, k, v, page_table)

    def _check_kv(self, q, k, v, page_table):
        if (page_table is None) != (self.page_size is None):
            raise ValueError(f"the plan was made for {'contiguous' if self.page_size is None else 'paged'} KV; "
                             f"page_table is {'missing' if page_table is None else 'unexpected'}")
        check_kv(q, k, v, page_table, self.page_size, self.Hkv)

    # -- stages (public so benchmarks can time them separately) -------------------------------
    def _need_tau(self) -> None:
        if self.thr is None:
            raise ValueError("this MacDecodePlan was made without tau (attend-only: run_attend / run_full); "
                             "the match stages (run, run_match, run_plan without match_pos) need MacDecodePlan(tau=...)")

    def run_match(self, q_pre, qring, ring_pos, ring_lse, slots, positions) -> None:
        """Stage 1: match partials (per ring split: nearest candidate, its pos and cached lse)."""
        self._need_tau()
        launch_match(q_pre, qring, ring_pos, ring_lse, slots, positions, meta=self.match, part_d2=self.part_d2,
                     part_pos=self.part_pos, part_lse=self.part_mlse, finish=False, pdl=self.pdl)

    def run_two_stage_match(self, q_pre, proj, qring, sring, ring_pos, ring_lse, slots, positions, *,
                            append: bool = True) -> None:
        """Stage 1 of a two-stage plan: the query's sketch (``self.q_sketch``), candidates over the sketch
        ring, exact distances, threshold -> the plan's ``match_pos`` / ``dist``; ``append``: write the
        query's sketch into ``sring`` at ``m mod K``."""
        launch_two_stage_match(q_pre, proj, qring, sring, ring_pos, ring_lse, slots, positions, meta=self.two_stage,
                               q_sketch=self.q_sketch, part_a=self.part_a, part_e=self.part_e, part_k=self.part_k,
                               match_pos=self.match_pos, dist=self.dist, band=self.band, thr=self.thr, append=append)

    def run_plan(self, positions, match_pos=None) -> None:
        """Stage 2 (one program): reduce the match partials into ``match_pos``/``dist`` (or take the given
        ``match_pos``) and plan the part-A work split."""
        if match_pos is None:
            self._need_tau()
        launch_plan(self.attend, positions=positions, match_pos=self.match_pos if match_pos is None else match_pos,
                    grp_start=self.grp_start, grp_lo=self.grp_lo, grp_na=self.grp_na, grp_chunk=self.grp_chunk,
                    band=self.band, num_kv_heads=self.Hkv,
                    partials=(self.part_d2, self.part_pos, self.part_mlse) if match_pos is None else None,
                    dist=self.dist, **({} if match_pos is not None else {"thr": self.thr}), ns=self.match.NS, pdl=self.pdl, early=self.early_b)

    def _attend_kwargs(self, full, q, k, v, positions, page_table, match_pos):
        return dict(full=full, q=q, k=k, v=v, page_table=page_table, page_size=self.page_size or 1,
                    positions=positions, match_pos=self.match_pos if match_pos is None else match_pos,
                    grp_start=self.grp_start, grp_lo=self.grp_lo, grp_na=self.grp_na, grp_chunk=self.grp_chunk,
                    part_o=self.part_o, part_lse=self.part_lse, band=self.band, scale=self.scale,
                    num_kv_heads=self.Hkv, dot_f32=self.dot_f32, pdl=self.pdl)

    def calibrate(self, q, k, v, positions, page_table=None) -> None:
        """Size the work split to the attention kernels' real occupancy (compiles them; launches nothing)."""
        per = []
        for full in (False, True):
            compiled = launch_attend(self.attend, warmup=True, **self._attend_kwargs(full, q, k, v, positions,
                                                                                      page_table, None))
            per.append(resident_per_sm(compiled, self.attend.num_warps, self.device))
        self.attend.set_residency(*per)
        self._calibrated = True

    def run_attention(self, q, k, v, positions, page_table=None, match_pos=None) -> None:
        """Stage 3: split-KV partial summaries of the part-B and planned part-A items."""
        launch_attend(self.attend, **self._attend_kwargs(False, q, k, v, positions, page_table, match_pos))

    def run_merge(self, q_pre, positions, slots, qring, oring, ring_lse, ring_pos, match_pos=None, out=None) -> None:
        """Stage 4: ``entry = cached ⊕ A``, ``out = entry ⊕ B``; append ``(q_pre, entry, m)`` to slot ``m mod K``."""
        launch_merge(self.attend, full=False, part_o=self.part_o, part_lse=self.part_lse, grp_start=self.grp_start,
                     grp_na=self.grp_na, positions=positions, out=self.out if out is None else out,
                     match_pos=self.match_pos if match_pos is None else match_pos, slots=slots, q_pre=q_pre,
                     qring=qring, oring=oring, ring_lse=ring_lse, ring_pos=ring_pos, pdl=self.pdl)

    def run_persistent(self, q, q_pre, k, v, positions, slots, qring, oring, ring_lse, ring_pos,
                       page_table=None) -> None:
        """The whole MAC step as one persistent launch (``persistent.py``); outputs as ``run``.

        The first call (outside any graph capture) compiles the kernel and sizes its grid to the
        programs resident at once (at most ``programs_per_sm`` per SM)."""
        self._need_tau()
        step = (self, q, q_pre, k, v, positions, slots, qring, oring, ring_lse, ring_pos, page_table)
        if self.persistent_programs is None:
            sms = num_sms(self.device)
            compiled = (launch_persistent_step(*step, programs=sms, warmup=True)
                        if self.device.type == "cuda" else None)
            per_sm = resident_per_sm(compiled, self.attend.num_warps, self.device, default=1)
            self.persistent_programs = sms * max(1, min(per_sm, self.programs_per_sm))
        launch_persistent_step(*step, programs=self.persistent_programs,
                               phases=(1, 2, 3) if interpreting() else (0,))

    # -- whole steps ----------------------------------------------------------------------------
    def run(self, q, q_pre, k, v, positions, slots, qring, oring, ring_lse, ring_pos, page_table=None, *,
            check: bool = True, sring=None, proj=None,
            match_positions=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One MAC step: returns ``(out [B, Hq, d], match_pos [B, Hq] int64, dist [B, Hq] fp32)`` (plan buffers);
        the rings are updated in place. Needs a plan made with ``tau``. A two-stage plan also takes
        ``sring [S, Hq, K, DS]`` (E4M3 / bf16) and, for a projected sketch, ``proj [d, DS]`` fp32; the
        query's sketch goes into ``sring`` at ``m mod K`` beside the ring entry (at ``match_positions`` when
        given). ``match_positions`` ``[B]`` int64: the positions the match stage sees (default ``positions``); a
        row at 0 there matches nothing and misses (the runtime's rows before ``MacConfig.min_context``)."""
        self._need_tau()
        if match_positions is not None and self.persistent:
            raise ValueError("match_positions needs the four-kernel step (persistent=False)")
        mpos = positions if match_positions is None else match_positions
        two = self.two_stage is not None
        if (sring is None) == two:
            raise ValueError("sring is the two-stage match's input: pass it exactly when the plan was made with "
                             f"match_candidates (it was made with {self.two_stage})")
        if check:
            self._check_step(q, q_pre, k, v, positions, slots, qring, oring, ring_lse, ring_pos, page_table)
            if two:
                check_two_stage_inputs(q_pre, proj, qring, sring, ring_lse, ring_pos, slots, positions)
                if sring.shape[3] != self.q_sketch.shape[2]:
                    raise ValueError(f"sring has {sring.shape[3]} sketch dims, the plan was made for "
                                     f"{self.q_sketch.shape[2]}")
        if not self._calibrated:
            self.calibrate(q, k, v, positions, page_table)
        if self.persistent:
            self.run_persistent(q, q_pre, k, v, positions, slots, qring, oring, ring_lse, ring_pos, page_table)
            return self.out, self.match_pos, self.dist
        if two:
            self.run_two_stage_match(q_pre, proj, qring, sring, ring_pos, ring_lse, slots, mpos)
            self.run_plan(positions, self.match_pos)
        else:
            self.run_match(q_pre, qring, ring_pos, ring_lse, slots, mpos)
            self.run_plan(positions)
        self.run_attention(q, k, v, positions, page_table)
        self.run_merge(q_pre, positions, slots, qring, oring, ring_lse, ring_pos)
        return self.out, self.match_pos, self.dist

    def run_attend(self, q, q_pre, k, v, positions, match_pos, slots, qring, oring, ring_lse, ring_pos,
                   page_table=None, *, out=None, check: bool = True) -> torch.Tensor:
        """Complete + amend + append for given ``match_pos`` (the ``macattn::mac_attend`` op).

        ``out``: optional ``[B, Hq, d]`` destination (default: the plan's buffer)."""
        if check:
            self._check_step(q, q_pre, k, v, positions, slots, qring, oring, ring_lse, ring_pos, page_table)
            if match_pos.shape != (self.B, self.Hq) or match_pos.dtype != torch.int64 or match_pos.stride(1) != 1:
                raise ValueError(f"match_pos must be int64 [B, Hq] = {(self.B, self.Hq)}, got "
                                 f"{match_pos.dtype} {tuple(match_pos.shape)}")
            if out is not None and (out.shape != q.shape or out.stride(-1) != 1):
                raise ValueError(f"out must be {tuple(q.shape)} with a contiguous last dim, got {tuple(out.shape)}")
        if not self._calibrated:
            self.calibrate(q, k, v, positions, page_table)
        self.run_plan(positions, match_pos)
        self.run_attention(q, k, v, positions, page_table, match_pos=match_pos)
        self.run_merge(q_pre, positions, slots, qring, oring, ring_lse, ring_pos, match_pos=match_pos, out=out)
        return self.out if out is None else out

    def run_full(self, q, k, v, positions, page_table=None, *, check: bool = True) -> torch.Tensor:
        """Full attention over ``[0, m]`` (all heads miss, no ring): ``out [B, Hq, d]`` (plan buffer).

        Requires ``m + 1 <= max_context`` for every request (not checked: no host sync).
        """
        if check:
            if q.shape != (self.B, self.Hq, self.d) or q.stride(-1) != 1:
                raise ValueError(f"q must be [B, Hq, d] = {(self.B, self.Hq, self.d)} with a contiguous last dim, "
                                 f"got {tuple(q.shape)}")
            if positions.shape != (self.B,):
                raise ValueError(f"positions must be [B]={self.B}, got {tuple(positions.shape)}")
            self._check_kv(q, k, v, page_table)
        if not self._calibrated:
            self.calibrate(q, k, v, positions, page_table)
        launch_attend(self.attend, **self._attend_kwargs(True, q, k, v, positions, page_table, positions))
        launch_merge(self.attend, full=True, part_o=self.part_o, part_lse=self.part_lse, grp_start=self.grp_start,
                     grp_na=self.grp_na, positions=positions, out=self.out, pdl=self.pdl)
        return self.out
