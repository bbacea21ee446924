"""No import cycles among the project's modules.

Every import counts, wherever it is written: at module level, under ``if TYPE_CHECKING:`` and inside
functions (a lazy import is still a dependency). A package's ``__init__`` counts as its own module;
importing a submodule does not count as importing its package.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("pipeline", "statemachines", "kernels")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}


def imports_of(path: Path, known: set[str]) -> set[str]:
    """The project modules that ``path`` imports (``from a.b import c`` is ``a.b.c`` when that is a
    module, else ``a.b``)."""
    found: set[str] = set()
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in known)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                full = f"{base}.{alias.name}"
                if full in known:
                    found.add(full)
                elif base in known:
                    found.add(base)
    found.discard(module_name(path))
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                item = stack.pop()
                on_stack.discard(item)
                component.append(item)
                if item == node:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return out


def test_no_import_cycles():
    modules = project_modules()
    graph = {name: imports_of(path, set(modules)) for name, path in modules.items()}
    assert cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_every_match_ends_with_a_wildcard_that_raises():
    """A ``match`` on messages or commands never drops an unknown one silently."""
    for name, path in project_modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Match):
                continue
            last = node.cases[-1]
            wildcard = (
                isinstance(last.pattern, ast.MatchAs) and last.pattern.pattern is None and last.guard is None
            )
            raises = any(isinstance(n, ast.Raise) for stmt in last.body for n in ast.walk(stmt))
            assert wildcard and raises, f"{name}:{node.lineno}: match without a raising `case _:`"
