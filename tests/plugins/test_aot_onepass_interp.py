"""The AOT kernel images' semantics on the CPU: the one-pass kernels (the very functions and
constexprs of ``match_aot_image`` / ``attend_aot_image``) run through Triton's interpreter
against the fp64 reference (``mac_problem`` checks: poisoned outputs, ring state after the
append). Triton chooses the interpreter when a kernel is defined, so the tests re-run this
file in a subprocess with ``TRITON_INTERPRET=1``; the device runs the compiled images
(``test_aot_images_gpu.py``).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"

if not INTERPRETING:
    @pytest.mark.slow
    def test_onepass_kernels_in_the_interpreter():
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(Path(__file__))],
                              env=env, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
        assert " passed" in proc.stdout and "skipped" not in proc.stdout.splitlines()[-1], proc.stdout[-2000:]

else:
    from aot_cases import run_case_with
    from mac_problem import Problem, _all, _check_match, _check_step, _mixed_kinds, _poison

    def _launch(spec, args):
        spec.launch_jit(*args)

    def _gen():
        seed = int.from_bytes(os.urandom(4), "little")
        print("seed", seed)
        return torch.Generator().manual_seed(seed)

    def _check(pr):
        before = pr.rings()
        match_pos, dist, out, rings = run_case_with(_launch, pr, _poison, compiled=False)
        _check_match(pr, match_pos, dist)
        _check_step(pr, out, match_pos, rings, before)

    @pytest.mark.parametrize("hq,hkv,d", [(8, 2, 32), (4, 4, 16), (6, 2, 32)])
    def test_mixed_hits_gqa(hq, hkv, d):
        g = _gen()
        B = 3
        _check(Problem(B=B, Hq=hq, Hkv=hkv, d=d, K=32, band=8, tau=0.5, positions=[70, 41, 97],
                       kinds=_mixed_kinds(B, hq, hkv, g), gen=g))

    def test_young_requests_and_all_miss():
        g = _gen()
        # m - r < 0 (no part A, empty ring entry) next to a request past the window
        _check(Problem(B=3, Hq=4, Hkv=2, d=16, K=16, band=8, tau=0.5, positions=[3, 6, 40],
                       kinds=_all("miss", 3, 4), gen=g))

    def test_all_hit_wraparound():
        g = _gen()
        _check(Problem(B=2, Hq=4, Hkv=1, d=32, K=16, band=4, tau=0.5, positions=[53, 38],
                       kinds=_all("hit", 2, 4), gen=g))

    def test_item10_zero_batch_on_a_one_program_grid_writes_nothing():
        """Issue 36 item 10: TensorRT launches ``B + (B == 0)`` programs; with ``B = 0`` the one program returns
        before touching memory (the ring outputs, aliased to the inputs, keep their values)."""
        import dataclasses

        from macattn.plugins.mac.attend_plugin import attend_kernel_spec
        from macattn.plugins.mac.match_plugin import match_kernel_spec

        bf, f32, i64 = torch.bfloat16, torch.float32, torch.int64
        S, H, Hkv, K, d = 2, 4, 2, 16, 16
        qring, oring = torch.randn(S, H, K, d).to(bf), torch.randn(S, H, K, d)
        lse, pos = torch.randn(S, H, K), torch.arange(S * K).view(S, K)
        saved = [t.clone() for t in (qring, oring, lse, pos)]
        e3, e1, e2 = torch.empty(0, H, d, dtype=bf), torch.empty(0, dtype=i64), torch.empty(0, H, dtype=i64)
        kv = torch.empty(0, Hkv, 8, d, dtype=bf)
        m_spec = match_kernel_spec([(0, H, d), (S, H, K, d), (S, H, K), (S, K), (0,), (0,)],
                                   [bf, bf, f32, i64, i64, i64], band=4, tau=0.5)
        dataclasses.replace(m_spec, grid=(1, H, 1)).launch_jit(e3, qring, lse, pos, e1, e1, 0, e2,
                                                                torch.empty(0, H, dtype=f32))
        a_spec = attend_kernel_spec([(0, H, d), (0, H, d), (0, Hkv, 8, d), (0, Hkv, 8, d), (0,), (0, H), (0,),
                                     (S, H, K, d), (S, H, K, d), (S, H, K), (S, K)],
                                    [bf, bf, bf, bf, i64, i64, i64, bf, f32, f32, i64], band=4, scale=0.25)
        dataclasses.replace(a_spec, grid=(1, Hkv, 1)).launch_jit(e3, e3, kv, kv, e1, e2, e1, qring, oring, lse, pos,
                                                                  0, 8, e3, qring, oring, lse, pos)
        for t, s in zip((qring, oring, lse, pos), saved):
            assert torch.equal(t, s)
