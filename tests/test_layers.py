"""The layer contract (``[tool.importlinter]`` in pyproject.toml, run by ``lint-imports``) holds on
the tree and breaks when an import that the redesign removed comes back."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT = shutil.which("lint-imports")
pytestmark = pytest.mark.skipif(LINT is None, reason="import-linter is not installed (the test extra installs it)")


def _lint(root: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(root / "python")}
    return subprocess.run([LINT, "--config", str(root / "pyproject.toml"), "--no-cache"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)


def _copy_tree(dst: Path) -> Path:
    """python/ (its links to plugins/, builder/, runtime/ followed) and pyproject.toml, in ``dst``."""
    shutil.copytree(ROOT / "python", dst / "python", symlinks=False,
                    ignore=shutil.ignore_patterns("__pycache__", "data", "*.egg-info"))
    shutil.copy(ROOT / "pyproject.toml", dst / "pyproject.toml")
    return dst


def test_the_tree_keeps_its_layers():
    done = _lint(ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout


@pytest.mark.parametrize("module, line, broken", [
    # the cycle of the old layout: the MAC state imported by the runtime, and importing it back
    ("macattn/methods/mac/state.py", "from macattn.runtime.slots import SlotStates",
     "macattn.methods is not allowed to import macattn.runtime"),
    # a kernel reaching up into the op definitions (the old import-time registration)
    ("macattn/plugins/mac_match/op.py", "import macattn.methods.mac.ops",
     "macattn.plugins is not allowed to import macattn.methods"),
    # evaluation reaching into the engine's privates is allowed only downwards: the CLI is on top
    ("macattn/models/attention.py", "from macattn.cli import main",
     "macattn.models is not allowed to import macattn.cli"),
])
def test_an_upward_import_breaks_the_contract(tmp_path, module, line, broken):
    root = _copy_tree(tmp_path)
    path = root / "python" / module
    path.write_text(path.read_text() + f"\n{line}  # noqa: E402,F401\n")
    done = _lint(root)
    assert done.returncode != 0, done.stdout
    assert broken in done.stdout, done.stdout


@pytest.mark.parametrize("module, code, broken", [
    # the GPU decode deciding by the method's class again (issue 42: the engine names no method)
    ("macattn/runtime/cuda_decode.py", "from macattn.methods.mac.backend import MacAttention",
     "macattn.runtime.cuda_decode is not allowed to import macattn.methods.mac"),
    # the engine importing MAC's config type instead of asking the registry; a lazy import counts too
    ("macattn/runtime/engine.py", "def _mac_config():\n    from macattn.methods.mac.config import MacConfig\n"
     "    return MacConfig",
     "macattn.runtime.engine is not allowed to import macattn.methods.mac"),
    # a tensor-parallel rank combining a method's figures itself
    ("macattn/runtime/tensor_parallel.py", "from macattn.methods.full.backend import FullAttention",
     "macattn.runtime.tensor_parallel is not allowed to import macattn.methods.full"),
])
def test_a_method_import_in_the_engine_core_breaks_the_contract(tmp_path, module, code, broken):
    root = _copy_tree(tmp_path)
    path = root / "python" / module
    path.write_text(path.read_text() + f"\n\n{code}  # noqa: E402,F401\n")
    done = _lint(root)
    assert done.returncode != 0, done.stdout
    assert broken in done.stdout, done.stdout
