"""The import contracts (``[tool.importlinter]`` in pyproject.toml, run by ``lint-imports``: the layers, the
engine core naming no method, no cycle between siblings, independent method folders, independent plugin
op families) hold on the tree, and each breaks when an import that the redesign removed comes back."""
from __future__ import annotations

import os
import shutil
import subprocess
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
    ("macattn/plugins/mac/match_op.py", "import macattn.methods.mac.ops",
     "macattn.plugins is not allowed to import macattn.methods"),
    # evaluation reaching into the engine's privates is allowed only downwards: the CLI is on top
    ("macattn/models/attention.py", "from macattn.cli import main",
     "macattn.models is not allowed to import macattn.cli"),
])
def test_an_upward_import_breaks_the_contract(tmp_path, module, line, broken):
    _assert_breaks(tmp_path, module, line, broken)


def _assert_breaks(tmp_path: Path, module: str, code: str, broken: str) -> None:
    """``code`` appended to ``module`` of a copy of the tree makes ``lint-imports`` report ``broken``."""
    root = _copy_tree(tmp_path)
    path = root / "python" / module
    path.write_text(path.read_text() + f"\n\n{code}  # noqa: E402,F401\n")
    done = _lint(root)
    assert done.returncode != 0, done.stdout
    assert broken in " ".join(done.stdout.split()), done.stdout      # lint-imports wraps its lines at 80


@pytest.mark.parametrize("module, code, broken", [
    # the GPU decode deciding by the method's class again (issue 42: the engine names no method)
    ("macattn/runtime/cuda_decode.py", "from macattn.methods.mac.backend import MacAttention",
     "macattn.runtime.cuda_decode is not allowed to import macattn.methods.mac"),
    # the engine importing MAC's config type instead of asking the registry; a lazy import counts too
    ("macattn/runtime/engine.py", "def _mac_config():\n    from macattn.methods.mac.config import MacConfig\n"
     "    return MacConfig",
     "macattn.runtime.engine is not allowed to import macattn.methods.mac"),
    # a tensor-parallel rank combining a method's figures itself
    ("macattn/runtime/tensor_parallel/executor.py", "from macattn.methods.full.backend import FullAttention",
     "macattn.runtime.tensor_parallel is not allowed to import macattn.methods.full"),
])
def test_a_method_import_in_the_engine_core_breaks_the_contract(tmp_path, module, code, broken):
    _assert_breaks(tmp_path, module, code, broken)


@pytest.mark.parametrize("module, code, broken", [
    # the three loops inside a layer that issue 34 opened, each brought back (a lazy import counts)
    ("macattn/builder/trtllm_attention.py", "def _fields():\n    from macattn.builder.trtllm_build import main\n"
     "    return main", "No cycles are allowed in macattn.builder."),
    ("macattn/evaluation/long_gen.py", "def _settings():\n    from macattn.evaluation.harness import run_eval\n"
     "    return run_eval", "No cycles are allowed in macattn.evaluation."),
    ("macattn/methods/mka/ops.py", "from macattn.methods.kernels import register_kernels",
     "No cycles are allowed in macattn.methods."),
    # a helper shared by the op families importing one of them (the MAC decode plan imports the helper)
    ("macattn/plugins/triton_util.py", "from macattn.plugins.mac.decode_plan import MacDecodePlan",
     "No cycles are allowed in macattn.plugins."),
])
def test_an_import_cycle_between_siblings_breaks_the_contract(tmp_path, module, code, broken):
    _assert_breaks(tmp_path, module, code, broken)


@pytest.mark.parametrize("module, code, broken", [
    # MAC with completion on a miss back in the MAC folder, importing the completion method's estimator
    ("macattn/methods/mac/backend.py", "from macattn.methods.completion.reference import partition",
     "macattn.methods.mac is not allowed to import macattn.methods.completion"),
    # a method reusing another's state (they share only macattn.methods.base and the core)
    ("macattn/methods/full/backend.py", "def _rings():\n    from macattn.methods.mac.state import MacState\n"
     "    return MacState", "macattn.methods.full is not allowed to import macattn.methods.mac"),
])
def test_one_method_importing_another_breaks_the_contract(tmp_path, module, code, broken):
    _assert_breaks(tmp_path, module, code, broken)


@pytest.mark.parametrize("module, code, broken", [
    # the match and attend folders split again, the attention reaching into the match's reduction
    ("macattn/plugins/route_fused/op.py", "from macattn.plugins.mac.match_reduce import reduce_match_partials",
     "macattn.plugins.route_fused is not allowed to import macattn.plugins.mac"),
    # the page selector calling back into the retrieval-completion kernels (only the other way is declared)
    ("macattn/plugins/page_select/op.py", "from macattn.plugins.retrieval_completion.checks import resolve_scale",
     "macattn.plugins.page_select is not allowed to import macattn.plugins.retrieval_completion"),
])
def test_one_plugin_family_importing_another_breaks_the_contract(tmp_path, module, code, broken):
    _assert_breaks(tmp_path, module, code, broken)
