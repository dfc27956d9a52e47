"""The package's import graph, read from the code (every ``import`` and ``from ... import`` of every module of ltcx,
deferred ones inside functions included): no cycle, and the layers point one way (docs/architecture.md)."""

import ast
from pathlib import Path

import pytest

from helpers import ROOT

PACKAGE = ROOT / "ltcx"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, modules: set[str]) -> set[str]:
    """The ltcx modules ``path`` imports anywhere in its code (``from ltcx.x import y`` is ``ltcx.x.y`` when that is
    a module, else ``ltcx.x``)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # ltcx.x.y.attr -> ltcx.x.y
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(path) for path in paths}
    return {module_name(path): imported_modules(path, modules) for path in paths}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path ``[a, b, ..., a]``, or None. A package's ``__init__`` importing its own
    submodules (to re-export them) is not a cycle of the layers: such edges from a package to what lies inside it are
    left out."""
    edges = {a: {b for b in bs if not b.startswith(a + ".")} for a, bs in graph.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_graph_sees_deferred_imports():
    graph = import_graph()
    assert "ltcx.cli.lightning" in graph["ltcx.cli"]  # imported inside main(), when a Lightning command runs


def test_no_import_cycle_inside_ltcx():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


@pytest.mark.parametrize("lower,upper", [
    ("ltcx.persist", "ltcx.lm"), ("ltcx.models", "ltcx.lm"), ("ltcx.ops", "ltcx.models"), ("ltcx.models", "ltcx.cli"),
    ("ltcx.data", "ltcx.lm"), ("ltcx.ops", "ltcx.lm"),
])
def test_a_lower_layer_never_imports_an_upper_one(lower, upper):
    graph = import_graph()
    offenders = sorted(f"{a} imports {b}" for a, bs in graph.items() if a == lower or a.startswith(lower + ".")
                       for b in bs if b == upper or b.startswith(upper + "."))
    assert not offenders, offenders


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
