"""The documents: every section citation names a heading that exists, no file points outside the repository, and
every link in the Markdown to a file of the repository (relative, or the README's absolute ones, which PyPI shows)
leads to a file (and heading) that exists. Also the import-graph script."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SKIPPED = ("tests/data/", "benchmarks/results/")  # recorded data and measurements, kept as they were made
SIGN = "\u00a7"  # the section sign, spelled out so that this file cites nothing itself
NUMBER = r"\d+(?:\.\d+)?"
CITATION = re.compile(rf"docs/([\w-]+)\.md {SIGN}({NUMBER})(?:-{SIGN}({NUMBER}))?")
SECTION = re.compile(rf"{SIGN}({NUMBER})(?:-{SIGN}({NUMBER}))?")
NUMBERED_HEADING = re.compile(rf"^#{{2,3}} ({NUMBER})\.? ")
SELF_CITING = ("docs/model.md", "docs/training.md")  # where a bare section number means the file itself
# References to files that live outside the repository (the patterns are written so they do not match themselves).
OUTSIDE = (
    re.compile(r"\.\./shared\b"),
    re.compile(r"/work/(?:shared|notes)\b"),
    re.compile(r"(?<![\w/.-])(?:MODEL|TRAINING|STYLE|GPU|HELPERS)\.md\b"),
)
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)|(?:src|href)=\"([^\"]+)\"")
SCHEME = re.compile(r"^(?:[a-zA-Z][a-zA-Z0-9+.-]*:|//)")
REPOSITORY = "https://github.com/mlx-locate/mlx-locate"  # pyproject's [project.urls] Repository
# An absolute link to a file of the repository (pages and raw files, as the README on PyPI needs them): its path.
IN_REPOSITORY = re.compile(
    rf"^(?:{re.escape(REPOSITORY)}/(?:blob|tree|raw)/main/|https://raw\.githubusercontent\.com/mlx-locate/mlx-locate/main/)"
)


def tracked(root: Path) -> list[str]:
    """The repository's files (tracked by git; every file when `root` is no git checkout), minus SKIPPED."""
    try:
        out = subprocess.run(["git", "-C", str(root), "ls-files"], check=True, capture_output=True, text=True)
        names = out.stdout.splitlines() if (root / ".git").exists() else []
    except (OSError, subprocess.CalledProcessError):
        names = []
    if not names:
        names = [p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() and ".git" not in p.parts]
    return sorted(n for n in names if not n.startswith(SKIPPED) and (root / n).is_file())


def text(path: Path) -> str | None:
    """The file's text, or None for a binary file."""
    data = path.read_bytes()
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def headings(path: Path) -> list[str]:
    """The titles of a Markdown file's headings, outside code blocks."""
    out, fence = [], False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("```"):
            fence = not fence
        elif not fence and re.match(r"^#{1,6} ", line):
            out.append(line.lstrip("#").strip())
    return out


def section_numbers(path: Path) -> set[str]:
    """Section numbers of `## N. Title` and `### N.M Title` headings."""
    return {m.group(1) for t in headings(path) if (m := NUMBERED_HEADING.match("## " + t))}


def anchor(title: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


def bad_citations(root: Path) -> list[str]:
    """Citations in .py and .md files that lead nowhere: `docs/<name>.md <sign>N[-<sign>M]` must name an existing
    document and headings of it; a bare section number is allowed only inside docs/model.md and docs/training.md
    (where it means the file itself)."""
    problems, numbers = [], {}

    def check(name: str, line: int, doc: str, *sections: str | None) -> None:
        path = root / doc
        if doc not in numbers:
            numbers[doc] = section_numbers(path) if path.is_file() else None
        if numbers[doc] is None:
            problems.append(f"{name}:{line}: cites {doc}, which does not exist")
            return
        for s in sections:
            if s is not None and s not in numbers[doc]:
                problems.append(f"{name}:{line}: {doc} has no section {SIGN}{s}")

    for name in tracked(root):
        if not name.endswith((".py", ".md")) or (content := text(root / name)) is None:
            continue
        for n, line in enumerate(content.splitlines(), 1):
            if SIGN not in line:
                continue
            spans = []
            for m in CITATION.finditer(line):
                spans.append((m.start(), m.end()))
                check(name, n, f"docs/{m.group(1)}.md", m.group(2), m.group(3))
            for m in SECTION.finditer(line):
                if any(a <= m.start() < b for a, b in spans):
                    continue
                if name in SELF_CITING:
                    check(name, n, name, m.group(1), m.group(2))
                else:
                    problems.append(f"{name}:{n}: bare {m.group(0)}; write docs/model.md {m.group(0)} (or training.md)")
    return problems


def outside_references(root: Path) -> list[str]:
    """Text files that name a path outside the repository."""
    problems = []
    for name in tracked(root):
        if (content := text(root / name)) is None:
            continue
        for n, line in enumerate(content.splitlines(), 1):
            for pattern in OUTSIDE:
                for m in pattern.finditer(line):
                    problems.append(f"{name}:{n}: {m.group(0)!r} is outside the repository")
    return problems


def links(path: Path) -> list[tuple[int, str]]:
    """(line, target) of every link and image of a Markdown file, outside code."""
    out, fence = [], False
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.lstrip().startswith("```"):
            fence = not fence
        if not fence:
            out += [(n, m.group(1) or m.group(2)) for m in LINK.finditer(re.sub(r"`[^`]*`", "", line))]
    return out


def bad_links(root: Path) -> list[str]:
    """Links and images in the Markdown files to the repository's files (relative, or absolute to REPOSITORY)
    whose file, or heading anchor, does not exist."""
    problems, anchors = [], {}
    for name in tracked(root):
        if not name.endswith(".md"):
            continue
        for n, target in links(root / name):
            absolute = IN_REPOSITORY.match(target)
            if SCHEME.match(target) and not absolute:
                continue
            file, _, fragment = target[absolute.end() if absolute else 0 :].partition("#")
            path = (root if absolute else (root / name).parent) / file if file else root / name
            if not path.exists() or not path.resolve().is_relative_to(root.resolve()):
                problems.append(f"{name}:{n}: link to {target}: no such file in the repository")
                continue
            if fragment and path.suffix == ".md":
                key = path.resolve()
                if key not in anchors:
                    anchors[key] = {anchor(t) for t in headings(path)}
                if fragment not in anchors[key]:
                    problems.append(f"{name}:{n}: link to {target}: {os.path.relpath(path, root)} has no such heading")
    return problems


def relative_links(path: Path) -> list[str]:
    """Links of a file shown outside the repository (the README, on PyPI) that only work inside it."""
    return [f"{path.name}:{n}: {t}" for n, t in links(path) if not SCHEME.match(t) and not t.startswith("#")]


def test_citations_resolve():
    assert bad_citations(ROOT) == []


def test_no_file_points_outside_the_repository():
    assert outside_references(ROOT) == []


def test_links_lead_to_files_and_headings():
    assert bad_links(ROOT) == []


def test_the_readme_links_absolutely_to_the_repository_in_pyproject():
    """PyPI shows the README without the repository around it: links and images absolute (anchors stay)."""
    assert relative_links(ROOT / "README.md") == []
    assert f'Repository = "{REPOSITORY}"' in (ROOT / "pyproject.toml").read_text()


def test_each_check_finds_what_it_guards(tmp_path):
    """Every check reports a broken sample of its kind, and only the broken ones."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs/model.md").write_text(f"# M\n\n## 1. One\n\n### 1.2 Sub part\n\nsee {SIGN}1 and {SIGN}9\n")
    (tmp_path / "code.py").write_text(
        f'"""docs/model.md {SIGN}1.2 and docs/model.md {SIGN}1-{SIGN}1.2, docs/model.md {SIGN}3, '
        f'docs/other.md {SIGN}1, {SIGN}1, docs/model.md {SIGN}1-{SIGN}4."""\n'
    )
    shared = "../" + "shared/docs/X.md"
    work = "/" + "work/" + "shared/docs"
    upper = "TRAIN" + "ING.md"
    (tmp_path / "notes.txt").write_text(f"{shared}\n{work}\nsee {upper}\nupstream document/{upper} is fine\n")
    (tmp_path / "README.md").write_text(
        "[a](docs/model.md#12-sub-part) [b](docs/missing.md) [c](docs/model.md#nope) [d](https://example.com)\n"
        '![e](docs/model.md) <img src="img.png"> [f](#g) [h](../outside.md) `[i](not/a/link.md)`\n\n## G\n'
        f"[j]({REPOSITORY}/blob/main/docs/model.md#12-sub-part) [k]({REPOSITORY}/blob/main/docs/gone.md) "
        "![l](https://raw.githubusercontent.com/mlx-locate/mlx-locate/main/img.png)\n"
    )
    assert [p.split(": ", 1)[1] for p in bad_citations(tmp_path)] == [
        f"docs/model.md has no section {SIGN}3",
        "cites docs/other.md, which does not exist",
        f"docs/model.md has no section {SIGN}4",
        f"bare {SIGN}1; write docs/model.md {SIGN}1 (or training.md)",
        f"docs/model.md has no section {SIGN}9",
    ]
    assert [p.split(": ", 1)[0] for p in outside_references(tmp_path)] == ["notes.txt:1", "notes.txt:2", "notes.txt:3"]
    assert [p.split(": ", 1)[1] for p in bad_links(tmp_path)] == [
        "link to docs/missing.md: no such file in the repository",
        "link to docs/model.md#nope: docs/model.md has no such heading",
        "link to img.png: no such file in the repository",
        "link to ../outside.md: no such file in the repository",
        f"link to {REPOSITORY}/blob/main/docs/gone.md: no such file in the repository",
        "link to https://raw.githubusercontent.com/mlx-locate/mlx-locate/main/img.png: no such file in the repository",
    ]
    assert relative_links(tmp_path / "README.md") == [
        "README.md:1: docs/model.md#12-sub-part",
        "README.md:1: docs/missing.md",
        "README.md:1: docs/model.md#nope",
        "README.md:2: docs/model.md",
        "README.md:2: img.png",
        "README.md:2: ../outside.md",
    ]


def load_import_graph():
    spec = importlib.util.spec_from_file_location("import_graph", ROOT / "docs/import_graph.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_import_graph_finds_circles_and_upward_imports(tmp_path):
    """On a small package: relative, absolute, lazy and TYPE_CHECKING imports; a circle; an upward import."""
    ig = load_import_graph()
    pkg = tmp_path / "mlx_locate"
    (pkg / "tuner").mkdir(parents=True)
    files = {
        "__init__.py": "from .locate import load\n",
        "tokens.py": "",
        "engine.py": "from typing import TYPE_CHECKING\n\nfrom . import tokens\n\nif TYPE_CHECKING:\n"
        "    from .locate import X\n",
        "locate.py": "import mlx_locate.engine\n\ndef f():\n    from .tuner.lora import A\n",
        "tuner/__init__.py": "",
        "tuner/lora.py": "from ..tokens import T\nfrom .. import engine\n",
    }
    for name, source in files.items():
        (pkg / name).write_text(source)
    floors = (("low", ("tokens",), False), ("mid", ("engine", "locate", "__init__"), False), ("top", ("tuner",), False))
    g = ig.analyse(pkg, floors)
    assert {(i.source, i.target, i.mark) for i in g.imports} == {
        ("__init__", "locate", ""),
        ("engine", "tokens", ""),
        ("engine", "locate", "+"),
        ("locate", "engine", ""),
        ("locate", "tuner.lora", "*"),
        ("tuner.lora", "tokens", ""),
        ("tuner.lora", "engine", ""),
    }
    assert g.circles == [["engine", "locate", "tuner.lora"]]
    assert [(i.source, i.target) for i in g.up] == [("locate", "tuner.lora")]
    assert g.unplaced == []


def test_import_graph_runs_on_the_package():
    """The package's own graph passes `--check`: no circles, no import up a floor."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "docs/import_graph.py"), "--check"], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout[out.stdout.find("Circles:") :] + out.stderr
    assert out.stdout.startswith("mlx_locate: ") and "\nCircles: " in out.stdout
    assert "on no floor" not in out.stdout, "a module is on no floor: add it to docs/import_graph.py's FLOORS"
