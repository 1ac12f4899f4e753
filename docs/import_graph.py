"""The import graph of the `mlx_locate` package, read from its source: who imports whom, circles, imports that run
up a floor.

    python docs/import_graph.py            # print the graph (docs/architecture.md holds a copy)
    python docs/import_graph.py --check    # also exit 1 unless there are no circles and no upward imports

Every import of a package module counts: at module level, inside a function (lazy, marked `*`) and under
`if TYPE_CHECKING:` (marked `+`). A circle is a set of modules that reach each other through imports (a strongly
connected component of more than one module). `FLOORS` orders the package from the bottom up, as the data flows;
an import should point to a module on its own floor or a lower one. The command modules form a flat floor: they
should not import each other either.
"""

from __future__ import annotations

import argparse
import ast
import sys
from dataclasses import dataclass
from pathlib import Path

PACKAGE = "mlx_locate"
# (floor, its modules or subpackages, flat: whether its members may import each other), lowest first.
FLOORS: tuple[tuple[str, tuple[str, ...], bool], ...] = (
    ("definitions", ("config", "tokens", "jsonl"), False),
    ("host-side data", ("tokenizer", "preprocess", "prompts", "parse", "metrics", "draw", "synthetic"), False),
    ("network and its cache", ("masks", "cache", "network"), False),
    ("memory", ("memory",), False),
    ("weights", ("weights",), False),
    ("decoding", ("compiled", "label_trie", "sampling", "decide", "row_decoder"), False),
    ("requests", ("request", "runtime", "tune", "vision_ahead", "tiles", "categories", "admission", "engine"), False),
    ("API", ("locate", "__init__"), False),
    ("shared by the commands", ("commands.flags", "commands.folders", "commands.exports", "evaluation"), False),
    ("training", ("tuner",), False),
    (
        "commands and servers",
        (
            "commands.locate",
            "commands.batch",
            "commands.cluster",
            "commands.video",
            "commands.convert",
            "commands.finetune",
            "commands.evaluate",
            "commands.bench",
            "server",
        ),
        True,
    ),
    ("the README's `python -m mlx_locate.generate`", ("generate", "commands"), False),
)
MAX_UP = 0  # --check: the most upward imports allowed


@dataclass(frozen=True)
class Import:
    source: str  # importing module, dotted, relative to the package ("tuner.trainer"; the package itself "__init__")
    target: str
    lazy: bool  # inside a function
    typing: bool  # under `if TYPE_CHECKING:`

    @property
    def mark(self) -> str:
        return ("*" if self.lazy else "") + ("+" if self.typing else "")


def module_names(package_dir: Path) -> dict[str, Path]:
    """Dotted module name (relative to the package) -> file, for every .py file under `package_dir`."""
    names = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(package_dir).with_suffix("").parts)
        if parts[-1] == "__init__" and len(parts) > 1:
            parts.pop()
        names[".".join(parts)] = path
    return names


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_of(name: str, path: Path, modules: set[str], package: str = PACKAGE) -> list[Import]:
    """The package-internal imports of module `name` (file `path`), relative ones included."""
    is_package = path.name == "__init__.py"
    own_package = [] if name == "__init__" else name.split(".") if is_package else name.split(".")[:-1]
    found: list[Import] = []

    def resolve(dotted: list[str]) -> str | None:
        """The module a dotted path inside the package names (its longest existing prefix), or None."""
        for k in range(len(dotted), 0, -1):
            candidate = ".".join(dotted[:k])
            if candidate in modules:
                return candidate
        return "__init__" if "__init__" in modules else None

    def visit(node: ast.AST, lazy: bool, typing: bool) -> None:
        targets: list[str] = []
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == package:
                    targets.append(resolve(parts[1:]) if len(parts) > 1 else "__init__")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                keep = len(own_package) - (node.level - 1)
                if keep < 0:
                    raise ValueError(f"{path}: relative import beyond the package: {ast.unparse(node)}")
                base = own_package[:keep] + (node.module.split(".") if node.module else [])
            elif node.module and node.module.split(".")[0] == package:
                base = node.module.split(".")[1:]
            else:
                base = None
            if base is not None:
                for alias in node.names:
                    # `from .x import y` imports module x.y when there is one, else (a name of) x.
                    full = ".".join([*base, alias.name])
                    targets.append(full if full in modules else resolve(base) if base else "__init__")
        for target in targets:
            if target is not None and target != name:
                found.append(Import(name, target, lazy, typing))
        for child in ast.iter_child_nodes(node):
            inner = lazy or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            guarded = typing or (isinstance(node, ast.If) and _is_type_checking(node.test) and child in node.body)
            visit(child, inner, guarded)

    visit(ast.parse(path.read_text(encoding="utf-8"), str(path)), False, False)
    return sorted(set(found), key=lambda i: (i.target, i.lazy, i.typing))


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node, each sorted (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        component.append(top)
                        if top == node:
                            break
                    if len(component) > 1:
                        out.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = counter
                counter += 1
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph.get(child, ())))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return sorted(out)


def floor_of(module: str, floors=FLOORS) -> tuple[int, str] | None:
    """(floor number, the member it falls under) of a module, or None when no floor lists it."""
    for number, (_, members, _) in enumerate(floors):
        for member in members:
            if module == member or module.startswith(member + "."):
                return number, member
    return None


@dataclass(frozen=True)
class Graph:
    modules: list[str]
    imports: list[Import]
    circles: list[list[str]]
    up: list[Import]  # imports from a lower floor to a higher one
    sideways: list[Import]  # imports between different members of a flat floor
    unplaced: list[str]  # modules on no floor


def analyse(package_dir: Path, floors=FLOORS, package: str = PACKAGE) -> Graph:
    paths = module_names(package_dir)
    imports = [i for name, path in paths.items() for i in imports_of(name, path, set(paths), package)]
    graph = {name: set() for name in paths}
    for i in imports:
        graph[i.source].add(i.target)
    up, sideways = [], []
    for i in imports:
        a, b = floor_of(i.source, floors), floor_of(i.target, floors)
        if a is None or b is None:
            continue
        if b[0] > a[0]:
            up.append(i)
        elif a[0] == b[0] and floors[a[0]][2] and a[1] != b[1]:
            sideways.append(i)
    unplaced = [m for m in paths if floor_of(m, floors) is None]
    return Graph(sorted(paths), imports, circles(graph), up, sideways, unplaced)


def report(g: Graph, floors=FLOORS, package: str = PACKAGE) -> str:
    lazy = sum(i.lazy for i in g.imports)
    typing = sum(i.typing for i in g.imports)
    lines = [
        f"{package}: {len(g.modules)} modules, {len(g.imports)} imports of package modules "
        f"({lazy} lazy *, {typing} under TYPE_CHECKING +)",
        "",
        "Floors, lowest first:",
    ]
    for number, (title, members, flat) in enumerate(floors, 1):
        present = [m for m in members if any(x == m or x.startswith(m + ".") for x in g.modules)]
        lines.append(f"  {number:2d} {title}{' (flat)' if flat else ''}: {', '.join(present) or '-'}")
    if g.unplaced:
        lines.append(f"  on no floor: {', '.join(g.unplaced)}")
    lines += ["", "Imports (module: the package modules it imports):"]
    for module in g.modules:
        targets = [i.target + i.mark for i in g.imports if i.source == module]
        if targets:
            lines.append(f"  {module}: {', '.join(targets)}")
    lines += ["", f"Circles: {len(g.circles)}"]
    lines += [f"  {' <-> '.join(c)}" for c in g.circles]
    lines += ["", f"Imports that run up a floor: {len(g.up)}"]
    for i in g.up:
        a, b = floor_of(i.source, floors)[0], floor_of(i.target, floors)[0]
        lines.append(f"  {i.source} ({floors[a][0]}) -> {i.target}{i.mark} ({floors[b][0]})")
    lines += ["", f"Imports between commands: {len(g.sideways)}"]
    lines += [f"  {i.source} -> {i.target}{i.mark}" for i in g.sideways]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--package-dir", type=Path, default=Path(__file__).resolve().parents[1] / PACKAGE, help="the package's folder"
    )
    p.add_argument("--check", action="store_true", help=f"exit 1 unless 0 circles and at most {MAX_UP} upward imports")
    args = p.parse_args(argv)
    if not (args.package_dir / "__init__.py").is_file():
        print(f"error: {args.package_dir} is not a Python package (no __init__.py)", file=sys.stderr)
        return 2
    g = analyse(args.package_dir)
    print(report(g))
    if args.check and (g.circles or len(g.up) > MAX_UP):
        print(f"\ncheck failed: {len(g.circles)} circles (want 0), {len(g.up)} upward imports (want <= {MAX_UP})")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
