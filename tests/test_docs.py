"""The docs stay true to the tree: the README's length and first-screen commands, every relative link,
the spec sections the code cites, and the architecture picture's script (CPU, no GPU, no network)."""
from __future__ import annotations

import re
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAIN_JOB = "pip install torch==2.13.0 && pip install -e . && macattn generate"
TESTS = 'pip install torch==2.13.0 && pip install -e ".[test]" && lint-imports && python3 -m pytest -q'


def _markdown_files() -> list[Path]:
    files = [README, ROOT / "benchmarks" / "README.md", ROOT / "benchmarks" / "NOTES.md",
             ROOT / "benchmarks" / "results" / "README.md", ROOT / "training" / "DATA.md"]
    files += sorted((ROOT / "docs").glob("*.md")) + sorted((ROOT / "benchmarks" / "notes").glob("*.md"))
    return [f for f in files if f.exists()]


def _prose(text: str) -> str:
    """``text`` without fenced / indented code blocks and inline code spans (links there are not links)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    text = "\n".join(line for line in text.splitlines() if not line.startswith("    "))
    return re.sub(r"`[^`\n]*`", "", text)


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    heading = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", heading).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    return {_slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", path.read_text(), flags=re.M)}


def test_readme_is_short():
    lines = README.read_text().splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines; the limit is 150 (move detail to docs/)"


def test_readme_first_screen_holds_the_two_setup_commands():
    first_screen = README.read_text().splitlines()[:25]
    assert f"    {MAIN_JOB}" in first_screen
    assert f"    {TESTS}" in first_screen


def test_readme_test_command_is_what_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    # CI spells pip as ``python3 -m pip`` and quiet; otherwise the same commands in the same order
    assert ci.replace("python3 -m pip install -q", "pip install") == TESTS


@pytest.mark.parametrize("path", _markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", _prose(path.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):          # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(target)
    assert not broken, f"{path.relative_to(ROOT)}: links that do not resolve: {broken}"


def _spec_sections() -> set[str]:
    text = (ROOT / "docs" / "spec.md").read_text()
    return set(re.findall(r"^#{2,3} §(\d+(?:\.\d+)?)\b", text, flags=re.M))


def _cited_sections() -> dict[str, set[str]]:
    cited: dict[str, set[str]] = {}
    for base in ("python", "tests", "benchmarks"):
        for f in sorted((ROOT / base).rglob("*.py")):
            for sec in re.findall(r"docs/spec\.md §(\d+(?:\.\d+)?)", f.read_text(errors="replace")):
                cited.setdefault(sec, set()).add(str(f.relative_to(ROOT)))
    for f in _markdown_files():
        for sec in re.findall(r"\[spec §(\d+(?:\.\d+)?)\]\(", f.read_text()):
            cited.setdefault(sec, set()).add(str(f.relative_to(ROOT)))
    return cited


def test_every_cited_spec_section_exists():
    sections = _spec_sections()
    cited = _cited_sections()
    assert cited, "no citation of docs/spec.md found"
    missing = {sec: sorted(files) for sec, files in cited.items() if sec not in sections}
    assert not missing, f"sections cited but not in docs/spec.md: {missing}"


def test_the_code_cites_the_spec_in_the_repository():
    stale = []
    for base in ("python", "tests", "benchmarks"):
        for f in sorted((ROOT / base).rglob("*.py")):
            if f != Path(__file__).resolve() and re.search(r"\bSPEC §", f.read_text(errors="replace")):
                stale.append(str(f.relative_to(ROOT)))
    assert not stale, f"cite docs/spec.md §x.y instead of 'SPEC §x.y' in: {stale}"


def _png_text(path: Path) -> dict[str, str]:
    """The PNG's tEXt / zTXt / iTXt chunks."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    out, i = {}, 8
    while i < len(data):
        (n,) = struct.unpack(">I", data[i:i + 4])
        kind, body = data[i + 4:i + 8], data[i + 8:i + 8 + n]
        if kind == b"tEXt":
            key, _, value = body.partition(b"\0")
            out[key.decode("latin-1")] = value.decode("latin-1")
        elif kind == b"zTXt":
            key, _, value = body.partition(b"\0")
            out[key.decode("latin-1")] = zlib.decompress(value[1:]).decode("latin-1")
        elif kind == b"iTXt":
            key, _, rest = body.partition(b"\0")
            compressed, rest = rest[0], rest[2:]
            _lang, _, rest = rest.partition(b"\0")
            _tkey, _, value = rest.partition(b"\0")
            out[key.decode("latin-1")] = (zlib.decompress(value) if compressed else value).decode("utf-8")
        i += 12 + n
    return out


def _subpackages() -> set[str]:
    pkg = ROOT / "python" / "macattn"
    return {".".join(("macattn",) + p.parent.relative_to(pkg).parts) for p in pkg.rglob("__init__.py")
            if "__pycache__" not in p.parts}


def test_architecture_picture_is_drawn_from_the_code(tmp_path):
    pytest.importorskip("matplotlib", reason="needs matplotlib (pip install -e '.[test]')")
    out = tmp_path / "architecture.png"
    r = subprocess.run([sys.executable, str(ROOT / "docs" / "make_architecture.py"), "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert out.stat().st_size > 50_000
    drawn = set(_png_text(out)["Description"].removeprefix("subpackages: ").split())
    assert _subpackages() <= drawn, f"not in the picture: {sorted(_subpackages() - drawn)}"
    assert "macattn.cli" in drawn


def test_architecture_graph_reads_layers_and_imports():
    sys.path.insert(0, str(ROOT / "docs"))
    try:
        import make_architecture as arch
    finally:
        sys.path.remove(str(ROOT / "docs"))
    graph = arch.build_graph()
    assert ("macattn.runtime", "macattn.builder") in graph.layers
    assert graph.layer_of("macattn.cli") < graph.layer_of("macattn.methods.mac") < graph.layer_of("macattn.core")
    assert graph.edges[("macattn.methods.mac", "macattn.core")] > 0      # MAC uses the match rule and summaries
    assert set(graph.units) >= _subpackages()
