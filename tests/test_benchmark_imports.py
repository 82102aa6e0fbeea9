"""The contract over ``benchmarks/`` (scripts, not a package, so import-linter does not see them): a
benchmark uses ``macattn``'s public names only. Every ``benchmarks/**/*.py`` is parsed with ``ast``; an
import of a name or module with a leading underscore from ``macattn`` (``from macattn.x import _y``,
``from macattn._x import y``, ``import macattn._x``), lazy imports inside functions included, or an
underscored attribute of a module imported as ``import macattn.x as m`` (``m._y``) breaks it."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = sorted((ROOT / "benchmarks").rglob("*.py"))


def _private(dotted: str) -> list[str]:
    return [part for part in dotted.split(".") if part.startswith("_") and not part.startswith("__")]


def private_imports(source: str) -> list[str]:
    """``"line: what"`` for every private ``macattn`` name ``source`` imports or reads off a ``macattn`` module."""
    tree = ast.parse(source)
    found, aliases = [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and node.module.split(".")[0] == "macattn":
            for bad in _private(node.module) + [a.name for a in node.names if _private(a.name)]:
                found.append(f"{node.lineno}: from {node.module} import ... {bad}")
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] != "macattn":
                    continue
                found += [f"{node.lineno}: import {a.name} ({bad})" for bad in _private(a.name)]
                aliases[a.asname or a.name.split(".")[0]] = a.name
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            base = node.value
            chain = []
            while isinstance(base, ast.Attribute):
                chain.append(base.attr)
                base = base.value
            if isinstance(base, ast.Name) and base.id in aliases:
                found.append(f"{node.lineno}: {'.'.join([base.id, *reversed(chain), node.attr])}")
    return found


@pytest.mark.parametrize("script", BENCHMARKS, ids=lambda p: str(p.relative_to(ROOT)))
def test_a_benchmark_imports_no_private_name(script):
    assert not private_imports(script.read_text()), f"{script.relative_to(ROOT)} uses private macattn names"


def test_there_are_benchmarks_to_check():
    assert len(BENCHMARKS) >= 10


@pytest.mark.parametrize("code", [
    # the five private names the benchmarks imported before (issue 34)
    "from macattn.evaluation.harness import EvalSettings, _csv",
    "from macattn.runtime.a3_assembly import RagPrompt, _forward",
    "def main():\n    from macattn.plugins.fp8_linear.kernel import _fp8_gemv\n",
    "from macattn.plugins.retrieval_completion.kernel import _decode_merge",
    # a private module, imported or reached through
    "from macattn.plugins._triton_util import num_sms",
    "import macattn.plugins._triton_util as tu",
    # an underscored attribute of an imported module
    "import macattn.evaluation.harness as harness\nharness._csv('1,2', int)\n",
    "import macattn.evaluation.harness\nmacattn.evaluation.harness._csv('1', int)\n",
])
def test_a_private_import_breaks_the_contract(code):
    assert private_imports(code)


@pytest.mark.parametrize("code", [
    "from macattn.evaluation.harness import EvalSettings, parse_csv",
    "import macattn.evaluation.harness as harness\nharness.__name__\n",
    "from ._local import _helper",                    # not macattn's
    "from torch import _C",
])
def test_public_imports_keep_the_contract(code):
    assert not private_imports(code)
