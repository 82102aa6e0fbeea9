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
