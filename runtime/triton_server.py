"""Launch the ``tritonserver`` bundled in the ``nvidia-pytriton`` wheel for a model repository.

What it takes (../shared/FACTS.md, re-checked here):

* the Python-backend stub of the running interpreter's version, copied into a *copy* of the
  wheel's ``backends`` dir (site-packages is never modified);
* ``LD_LIBRARY_PATH`` with the wheel's ``nvidia_pytriton.libs``;
* a ``PATH`` without another installation's ``python3``: the stub links the system
  ``libpython3.X`` and derives its stdlib from the first ``python3`` on ``PATH`` (e.g. a pyenv
  ``versions/3.11.7/bin``), and a foreign stdlib fails (``_ssl``: undefined symbol). Such
  directories are dropped. ``PYTHONHOME`` / ``PYTHONPATH`` are ignored by the stub.
"""
from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

__all__ = ["TritonLaunch", "prepare_tritonserver"]

PYVER = f"{sys.version_info.major}.{sys.version_info.minor}"


@dataclass(frozen=True)
class TritonLaunch:
    argv: list[str]
    env: dict[str, str]
    cwd: str


def _wheel() -> tuple[Path, Path]:
    try:
        import pytriton
    except ImportError as exc:
        raise RuntimeError("tritonserver comes from the nvidia-pytriton wheel: pip install nvidia-pytriton") from exc
    root = Path(pytriton.__file__).parent
    return root / "tritonserver", root.parent / "nvidia_pytriton.libs"


def _stub_python_home(stub: Path, env: dict) -> Path | None:
    """The installation prefix of the libpython the stub links (``/usr`` for Debian's)."""
    out = subprocess.run(["ldd", str(stub)], env=env, capture_output=True, text=True).stdout
    m = re.search(r"(libpython3\.\d+\S*)\s+=>\s+(\S+)", out)
    if m is None or m.group(2) == "not":
        raise RuntimeError(f"the Python {PYVER} backend stub needs a shared libpython{PYVER} that this system "
                           f"lacks (ldd: {out.strip()[-300:]!r})")
    lib = Path(m.group(2)).resolve()
    for parent in lib.parents:
        if (parent / "lib" / f"python{PYVER}" / "os.py").is_file():
            return parent.resolve()
    return None


def _clean_path(path: str, home: Path | None) -> str:
    """Drop ``PATH`` entries whose ``python3`` belongs to another installation than ``home``
    (pyenv shims and versions, virtualenvs whose interpreter links one of those)."""
    keep = []
    for d in path.split(os.pathsep):
        exes = [Path(d) / exe for exe in ("python3", "python", f"python{PYVER}")]
        foreign = any(e.exists() and e.resolve().parent.parent != home for e in exes)
        if d and not foreign:
            keep.append(d)
    return os.pathsep.join(keep)


def prepare_tritonserver(repo: str | Path, workdir: str | Path, *, http_port: int, grpc_port: int,
                         address: str = "127.0.0.1") -> TritonLaunch:
    """Set up ``workdir/backends`` and return the command line and environment to start the
    server on ``address`` with the given ports. Raises ``RuntimeError`` saying why the bundled
    server cannot run on this machine."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        raise RuntimeError(f"the wheel's tritonserver is a Linux x86_64 binary; this is "
                           f"{platform.system()} {platform.machine()}")
    server, libs = _wheel()
    stub = server / "python_backend_stubs" / PYVER / "triton_python_backend_stub"
    if not stub.is_file():
        raise RuntimeError(f"nvidia-pytriton has no Python-backend stub for Python {PYVER}")
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(libs), env.get("LD_LIBRARY_PATH")]))
    env["PATH"] = _clean_path(env.get("PATH", ""), _stub_python_home(stub, env))
    binary = server / "bin" / "tritonserver"
    try:
        r = subprocess.run([str(binary), "--help"], env=env, capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RuntimeError(f"tritonserver cannot start here: {exc}") from exc
    if b"Usage: tritonserver" not in r.stdout + r.stderr:
        raise RuntimeError(f"tritonserver cannot start here: {(r.stdout + r.stderr)[-500:]!r}")
    workdir = Path(workdir)
    backends = workdir / "backends"
    if not backends.exists():
        shutil.copytree(server / "backends", backends)
        shutil.copy2(stub, backends / "python" / "triton_python_backend_stub")
    argv = [str(binary), f"--model-repository={Path(repo).resolve()}", f"--backend-directory={backends.resolve()}",
            f"--http-address={address}", f"--http-port={http_port}", f"--grpc-address={address}",
            f"--grpc-port={grpc_port}", "--allow-metrics=false", "--exit-timeout-secs=5"]
    return TritonLaunch(argv, env, str(workdir))
