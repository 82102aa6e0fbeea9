"""Launch the ``tritonserver`` bundled in the ``nvidia-pytriton`` wheel for a model repository.

What it takes (../shared/FACTS.md, re-checked here):

* the Python-backend stub of the running interpreter's version, copied into a *copy* of the
  wheel's ``backends`` dir (site-packages is never modified);
* ``LD_LIBRARY_PATH`` with the wheel's ``nvidia_pytriton.libs``;
* a ``PATH`` without another installation's ``python3``: the stub links the system
  ``libpython3.X`` and derives its stdlib from the first ``python3`` on ``PATH`` (e.g. a pyenv
  ``versions/3.11.7/bin``), and a foreign stdlib fails (``_ssl``: undefined symbol). Such
  directories are dropped. ``PYTHONHOME`` / ``PYTHONPATH`` are ignored by the stub.

The admin endpoints (``ADMIN_ENDPOINTS``: log settings, traces, statistics, the repository index
and load / unload, shared memory, and the model configurations, which hold this machine's paths)
are restricted as pytriton restricts them (``TritonSecurityConfig``, Triton's
``--http-restricted-api`` / ``--grpc-restricted-protocol``): they answer only requests with the
header ``triton-access-token: <admin_token>`` (a random token unless one is given). Health,
metadata and inference stay open.
"""
from __future__ import annotations

import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

__all__ = ["ADMIN_ENDPOINTS", "RunningServer", "TritonLaunch", "prepare_tritonserver", "serve"]

PYVER = f"{sys.version_info.major}.{sys.version_info.minor}"
# pytriton's DEFAULT_PROTECTED_ENDPOINTS plus the model configurations (paths of this machine)
ADMIN_ENDPOINTS = ["shared-memory", "model-repository", "statistics", "trace", "logging", "model-config"]


@dataclass(frozen=True)
class TritonLaunch:
    argv: list[str]
    env: dict[str, str]
    cwd: str
    admin_token: str


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
                         address: str = "127.0.0.1", metrics_port: int | None = None,
                         admin_token: str | None = None) -> TritonLaunch:
    """Set up ``workdir/backends`` and return the command line and environment to start the
    server on ``address`` with the given ports (``metrics_port`` None: no Prometheus endpoint), its
    ``ADMIN_ENDPOINTS`` open only to ``admin_token`` (None: a random one, in the returned launch).
    Raises ``RuntimeError`` saying why the bundled server cannot run on this machine."""
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
    from pytriton.triton import TRITON_ACCESS_HEADER, TritonSecurityConfig

    security = TritonSecurityConfig(access_token=admin_token, restricted_endpoints=ADMIN_ENDPOINTS)
    restricted = f"{','.join(security.restricted_endpoints)}:{TRITON_ACCESS_HEADER}={security.access_token}"
    workdir = Path(workdir)
    backends = workdir / "backends"
    if not backends.exists():
        shutil.copytree(server / "backends", backends)
        shutil.copy2(stub, backends / "python" / "triton_python_backend_stub")
    argv = [str(binary), f"--model-repository={Path(repo).resolve()}", f"--backend-directory={backends.resolve()}",
            f"--http-address={address}", f"--http-port={http_port}", f"--grpc-address={address}",
            f"--grpc-port={grpc_port}", "--exit-timeout-secs=5", f"--http-restricted-api={restricted}",
            f"--grpc-restricted-protocol={restricted}"]
    argv += (["--allow-metrics=false"] if metrics_port is None else
             ["--allow-metrics=true", "--allow-gpu-metrics=false", f"--metrics-address={address}",
              f"--metrics-port={metrics_port}"])
    return TritonLaunch(argv, env, str(workdir), security.access_token)


@dataclass(frozen=True)
class RunningServer:
    """A started ``tritonserver``: its endpoints (``host:port``; ``metrics_url`` serves Prometheus
    text at ``/metrics``), process and log file, and the token its admin endpoints ask for."""
    http_url: str
    grpc_url: str
    process: subprocess.Popen
    log_path: Path
    admin_token: str
    metrics_url: str | None = None


def _free_port(address: str) -> int:
    with socket.socket() as s:
        s.bind((address, 0))
        return s.getsockname()[1]


@contextmanager
def serve(repo: str | Path, workdir: str | Path, *, http_port: int = 0, grpc_port: int = 0,
          metrics_port: int | None = 0, address: str = "127.0.0.1", admin_token: str | None = None,
          ready_timeout: float = 120.0) -> Iterator[RunningServer]:
    """Start the bundled ``tritonserver`` on ``repo``, wait until the server and every model of the
    repository are ready, yield the endpoints, and stop the server on exit. Port 0 picks a free
    port; ``metrics_port`` None turns the metrics endpoint off; ``admin_token`` opens the
    ``ADMIN_ENDPOINTS`` (None: a random token, in the yielded ``RunningServer``). Raises ``RuntimeError`` with the end
    of the server log if it exits or is not ready in ``ready_timeout`` seconds."""
    from tritonclient import http as httpclient

    if ready_timeout <= 0:
        raise ValueError(f"ready_timeout must be > 0 seconds, got {ready_timeout}")
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    http_port = http_port or _free_port(address)
    grpc_port = grpc_port or _free_port(address)
    if metrics_port is not None:
        metrics_port = metrics_port or _free_port(address)
    launch = prepare_tritonserver(repo, workdir, http_port=http_port, grpc_port=grpc_port, address=address,
                                  metrics_port=metrics_port, admin_token=admin_token)
    models = sorted(p.name for p in Path(repo).iterdir() if (p / "config.pbtxt").is_file())
    log_path = workdir / "tritonserver.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(launch.argv, env=launch.env, cwd=launch.cwd, stdout=log, stderr=subprocess.STDOUT)
        client = httpclient.InferenceServerClient(f"{address}:{http_port}")
        try:
            deadline = time.monotonic() + ready_timeout
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"tritonserver exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
                try:
                    if client.is_server_ready() and all(client.is_model_ready(m) for m in models):
                        break
                except Exception:  # noqa: BLE001 - not listening yet
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"tritonserver not ready in {ready_timeout:.0f} s:\n"
                                       f"{log_path.read_text()[-3000:]}")
                time.sleep(0.25)
            client.close()  # an open keep-alive connection would hold the shutdown
            yield RunningServer(f"{address}:{http_port}", f"{address}:{grpc_port}", proc, log_path, launch.admin_token,
                                None if metrics_port is None else f"{address}:{metrics_port}")
        finally:
            client.close()
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
