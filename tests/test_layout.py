"""The layout of the package: imports go downwards, no cycles, small modules and functions.

experiments -> train -> lm / model / data -> site / nn (DESIGN.md, "Layout"). Imports are read
from the source (module level and inside functions), so a lazy import cannot hide a cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx
import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "sheafgnn"
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80
# Lower layers never import these (the command line and the experiments sit on top).
UPPER = ("sheafgnn.cli", "sheafgnn.experiments")
LAYERS = {  # module prefix -> prefixes it must not import
    "sheafgnn.nn": ("sheafgnn.model", "sheafgnn.lm", "sheafgnn.train", "sheafgnn.data", "sheafgnn.site", *UPPER),
    "sheafgnn.site": ("sheafgnn.model", "sheafgnn.lm", "sheafgnn.train", "sheafgnn.data", *UPPER),
    "sheafgnn.model": ("sheafgnn.lm", "sheafgnn.train", "sheafgnn.data", *UPPER),
    "sheafgnn.lm": ("sheafgnn.train", *UPPER),
    "sheafgnn.data": ("sheafgnn.train", *UPPER),
    "sheafgnn.train": UPPER,
    "sheafgnn.relations": UPPER,
    "sheafgnn.baselines": ("sheafgnn.model", "sheafgnn.lm", "sheafgnn.train", "sheafgnn.data", *UPPER),
    "sheafgnn.generation": ("sheafgnn",),  # torch only: every model's stream builds on it
    "sheafgnn.optim": ("sheafgnn",),  # torch only: every training loop's optimizer
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The sheafgnn modules ``path`` imports; ``from pkg import sub`` counts as importing ``pkg.sub``."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                out.add(sub if sub in modules else node.module)
    return {name for name in out if name in modules}


def import_graph() -> nx.DiGraph:
    modules = _modules()
    graph = nx.DiGraph()
    for name, path in modules.items():
        graph.add_node(name)
        for target in _imports(path, modules):
            # a package's __init__ re-exporting its own submodules is not an upward import
            if not (path.name == "__init__.py" and target.startswith(name + ".")):
                graph.add_edge(name, target)
    return graph


def test_no_import_cycles():
    cycles = list(nx.simple_cycles(import_graph()))
    assert not cycles, f"import cycles: {cycles}"


@pytest.mark.parametrize("lower", sorted(LAYERS))
def test_imports_go_downwards(lower):
    graph = import_graph()
    bad = [(src, dst) for src, dst in graph.edges
           if (src == lower or src.startswith(lower + ".")) and dst.startswith(LAYERS[lower])]
    assert not bad, f"{lower} imports a higher layer: {bad}"


def test_modules_and_functions_are_small():
    long_modules, long_functions = [], []
    for name, path in _modules().items():
        source = path.read_text()
        if source.count("\n") > MAX_MODULE_LINES:
            long_modules.append((name, source.count("\n")))
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long_functions.append((f"{name}.{node.name}", lines))
    assert not long_modules, f"modules over {MAX_MODULE_LINES} lines: {long_modules}"
    assert not long_functions, f"functions over {MAX_FUNCTION_LINES} lines: {long_functions}"


def test_the_check_sees_a_planted_cycle(tmp_path, monkeypatch):
    """The cycle check is not vacuous: two modules importing each other inside functions are found."""
    package = tmp_path / "sheafgnn"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("def f():\n    from sheafgnn import b\n")
    (package / "b.py").write_text("def g():\n    import sheafgnn.a\n")
    monkeypatch.setitem(globals(), "PACKAGE", package)
    assert [set(c) for c in nx.simple_cycles(import_graph())] == [{"sheafgnn.a", "sheafgnn.b"}]
