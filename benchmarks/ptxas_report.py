"""Registers and spills of the page op's kernels per launch configuration, without a GPU: Triton compiles
each for sm_90a and the ``ptxas-blackwell`` its wheel ships (it reads the PTX 9.4 Triton 3.9 writes) reports.

    python benchmarks/ptxas_report.py                  # the page op (retrieval-completion)
    python benchmarks/ptxas_report.py --route-fused    # FastMKA's two kernels (bench_mka_decode --sweep's grid)

Prints one line per (kernel, configuration): registers per thread, spill stores / loads in bytes. What it
told about ``decode_partial_pages`` and ``decode_merge`` is in ``benchmarks/NOTES.md`` (page op v2).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

import triton
import triton.backends.nvidia as nvidia
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from macattn.plugins.retrieval_completion.kernel import decode_merge, decode_partial_pages
from macattn.plugins.route_fused.kernel import mka_fuse_project, mka_route_partial_update

PTXAS = os.path.join(os.path.dirname(nvidia.__file__), "bin", "ptxas-blackwell")


def ptxas_stats(fn, signature: dict, constexprs: dict, num_warps: int, num_stages: int | None = None
                ) -> tuple[int, int, int]:
    """``(registers, spill store bytes, spill load bytes)`` of ``fn`` compiled for sm_90a."""
    opts = {"num_warps": num_warps, **({"num_stages": num_stages} if num_stages is not None else {})}
    ptx = triton.compile(ASTSource(fn, signature, constexprs=constexprs), target=GPUTarget("cuda", 90, 32),
                         options=opts).asm["ptx"]
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        err = subprocess.run([PTXAS, "-arch=sm_90a", "-v", f.name, "-o", os.devnull], capture_output=True,
                             text=True, check=True).stderr
    regs = int(re.search(r"Used (\d+) registers", err).group(1))
    stores, loads = (int(x) for x in re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", err).groups())
    return regs, stores, loads


def _signature(pointers: dict, ints: list, floats: list, constexprs: list) -> dict:
    return {**pointers, **{n: "i32" for n in ints}, **{n: "fp32" for n in floats}, **{n: "constexpr" for n in constexprs}}


def route_fused_report() -> None:
    """FastMKA's kernels at 8B shapes (R = 64, 16 padded request rows), bf16, and the fp32 dot paths under the
    launcher's ``F32_CAPS``: the configurations ``bench_mka_decode.py --sweep`` times."""
    route = _signature({**{n: "*bf16" for n in ("x_ptr", "q_ptr", "w1_ptr")}, "mean_ptr": "*fp32", "count_ptr": "*i64",
                        "slots_ptr": "*i64", "part_ptr": "*fp32"}, ["B", "D", "DQ", "R"], ["beta"],
                       ["MODE", "R_P", "BLOCK_B", "SPLIT", "DOT_F32"])
    project = _signature({**{n: "*bf16" for n in ("x_ptr", "b1_ptr", "w2_ptr", "b2_ptr", "gate_ptr", "wk_ptr", "bk_ptr",
                                                  "wv_ptr", "bv_ptr", "k_ptr", "v_ptr")},
                          **{n: "*fp32" for n in ("mean_ptr", "part_ptr", "lam_ptr")}, "count_ptr": "*i64",
                          "slots_ptr": "*i64"}, ["B", "D", "R", "NK", "NV", "NSPLIT"], [],
                         ["R_P", "S_BLOCK", "BLOCK_B", "BLOCK_N", "BLOCK_D", "DOT_F32"])
    f32 = lambda sig, keep=(): {k: "*fp32" if v == "*bf16" and k not in keep else v for k, v in sig.items()}  # noqa: E731
    print(f"{'kernel':<26}{'config':<34}{'registers':>10}{'spill st':>10}{'spill ld':>10}")
    for split, warps in [(64, 4), (128, 4), (256, 4), (128, 8), (256, 8)]:
        regs, st, ld = ptxas_stats(mka_route_partial_update, route,
                                   dict(MODE=0, R_P=64, BLOCK_B=16, SPLIT=split, DOT_F32=False), warps, 3)
        print(f"{'mka_route_partial_update':<26}{f'split {split} x {warps} warps':<34}{regs:>10}{st:>10}{ld:>10}")
    regs, st, ld = ptxas_stats(mka_route_partial_update, f32(route, keep=("x_ptr", "q_ptr")),
                               dict(MODE=0, R_P=64, BLOCK_B=16, SPLIT=64, DOT_F32=True), 4, 3)
    print(f"{'mka_route_partial_update':<26}{'fp32 w1, split 64 x 4 warps':<34}{regs:>10}{st:>10}{ld:>10}")
    for n, d, stages, warps in [(16, 128, 3, 4), (16, 128, 4, 4), (16, 128, 6, 4), (16, 256, 3, 4), (16, 256, 4, 4),
                                (16, 256, 4, 8), (32, 128, 3, 4), (32, 128, 4, 4), (64, 128, 3, 8)]:
        regs, st, ld = ptxas_stats(mka_fuse_project, project, dict(R_P=64, S_BLOCK=8, BLOCK_B=16, BLOCK_N=n, BLOCK_D=d,
                                                                DOT_F32=False), warps, stages)
        print(f"{'mka_fuse_project':<26}{f'{n} x {d}, {stages} stages x {warps} warps':<34}{regs:>10}{st:>10}{ld:>10}")
    regs, st, ld = ptxas_stats(mka_fuse_project, f32(project), dict(R_P=64, S_BLOCK=8, BLOCK_B=16, BLOCK_N=16,
                                                                    BLOCK_D=128, DOT_F32=True), 4, 2)
    print(f"{'mka_fuse_project':<26}{'fp32, 16 x 128, 2 stages x 4 warps':<34}{regs:>10}{st:>10}{ld:>10}")


def main() -> int:
    if not os.path.exists(PTXAS):
        print(f"no {PTXAS}: needs Triton's NVIDIA backend wheel", file=sys.stderr)
        return 2
    if "--route-fused" in sys.argv[1:]:
        route_fused_report()
        return 0
    partial = _signature({**{n: "*bf16" for n in ("q_ptr", "k_ptr", "v_ptr")}, "sl_ptr": "*i64", "npf_ptr": "*i64",
                          **{n: "*fp32" for n in ("lpk_ptr", "shift_ptr", "pm_ptr", "pl_ptr", "pacc_ptr", "psb_ptr",
                                                  "psa_ptr")}, "pages_ptr": "*i64"},
                         ["s_kb", "s_kh", "s_kt", "s_lb", "s_lh", "s_lt", "s_pb", "s_ph", "HQ", "HKV", "D", "F", "NP",
                          "n_sink", "n_tail"], ["scale"], ["GROUP", "G_P", "PAGE", "PRECISION", "D_P", "F_P", "BLOCK_K"])
    merge = _signature({"npf_ptr": "*i64", "out_ptr": "*bf16",
                        **{n: "*fp32" for n in ("lpq_ptr", "a_ptr", "b_ptr", "shift_ptr", "pm_ptr", "pl_ptr", "pacc_ptr",
                                                "psb_ptr", "psa_ptr")}},
                       ["HQ", "HKV", "D", "F", "n_sink", "n_tail", "top_k", "N_SPLIT"], [],
                       ["GROUP", "PAGE", "D_P", "F_P", "S_P", "SUB_KV", "UNROLL"])
    shapes = dict(GROUP=4, PAGE=64, D_P=128, F_P=64)           # LLaMA-3.1-8B, F = 64, 64-token pages
    print(f"{'kernel':<24}{'config':<28}{'registers':>10}{'spill st':>10}{'spill ld':>10}")
    for bk, warps in [(64, 4), (64, 8), (32, 4), (32, 8), (16, 4)]:
        consts = {**shapes, "G_P": 16, "PRECISION": "tf32", "BLOCK_K": bk}
        regs, st, ld = ptxas_stats(decode_partial_pages, partial, consts, warps)
        print(f"{'decode_partial_pages':<24}{f'BLOCK_K {bk} x {warps} warps':<28}{regs:>10}{st:>10}{ld:>10}")
    for unroll, warps in [(1, 4), (2, 8), (4, 8), (8, 8)]:
        consts = {**shapes, "S_P": 32, "SUB_KV": True, "UNROLL": unroll}
        regs, st, ld = ptxas_stats(decode_merge, merge, consts, warps)
        print(f"{'decode_merge':<24}{f'UNROLL {unroll} x {warps} warps':<28}{regs:>10}{st:>10}{ld:>10}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
