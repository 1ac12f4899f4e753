"""The house's size rules (docs/architecture.md, "Rooms"): rooms small enough to read, the mode names in one place,
a top level that lists the runtime's rooms."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from mlx_locate.decide import Mode

PACKAGE = Path(__file__).resolve().parents[1] / "mlx_locate"
MAX_LINES = 700
MAX_METHODS = 25
MAX_TOP_LEVEL = 32
MODES = re.compile(r"""["']slow["']\s*,\s*["']fast["']\s*,\s*["']hybrid["']""")


def sources() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def test_no_module_is_longer_than_the_limit():
    long = {str(p.relative_to(PACKAGE)): n for p in sources() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_no_class_has_more_methods_than_the_limit():
    big = {}
    for path in sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                methods = [n for n in node.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
                if len(methods) > MAX_METHODS:
                    big[f"{path.relative_to(PACKAGE)}:{node.name}"] = len(methods)
    assert not big, f"classes over {MAX_METHODS} methods: {big}"


def test_the_top_level_holds_at_most_the_limit_of_modules():
    modules = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(modules) <= MAX_TOP_LEVEL, f"{len(modules)} modules at the top level: {modules}"


def test_the_three_mode_names_are_spelled_together_only_in_the_mode_enum():
    places = [str(p.relative_to(PACKAGE)) for p in sources() for _ in MODES.finditer(p.read_text())]
    assert places == [], f"the mode names spelled together outside decide.Mode: {places}"
    assert [m.value for m in Mode] == ["slow", "fast", "hybrid"]
    assert MODES.search('("slow", "fast", "hybrid")') and not MODES.search("tuple(m.value for m in Mode)")
