"""The AOT images on the H100, launched the way TensorRT and the C library launch them.

* ``AotImage`` (what ``aot_impl`` returns): the cubin, and the PTX JIT-compiled by the
  driver (what TensorRT receives), loaded through the CUDA driver API (cuda-python) and
  launched with exactly the image's grid, block, shared memory and parameters (plugin
  order, Triton's two hidden scratch pointers passed as null).
* ``libmacattn_kernels.so`` (CMake target ``macattn_kernels``, Triton's AOT C tool):
  loaded with ctypes, its stable entry points called on real tensors. Path from
  ``$MACATTN_KERNELS_LIB`` (default ``build/libmacattn_kernels.so``).

Both against the fp64 reference with the checks of ``mac_problem`` (poisoned outputs, ring
state after the append). Marked ``gpu``: skipped on CPU-only machines.
"""
from __future__ import annotations

import ctypes
import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

from aot_cases import run_case_with  # noqa: E402
from mac_problem import Problem, _all, _check_match, _check_step, _mixed_kinds, _poison  # noqa: E402

DEV = "cuda"


def _gen():
    seed = int.from_bytes(os.urandom(4), "little")
    print("seed", seed)
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------------------------------------
# cuda-python launches of the AotImage
# ---------------------------------------------------------------------------------------------
def _driver():
    return pytest.importorskip("cuda.bindings.driver")


def _ok(result):
    cu = _driver()
    err, *rest = result
    assert err == cu.CUresult.CUDA_SUCCESS, f"CUDA driver error {err}"
    return rest[0] if len(rest) == 1 else rest


class DriverLauncher:
    """Loads each image once (cubin or PTX) and launches it as TensorRT would."""

    def __init__(self, form: str):
        self.form = form
        self.functions = {}

    def function(self, image):
        cu = _driver()
        key = (image.kernel_name, image.ptx)
        if key not in self.functions:
            torch.cuda.init()
            data = image.cubin if self.form == "cubin" else image.ptx.encode() + b"\0"
            module = _ok(cu.cuModuleLoadData(data))
            self.functions[key] = _ok(cu.cuModuleGetFunction(module, image.kernel_name.encode()))
        return self.functions[key]

    def __call__(self, image, args):
        cu = _driver()
        fn = self.function(image)
        values, types = [], []
        for (name, ty), a in zip(image.spec.signature, args):
            if ty.startswith("*"):
                assert isinstance(a, torch.Tensor) and a.is_cuda and a.is_contiguous(), name
                values.append(a.data_ptr())
                types.append(ctypes.c_void_p)
            else:
                values.append(int(a))
                types.append(ctypes.c_int32)
        values += [0, 0]                         # Triton's hidden global/profile scratch pointers: unused
        types += [ctypes.c_void_p, ctypes.c_void_p]
        assert len(values) == image.num_params
        grid = [int(g) for g in image.grid]
        stream = cu.CUstream(torch.cuda.current_stream().cuda_stream)
        _ok((cu.cuLaunchKernel(fn, *grid, *image.block, image.shared_mem, stream,
                               (tuple(values), tuple(types)), 0)[0], None))


CASES = {
    "llama8b_mixed": dict(B=3, Hq=32, Hkv=8, d=128, K=1024, band=256, tau=0.45, positions=[1500, 700, 2600]),
    "qwen7b_mixed": dict(B=2, Hq=28, Hkv=4, d=128, K=1024, band=256, tau=0.45, positions=[1300, 3000]),
    "mha_d64_wrap": dict(B=4, Hq=8, Hkv=8, d=64, K=64, band=16, tau=0.5, positions=[300, 64, 65, 129]),
    "young_m_minus_r_negative": dict(B=3, Hq=8, Hkv=2, d=64, K=64, band=16, tau=0.5, positions=[5, 12, 200]),
}


@pytest.mark.parametrize("form", ["cubin", "ptx"])
@pytest.mark.parametrize("case", list(CASES))
def test_aot_images_through_the_driver(case, form):
    g = _gen()
    kw = CASES[case]
    kinds = (_all("miss", kw["B"], kw["Hq"]) if case.startswith("young")
             else _mixed_kinds(kw["B"], kw["Hq"], kw["Hkv"], g))
    pr = Problem(**kw, kinds=kinds, gen=g).to(DEV)
    before = pr.rings()
    match_pos, dist, out, rings = run_case_with(DriverLauncher(form), pr, _poison)
    torch.cuda.synchronize()
    _check_match(pr, match_pos, dist)
    _check_step(pr, out, match_pos, rings, before)


def test_aot_image_all_hit_wraparound():
    g = _gen()
    pr = Problem(B=2, Hq=32, Hkv=8, d=128, K=1024, band=256, tau=0.45, positions=[5000, 2047],
                 kinds=_all("hit", 2, 32), gen=g).to(DEV)
    before = pr.rings()
    match_pos, dist, out, rings = run_case_with(DriverLauncher("cubin"), pr, _poison)
    torch.cuda.synchronize()
    assert bool((match_pos >= 0).float().mean() > 0.9)
    _check_match(pr, match_pos, dist)
    _check_step(pr, out, match_pos, rings, before)


# ---------------------------------------------------------------------------------------------
# the C library (CMake target macattn_kernels) through ctypes
# ---------------------------------------------------------------------------------------------
def _library():
    path = Path(os.environ.get("MACATTN_KERNELS_LIB", "build/libmacattn_kernels.so"))
    if not path.is_file():
        pytest.skip(f"{path} not built (cmake -S . -B build && cmake --build build)")
    torch.cuda.init()
    ctypes.CDLL("libcuda.so.1", mode=ctypes.RTLD_GLOBAL)     # the library resolves the driver at load time
    return ctypes.CDLL(str(path))


def _c_launch(lib, entry):
    def launch(image, args):
        fn = getattr(lib, entry.format(op="match" if image.kernel_name.startswith("mac_match") else "attend"))
        c_args = [ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)]
        for (name, ty), a in zip(image.spec.signature, args):
            c_args.append(ctypes.c_uint64(a.data_ptr()) if ty.startswith("*") else ctypes.c_int32(int(a)))
        fn.restype = ctypes.c_int
        assert fn(*c_args) == 0, f"{entry} returned a CUDA error"
    return launch


@pytest.mark.parametrize("spec,kw", [
    ("small", dict(B=4, Hq=8, Hkv=2, d=64, K=64, band=16, tau=0.5, positions=[300, 70, 9, 129])),
    ("llama8b", dict(B=2, Hq=32, Hkv=8, d=128, K=1024, band=256, tau=0.45, positions=[1800, 4100])),
    ("qwen7b", dict(B=2, Hq=28, Hkv=4, d=128, K=1024, band=256, tau=0.45, positions=[900, 2200])),
])
def test_c_library_entry_points(spec, kw):
    lib = _library()
    lib.macattn_kernels_names.restype = ctypes.c_char_p
    assert f"match_{spec}" in lib.macattn_kernels_names().decode().split(",")
    g = _gen()
    pr = Problem(**kw, kinds=_mixed_kinds(kw["B"], kw["Hq"], kw["Hkv"], g), gen=g).to(DEV)
    before = pr.rings()
    match_pos, dist, out, rings = run_case_with(_c_launch(lib, "macattn_{op}_" + spec), pr, _poison)
    torch.cuda.synchronize()
    _check_match(pr, match_pos, dist)
    _check_step(pr, out, match_pos, rings, before)

