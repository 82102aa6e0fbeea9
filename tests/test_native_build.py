"""``CMakeLists.txt`` builds the native kernel library on this CPU machine (what CI checks):
configure, generate the AOT C sources, compile, link; the library exports one entry point per
specialisation plus load/unload/names. Loading and launching it is a device test
(``tests/plugins/test_aot_images_gpu.py``)."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytest.importorskip("triton")


@pytest.mark.slow
def test_cmake_builds_macattn_kernels(tmp_path):
    if shutil.which("cmake") is None:
        pytest.skip("cmake is not installed")
    build = tmp_path / "build"
    cfg = subprocess.run(["cmake", "-S", str(ROOT), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release"],
                         capture_output=True, text=True, timeout=300)
    if cfg.returncode and "CUDAToolkit" in cfg.stderr:
        pytest.skip("CUDA toolkit headers (cuda.h) not found: " + cfg.stderr[-400:])
    assert cfg.returncode == 0, cfg.stdout[-3000:] + cfg.stderr[-3000:]
    assert "skipping macattn_trt" in cfg.stdout          # no TensorRT here: the plugin target is off
    done = subprocess.run(["cmake", "--build", str(build), "-j", "2", "--target", "macattn_kernels"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lib = build / "libmacattn_kernels.so"
    assert lib.is_file()
    nm = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True, check=True).stdout
    exported = {line.split()[-1] for line in nm.splitlines() if " T " in line}
    from macattn.plugins.aot_library import LIBRARY_SPECS

    for spec in LIBRARY_SPECS:
        assert {f"macattn_match_{spec}", f"macattn_attend_{spec}"} <= exported
    assert {"macattn_kernels_load", "macattn_kernels_unload", "macattn_kernels_names"} <= exported
