"""Draw docs/architecture.png from the code: the package's layers and the imports between its subpackages.

    python3 docs/make_architecture.py                  # rewrites docs/architecture.png
    python3 docs/make_architecture.py --out /tmp/a.png

The layers come from the import-linter ``layers`` contract in ``pyproject.toml``. The imports come from
reading every module under ``python/macattn`` with ``ast``: ``import macattn.x``, ``from macattn.x import
y``, relative imports, and imports inside functions (lazy imports), which are counted too. Nothing is
imported or executed, so the script needs only matplotlib (no graphviz, no torch).

The picture has two panels. On the left, the layers from top to bottom, each showing its subpackages and
their modules. On the right, the import matrix: row imports column, and a cell counts the import
statements. With the subpackages sorted by layer (top first), a downward import lands right of the diagonal
blocks and an upward one left of them. Upward cells are drawn red; ``lint-imports`` refuses them. The PNG's
``Description`` text chunk lists every subpackage drawn, which ``tests/test_docs.py`` checks.
"""
from __future__ import annotations

import argparse
import ast
import os
import sys
import textwrap
import tomllib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "macattn"

__all__ = ["Graph", "read_layers", "build_graph", "draw", "main"]


@dataclass
class Graph:
    """layers: top to bottom, each a tuple of independent top-level packages (``macattn.runtime | macattn.builder``).
    units: every subpackage (a folder with ``__init__.py``) and the top-level modules outside one (``macattn.cli``),
    mapped to the names of the modules they hold. edges: ``(importer unit, imported unit) -> import statements``."""

    layers: list[tuple[str, ...]]
    units: dict[str, list[str]] = field(default_factory=dict)
    edges: Counter = field(default_factory=Counter)
    packages: set[str] = field(default_factory=set)

    def label(self, unit: str) -> str:
        """The unit as a path under ``python/macattn``: ``apps/serving/``, ``cli.py``; the root is ``__init__.py``."""
        if unit == PACKAGE:
            return "__init__.py"
        rel = unit[len(PACKAGE) + 1:].replace(".", "/")
        return rel + "/" if unit in self.packages else rel + ".py"

    def layer_of(self, unit: str) -> int:
        """Index of the layer holding ``unit`` (``-1``: the package root, above every layer)."""
        for i, names in enumerate(self.layers):
            if any(unit == n or unit.startswith(n + ".") for n in names):
                return i
        return -1

    def ordered_units(self) -> list[str]:
        """Units sorted by layer (top first), then by top-level package as the contract lists it, then by name."""
        def key(u: str):
            i = self.layer_of(u)
            names = self.layers[i] if i >= 0 else ()
            col = next((j for j, n in enumerate(names) if u == n or u.startswith(n + ".")), 0)
            return (i, col, u)
        return sorted(self.units, key=key)

    def upward(self) -> list[tuple[str, str, int]]:
        """Edges from a lower layer to a higher one (what the layers contract forbids)."""
        return [(a, b, n) for (a, b), n in sorted(self.edges.items())
                if self.layer_of(a) > self.layer_of(b) >= 0]


def read_layers(pyproject: Path) -> list[tuple[str, ...]]:
    """The ``layers`` list of the first import-linter contract of type ``layers``."""
    config = tomllib.loads(pyproject.read_text())
    for contract in config["tool"]["importlinter"]["contracts"]:
        if contract.get("type") == "layers":
            return [tuple(part.strip() for part in layer.split("|")) for layer in contract["layers"]]
    raise ValueError(f"{pyproject}: no import-linter contract of type 'layers'")


def _modules(pkg_dir: Path) -> dict[str, Path]:
    """``{dotted module name: file}`` for every ``.py`` file in a folder of the package (symbolic links to folders
    are not followed: the package is one real tree)."""
    found = {}
    for dirpath, dirnames, filenames in os.walk(pkg_dir):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith((".", "__pycache__")))
        here = Path(dirpath)
        if not (here / "__init__.py").exists():
            dirnames[:] = []
            continue
        rel = here.relative_to(pkg_dir.parent).parts
        for f in sorted(filenames):
            if f.endswith(".py"):
                name = ".".join(rel) if f == "__init__.py" else ".".join(rel + (f[:-3],))
                found[name] = here / f
    return found


def _unit(module: str, packages: set[str]) -> str:
    """The subpackage a module belongs to (a package is its own unit); a top-level module is its own unit."""
    if module in packages:
        return module
    parent = module.rpartition(".")[0]
    return module if parent == PACKAGE else parent


def _imports(path: Path, module: str, is_package: bool) -> list[list[str]]:
    """Per import statement anywhere in a module's body, the ``macattn`` names it imports (modules, packages, or
    names inside them: the caller resolves each to the module that holds it)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    base = module if is_package else module.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = base.split(".")
                anchor = ".".join(parts[: len(parts) - (node.level - 1)])
                target = f"{anchor}.{node.module}" if node.module else anchor
            else:
                target = node.module or ""
            names = [f"{target}.{a.name}" for a in node.names]
        else:
            continue
        names = [n for n in names if n == PACKAGE or n.startswith(PACKAGE + ".")]
        if names:
            out.append(names)
    return out


def build_graph(src: Path = ROOT / "python" / PACKAGE, pyproject: Path = ROOT / "pyproject.toml") -> Graph:
    """Read the layers and every module's imports."""
    graph = Graph(read_layers(pyproject))
    modules = _modules(src)
    packages = {m for m, p in modules.items() if p.name == "__init__.py"}
    graph.packages = set(packages)
    for m in modules:
        unit = _unit(m, packages)
        graph.units.setdefault(unit, [])
        if m != unit:
            graph.units[unit].append(m.rpartition(".")[2])
    for m, path in modules.items():
        src_unit = _unit(m, packages)
        for statement in _imports(path, m, m in packages):
            targets = set()
            for target in statement:
                while target not in modules and "." in target:      # ``from macattn.x import name``: not a module
                    target = target.rpartition(".")[0]
                targets.add(_unit(target, packages))
            for dst_unit in targets - {src_unit}:
                if dst_unit in graph.units:
                    graph.edges[(src_unit, dst_unit)] += 1
    return graph


# --- drawing -------------------------------------------------------------------------------------------------
_LINE = 13.0                   # points per text line of the left panel (9 pt text, line spacing 1.1, margins)
_BOXES_PER_LINE = 4
_CHARS_PER_WIDTH = 150         # characters of 9 pt text across the left panel
_COLOURS = ["#e8eefa", "#e8eefa", "#e8eefa", "#e6f5e9", "#fdf3dc", "#f0e8f8", "#fbe9e9", "#eeeeee"]


def draw(graph: Graph, out: Path) -> Path:
    """Write the two-panel PNG; returns ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import LogNorm
    from matplotlib.patches import FancyBboxPatch

    units = graph.ordered_units()
    n_layers = len(graph.layers)
    rows = [[u for u in units if graph.layer_of(u) == -1]] + [[u for u in units if graph.layer_of(u) == i]
                                                              for i in range(n_layers)]
    titles = [f"{PACKAGE} (package root: the public names)"] + [f"layer {i + 1}: " + " | ".join(layer)
                                                               for i, layer in enumerate(graph.layers)]
    # the left panel's layout in text lines (one line = _LINE points), so the figure's height follows the tree
    bands = []                       # per band: [(units of one line of boxes, wrapped module lists, height)]
    for row in rows:
        n_lines = max(1, -(-len(row) // _BOXES_PER_LINE))
        per_line = -(-len(row) // n_lines) if row else 1
        lines = []
        for k in range(0, max(len(row), 1), per_line):
            chunk = row[k:k + per_line]
            chars = max(16, int(_CHARS_PER_WIDTH / per_line))
            wrapped = [textwrap.wrap(" · ".join(graph.units[u]), chars) for u in chunk]
            lines.append((chunk, wrapped, per_line, 1.5 + max((len(w) for w in wrapped), default=0) + 0.4))
        bands.append(lines)
    heights = [1.7 + sum(h + 0.35 for *_, h in lines) + 0.2 for lines in bands]
    total = sum(heights) + 0.4 * len(bands) + 2.5
    fig_h = max(total * _LINE / 72 / 0.94, 9.0)
    fig = plt.figure(figsize=(26, fig_h), dpi=100)
    left = fig.add_axes([0.01, 0.02, 0.47, 0.94])
    right = fig.add_axes([0.585, 0.22, 0.40, 0.68])
    fig.suptitle(f"{PACKAGE}: layers (import-linter contract in pyproject.toml) and the imports between subpackages, "
                 "read from the code by docs/make_architecture.py", fontsize=16, fontweight="bold", y=0.995)
    left.set_xlim(0, 1)
    left.set_ylim(0, total)
    left.axis("off")
    y = total - 0.4
    for r, (lines, title, h) in enumerate(zip(bands, titles, heights)):
        y -= h
        colour = _COLOURS[(r - 1) % len(_COLOURS)] if r else "#ffffff"
        left.add_patch(FancyBboxPatch((0.003, y), 0.994, h, boxstyle="square,pad=0", facecolor=colour, edgecolor="#8899bb", linewidth=1.2))
        left.text(0.012, y + h - 0.35, title, fontsize=12, fontweight="bold", va="top", ha="left")
        top = y + h - 1.7
        for chunk, wrapped, per_line, box_h in lines:
            width = 0.976 / per_line
            for j, (unit, body) in enumerate(zip(chunk, wrapped)):
                x0 = 0.012 + j * width
                left.add_patch(FancyBboxPatch((x0, top - box_h), width - 0.008, box_h,
                                              boxstyle="square,pad=0",
                                              facecolor="white", edgecolor="#555555", linewidth=0.9))
                name = graph.label(unit)
                left.text(x0 + 0.006, top - 0.3, name, fontsize=10.5, fontweight="bold", va="top", ha="left",
                          family="monospace")
                if body:
                    left.text(x0 + 0.006, top - 1.45, "\n".join(body), fontsize=9, va="top", ha="left",
                              linespacing=1.1, color="#333333")
            top -= box_h + 0.35
        y -= 0.4
    left.text(0.0, 0.6, "Each band is a layer of the contract, top to bottom: a layer imports only the layers below "
              "it. Each box is a subpackage (or a top-level module) and lists its modules.",
              fontsize=10.5, va="bottom", ha="left")

    # right: the import matrix, row imports column, counts of import statements
    import numpy as np

    index = {u: i for i, u in enumerate(units)}
    m = np.zeros((len(units), len(units)))
    for (a, b), n in graph.edges.items():
        m[index[a], index[b]] = n
    shown = np.ma.masked_equal(m, 0)
    right.imshow(shown, cmap="Blues", norm=LogNorm(vmin=1, vmax=max(m.max(), 2)), aspect="equal")
    layer_of = [graph.layer_of(u) for u in units]
    for (a, b), n in graph.edges.items():
        i, j = index[a], index[b]
        up = graph.layer_of(a) > graph.layer_of(b) >= 0
        right.text(j, i, str(n), ha="center", va="center", fontsize=7,
                   color="white" if n >= 8 and not up else ("#cc0000" if up else "black"),
                   fontweight="bold" if up else "normal")
        if up:
            right.add_patch(plt.Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, edgecolor="#cc0000", linewidth=2))
    for k in range(1, len(units)):
        if layer_of[k] != layer_of[k - 1]:
            right.axhline(k - 0.5, color="#888888", linewidth=0.8)
            right.axvline(k - 0.5, color="#888888", linewidth=0.8)
    start = 0
    for k in range(1, len(units) + 1):                      # the diagonal block of each layer
        if k == len(units) or layer_of[k] != layer_of[start]:
            right.add_patch(plt.Rectangle((start - 0.5, start - 0.5), k - start, k - start, fill=False,
                                          edgecolor="#444444", linewidth=1.4))
            start = k
    labels = [graph.label(u).rstrip("/").removesuffix(".py") if u != PACKAGE else PACKAGE for u in units]
    right.set_xticks(range(len(units)), labels, rotation=60, ha="right", fontsize=9, family="monospace")
    right.set_yticks(range(len(units)), labels, fontsize=9, family="monospace")
    right.tick_params(length=0)
    right.set_title("imports between subpackages: row imports column (import statements, lazy ones included)",
                    fontsize=11.5, pad=10)
    ups = graph.upward()
    verdict = (f"{len(ups)} upward import(s), in red: lint-imports would refuse them" if ups else
               "every import lies right of / above the diagonal blocks: all point down the layers, none up")
    right.text(0.5, -0.30, verdict + f"  ·  {len(units)} subpackages, {sum(graph.edges.values())} import statements",
               transform=right.transAxes, ha="center", va="top", fontsize=10.5,
               color="#cc0000" if ups else "#225522")

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    description = "subpackages: " + " ".join(units)
    fig.savefig(out, metadata={"Title": f"{PACKAGE} architecture", "Description": description})
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "architecture.png")
    parser.add_argument("--src", type=Path, default=ROOT / "python" / PACKAGE, help="the package folder")
    parser.add_argument("--pyproject", type=Path, default=ROOT / "pyproject.toml")
    args = parser.parse_args(argv)
    graph = build_graph(args.src, args.pyproject)
    path = draw(graph, args.out)
    print(f"wrote {path}: {len(graph.units)} subpackages, {sum(graph.edges.values())} imports between them, "
          f"{len(graph.upward())} upward")
    return 0


if __name__ == "__main__":
    sys.exit(main())
