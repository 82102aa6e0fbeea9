"""C library of the AOT kernel images: Triton's AOT C tool over ``AotImage`` specs (CMake).

``python -m macattn.plugins.aot_library --out DIR`` writes, for every specialisation in
``LIBRARY_SPECS``, ``DIR/<name>.c`` / ``<name>.h`` (Triton's ``triton.tools.compile``
templates: embedded sm_90 cubin, ``load``/``unload``, a launcher taking the stream and the
kernel's runtime parameters), plus ``DIR/macattn_kernels.{c,h}`` with stable entry points::

    CUresult macattn_<name>(CUstream stream, <inputs...>, int32_t B[, int32_t T], <outputs...>);
    void macattn_kernels_load(void);  void macattn_kernels_unload(void);
    const char *macattn_kernels_names(void);   /* comma-separated list: match_<spec>,attend_<spec>,... */
    #define MACATTN_KERNEL_SPECS(X)  /* X(spec, Hq, Hkv, d, K, band, tau) per specialisation */

Each specialisation is the very ``AotImage`` the TensorRT ``aot_impl`` returns for those
shapes (same kernel file, signature and constexprs). Triton's C tool asks the active
driver only for its C type map, so a stand-in driver lets it run on a machine without a
GPU (the CI machine).
"""
from __future__ import annotations

import argparse
import sys
import types
from pathlib import Path

import torch

from .aot import AotImage

__all__ = ["RuntimeDim", "LIBRARY_SPECS", "library_images", "generate"]


class RuntimeDim:
    """A dim known only at launch: a C parameter of the launcher (never a build-time constant)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __str__(self) -> str:
        return self.name


def _match_shapes(Hq: int, K: int, d: int) -> list:
    B, S = RuntimeDim("B"), RuntimeDim("S")
    return [(B, Hq, d), (S, Hq, K, d), (S, Hq, K), (S, K), (B,), (B,)]


def _attend_shapes(Hq: int, Hkv: int, K: int, d: int) -> list:
    B, S, T = RuntimeDim("B"), RuntimeDim("S"), RuntimeDim("T")
    return [(B, Hq, d), (B, Hq, d), (B, Hkv, T, d), (B, Hkv, T, d), (B,), (B, Hq), (B,),
            (S, Hq, K, d), (S, Hq, K, d), (S, Hq, K), (S, K)]


# name -> (heads Hq, KV heads Hkv, head dim d, window K, band r, tau, dtype)
LIBRARY_SPECS = {
    "llama8b": (32, 8, 128, 1024, 256, 0.45, torch.bfloat16),     # LLaMA-3.1-8B / Mistral-7B attention
    "qwen7b": (28, 4, 128, 1024, 256, 0.45, torch.bfloat16),      # Qwen2-7B
    "small": (8, 2, 64, 64, 16, 0.5, torch.bfloat16),             # edge-case tests (wrap-around at K=64)
}


def library_images(specs: dict | None = None) -> dict[str, AotImage]:
    """``{"match_<spec>": AotImage, "attend_<spec>": AotImage}`` for the library."""
    from .mac.attend_plugin import attend_aot_image
    from .mac.match_plugin import match_aot_image

    images = {}
    for name, (Hq, Hkv, d, K, band, tau, dt) in (specs or LIBRARY_SPECS).items():
        i64, f32 = torch.int64, torch.float32
        images[f"match_{name}"] = match_aot_image(_match_shapes(Hq, K, d), [dt, dt, f32, i64, i64, i64],
                                                  band=band, tau=tau)
        images[f"attend_{name}"] = attend_aot_image(_attend_shapes(Hq, Hkv, K, d),
                                                    [dt, dt, dt, dt, i64, i64, i64, dt, f32, f32, i64],
                                                    band=band, scale=d ** -0.5)
    return images


def _c_signature(image: AotImage) -> list[str]:
    """The C tool's signature list: runtime types, then constexpr literals, in parameter order."""
    out = [ty for _, ty in image.spec.signature]
    for _, value in image.spec.constexprs:
        out.append(str(int(value)) if isinstance(value, bool) else repr(value))
    return out


def _run_c_tool(image: AotImage, out_name: str, out_dir: Path) -> tuple[str, list[str]]:
    import triton
    from triton.backends.nvidia.driver import ty_to_cpp
    from triton.tools.compile import CompileArgs, compile_kernel

    from triton.backends.compiler import GPUTarget

    target = GPUTarget("cuda", image.arch, 32)
    try:
        active = triton.runtime.driver.active.get_current_target()
    except RuntimeError:             # no GPU here: a stand-in driver with the C type map and the target
        triton.runtime.driver.set_active(types.SimpleNamespace(map_python_to_cpp_type=ty_to_cpp,
                                                               get_current_target=lambda: target))
    else:
        if active != target:
            raise RuntimeError(f"this machine's GPU is {active}; the library is built for {target}")
    path, fn_name = image.spec.source
    args = CompileArgs(path=path, kernel_name=fn_name, signature=", ".join(_c_signature(image)),
                       grid=",".join(str(g) for g in image.grid),
                       # the tool's own target string parsing leaves the arch a str (triton 3.6): use the driver's
                       target=None,
                       num_warps=image.spec.num_warps, num_stages=image.spec.num_stages, out_name=out_name,
                       out_path=out_dir / out_name)
    func_name, files = compile_kernel(args)
    for f in files:
        f.rename(out_dir / f"{out_name}{f.suffix}")
    c_params = [f"{ty_to_cpp(ty)} {name}" for name, ty in image.spec.signature]
    return func_name, c_params


def generate(out_dir: Path, specs: dict | None = None) -> list[Path]:
    """Write the library's C sources into ``out_dir``; returns the ``.c`` files."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    names, decls, defs, loads, unloads, sources = [], [], [], [], [], []
    table = [f"  X({spec}, {Hq}, {Hkv}, {d}, {K}, {band}, {tau!r})"
             for spec, (Hq, Hkv, d, K, band, tau, _) in (specs or LIBRARY_SPECS).items()]
    for name, image in library_images(specs).items():
        func, params = _run_c_tool(image, f"mk_{name}", out_dir)
        args = ", ".join(p.split()[-1] for p in params)
        proto = f"CUresult macattn_{name}(CUstream stream, {', '.join(params)})"
        names.append(name)
        decls.append(f'#include "mk_{name}.h"\n{proto};')
        defs.append(f"{proto} {{ return {func}(stream, {args}); }}")
        loads.append(f"  load_{func}();")
        unloads.append(f"  unload_{func}();")
        sources.append(out_dir / f"mk_{name}.c")
    (out_dir / "macattn_kernels.h").write_text(
        "/* generated by macattn.plugins.aot_library: MAC plugin kernels (sm_90 cubins) */\n"
        "#pragma once\n#include <cuda.h>\n#include <stdint.h>\n" + "\n".join(decls) + "\n"
        "void macattn_kernels_load(void);\nvoid macattn_kernels_unload(void);\n"
        "const char *macattn_kernels_names(void);\n"
        "/* X(spec, Hq, Hkv, d, K, band, tau) for every specialisation (bf16; scale = d ** -0.5) */\n"
        "#define MACATTN_KERNEL_SPECS(X) \\\n" + " \\\n".join(table) + "\n")
    (out_dir / "macattn_kernels.c").write_text(
        '#include "macattn_kernels.h"\n' + "\n".join(defs) + "\n"
        "void macattn_kernels_load(void) {\n" + "\n".join(loads) + "\n}\n"
        "void macattn_kernels_unload(void) {\n" + "\n".join(unloads) + "\n}\n"
        f'const char *macattn_kernels_names(void) {{ return "{",".join(names)}"; }}\n')
    return sources + [out_dir / "macattn_kernels.c"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m macattn.plugins.aot_library", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for the generated C sources")
    parser.add_argument("--list", action="store_true", help="print the .c files that --out would hold, and exit")
    args = parser.parse_args(argv)
    if args.list:
        names = [f"mk_{op}_{s}.c" for s in LIBRARY_SPECS for op in ("match", "attend")] + ["macattn_kernels.c"]
        print(";".join(str(Path(args.out) / n) for n in names))
        return 0
    for f in generate(Path(args.out)):
        print(f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
