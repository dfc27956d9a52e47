"""The package's import graph, read from the code (every ``import`` and ``from ... import`` of every module of ltcx,
deferred ones inside functions included, and the packages each import runs): no cycle, not even through a package's
``__init__``, and the layers point one way (docs/architecture.md)."""

import ast
from pathlib import Path

import pytest

from helpers import ROOT


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def packages_above(module: str) -> list[str]:
    """``a.b.c`` -> ``["a", "a.b"]``: the packages Python imports (runs the ``__init__`` of) before ``a.b.c``."""
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def imported_modules(path: Path, modules: set[str], root: Path = ROOT) -> set[str]:
    """The modules of ``modules`` that ``path`` imports anywhere in its code (``from ltcx.x import y`` is ``ltcx.x.y``
    when that is a module, else ``ltcx.x``), with the packages above each: importing ``ltcx.cli.study`` runs
    ``ltcx/cli/__init__.py`` too. The packages above ``path`` itself count only when ``path`` names them: Python runs
    their ``__init__`` before ``path`` whatever ``path`` imports, so an implied edge to them would tie every package
    that imports its own modules (``ltcx.cli`` dispatching to ``ltcx.cli.study``) in a cycle with each of them, but a
    module importing from its own package's ``__init__`` while that ``__init__`` imports it is a cycle."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    own = set(packages_above(name))
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
            found |= {target} | (set(packages_above(target)) - own)
    return found - {name, ""}


def import_graph(root: Path = ROOT, package: str = "ltcx") -> dict[str, set[str]]:
    """``{module: the modules it imports}`` of every module of ``root/package``."""
    paths = sorted((root / package).rglob("*.py"))
    modules = {module_name(path, root) for path in paths}
    return {module_name(path, root): imported_modules(path, modules, root) for path in paths}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path ``[a, b, ..., a]``, or None. Every edge counts, a package's to its own
    modules included: ``ltcx/cli/__init__.py`` running ``ltcx.cli.study`` is as much an import as any."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
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
    ("ltcx.study", "ltcx.cli"), ("ltcx.runtime", "ltcx.cli"), ("ltcx.runtime", "ltcx.study"),  # only cli -> study
])
def test_a_lower_layer_never_imports_an_upper_one(lower, upper):
    graph = import_graph()
    offenders = sorted(f"{a} imports {b}" for a, bs in graph.items() if a == lower or a.startswith(lower + ".")
                       for b in bs if b == upper or b.startswith(upper + "."))
    assert not offenders, offenders


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def write_package(root: Path, files: dict[str, str]) -> None:
    for name, code in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(code)


def test_a_cycle_through_a_package_init_is_found(tmp_path):
    """The cli <-> study cycle as it was: ``cli/__init__`` runs ``cli.study`` (inside ``main``), which imports the
    study's runner, which imports ``cli.test_metrics`` and so runs ``cli/__init__`` again. No module names
    ``pkg.cli`` itself: the edge back is the package Python imports before ``cli.test_metrics``."""
    write_package(tmp_path / "pkg", {
        "__init__.py": "",
        "cli/__init__.py": "def main():\n    from pkg.cli.study import study_main\n    study_main()\n",
        "cli/study.py": "from pkg.cli.options import parser\n\ndef study_main():\n    import pkg.study.runner\n",
        "cli/options.py": "parser = None\n",
        "cli/test_metrics.py": "TEST_METRICS = 'test_metrics.json'\n",
        "study/__init__.py": "",
        "study/runner.py": "from pkg.cli.test_metrics import TEST_METRICS\n",
    })
    graph = import_graph(tmp_path, "pkg")
    assert "pkg.cli" in graph["pkg.study.runner"]  # the package above the module it names
    assert "pkg.cli" not in graph["pkg.cli.study"]  # its own package: imported before it whatever it imports
    assert find_cycle(graph) == ["pkg.cli", "pkg.cli.study", "pkg.study.runner", "pkg.cli"]
    (tmp_path / "pkg/study/runner.py").write_text("from pkg.runtime import TEST_METRICS\n")  # the shared leaf
    (tmp_path / "pkg/runtime.py").write_text("TEST_METRICS = 'test_metrics.json'\n")
    assert find_cycle(import_graph(tmp_path, "pkg")) is None

