"""The C library sources of the AOT images (``python -m macattn.plugins.aot_library``),
generated on this CPU machine: stable entry points with the plugin's parameter order, one
per specialisation. (CI builds the library with CMake; the device test loads it.)"""
from __future__ import annotations

import re

import pytest

pytest.importorskip("triton")


def test_generate_small_spec(tmp_path):
    from macattn.plugins.aot_library import LIBRARY_SPECS, generate

    files = generate(tmp_path, {"small": LIBRARY_SPECS["small"]})
    assert sorted(f.name for f in files) == ["macattn_kernels.c", "mk_attend_small.c", "mk_match_small.c"]
    header = (tmp_path / "macattn_kernels.h").read_text()
    match = re.search(r"CUresult macattn_match_small\(CUstream stream, (.*?)\);", header).group(1)
    assert [p.split()[-1] for p in match.split(", ")] == [
        "q_pre_ptr", "qring_ptr", "ring_lse_ptr", "ring_pos_ptr", "slots_ptr", "positions_ptr", "B",
        "match_pos_ptr", "dist_ptr"]
    attend = re.search(r"CUresult macattn_attend_small\(CUstream stream, (.*?)\);", header).group(1)
    assert "int32_t B, int32_t T, CUdeviceptr out_ptr" in attend
    body = (tmp_path / "mk_attend_small.c").read_text()
    assert "unsigned int gX = B;" in body and "unsigned int gY = 2;" in body     # grid (B, Hkv=2, 1)
    assert 'cuModuleGetFunction(' in body and '"mac_attend_onepass"' in body
    assert 'return "match_small,attend_small";' in (tmp_path / "macattn_kernels.c").read_text()


def test_list_matches_generated_names(tmp_path, capsys):
    from macattn.plugins.aot_library import LIBRARY_SPECS, main

    assert main(["--out", str(tmp_path), "--list"]) == 0
    listed = capsys.readouterr().out.strip().split(";")
    assert len(listed) == 2 * len(LIBRARY_SPECS) + 1
    assert listed[-1].endswith("macattn_kernels.c")
