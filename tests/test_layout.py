"""The layout of the package: imports go downwards, no cycles, small modules and functions, no module
takes another's private names, and a patch type is one file.

experiments -> train -> lm / model / data -> site / nn (DESIGN.md, "Layout"). Imports are read
from the source (module level and inside functions), so a lazy import cannot hide a cycle.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
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
# Private names that one module still takes from another, each to be made public or moved in its own change.
KNOWN_PRIVATE_IMPORTS = {("sheafgnn.experiments.learned_report", "sheafgnn.experiments.learned_topology._eval_site")}


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


def plant(tmp_path: Path, monkeypatch, modules: dict[str, str]) -> None:
    """Make the checks read a package ``sheafgnn`` of ``modules`` (name -> source) under ``tmp_path``."""
    package = tmp_path / "sheafgnn"
    package.mkdir()
    for name, source in {"__init__": "", **modules}.items():
        (package / f"{name}.py").write_text(source)
    monkeypatch.setitem(globals(), "PACKAGE", package)


def test_the_check_sees_a_planted_cycle(tmp_path, monkeypatch):
    """The cycle check is not vacuous: two modules importing each other inside functions are found."""
    plant(tmp_path, monkeypatch, {"a": "def f():\n    from sheafgnn import b\n",
                                  "b": "def g():\n    import sheafgnn.a\n"})
    assert [set(c) for c in nx.simple_cycles(import_graph())] == [{"sheafgnn.a", "sheafgnn.b"}]


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _dotted(node: ast.expr) -> str | None:
    """``a.b.c`` of a chain of attribute lookups on a name, else None."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


def private_imports() -> set[tuple[str, str]]:
    """(module, other module's private name) for every ``from m import _x`` and every ``m._x`` where ``m``
    names an imported sheafgnn module (``from pkg import m``, ``import pkg.m as m`` or ``pkg.m`` itself)."""
    modules = _modules()
    found = set()
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        bound = {}  # local name -> the sheafgnn module it names
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module in modules and node.level == 0:
                for alias in node.names:
                    if _private(alias.name):
                        found.add((name, f"{node.module}.{alias.name}"))
                    elif f"{node.module}.{alias.name}" in modules:
                        bound[alias.asname or alias.name] = f"{node.module}.{alias.name}"
            elif isinstance(node, ast.Import):
                bound.update({alias.asname: alias.name for alias in node.names if alias.asname in modules or
                              (alias.asname and alias.name in modules)})
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _private(node.attr):
                owner = _dotted(node.value)
                if owner is not None:
                    head, _, rest = owner.partition(".")
                    owner = ".".join(filter(None, (bound.get(head, head), rest)))
                    if owner in modules and owner != name:
                        found.add((name, f"{owner}.{node.attr}"))
    return found


def test_no_module_takes_a_private_name_from_another():
    new = private_imports() - KNOWN_PRIVATE_IMPORTS
    assert not new, f"private names taken from other modules: {sorted(new)}"
    assert not any(module.startswith("sheafgnn.site") for module, _ in KNOWN_PRIVATE_IMPORTS)


def test_the_check_sees_planted_private_imports(tmp_path, monkeypatch):
    """The private-name check is not vacuous: an import of one, and lookups on an imported module, are found."""
    plant(tmp_path, monkeypatch, {
        "a": "_X = 1\n\n\ndef _f():\n    return _X\n",
        "b": "from sheafgnn.a import _X\n",
        "c": "from sheafgnn import a\nimport sheafgnn.a\n\n\ndef g():\n    return a._f(), sheafgnn.a._X\n",
    })
    assert private_imports() == {("sheafgnn.b", "sheafgnn.a._X"), ("sheafgnn.c", "sheafgnn.a._f"),
                                 ("sheafgnn.c", "sheafgnn.a._X")}


EXAMPLE_PATCH_TYPE = Path(__file__).resolve().parent / "patch_types" / "line.py"


def test_a_patch_type_is_one_file(tmp_path):
    """A copy of the package plus one file, tests/patch_types/line.py as sheafgnn/site/patches/line.py: in a
    fresh interpreter, the ``line`` type is in the schema, SiteConfig, build_site, SiteStream and the model
    (:func:`_check_the_line_type`)."""
    shutil.copytree(PACKAGE, tmp_path / "sheafgnn", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(EXAMPLE_PATCH_TYPE, tmp_path / "sheafgnn" / "site" / "patches" / "line.py")
    # the copy first (the working directory), then this repository for the tests package
    env = {**os.environ, "PYTHONPATH": str(PACKAGE.parent), "SHEAFGNN_CPU_KERNELS": "0"}
    command = [sys.executable, "-c", "from tests.test_layout import _check_the_line_type; _check_the_line_type()"]
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]


def _check_the_line_type() -> None:
    """What :func:`test_a_patch_type_is_one_file` runs on the copy of the package with ``line`` added."""
    import torch

    import sheafgnn
    from sheafgnn.model import SheafStateLM
    from sheafgnn.site import EDGE_TYPES, PATCH_TYPES, ByteTokenizer, SiteConfig, build_site, validate_site
    from sheafgnn.site.patches import BUILT_IN
    from sheafgnn.site.schema import GLUE_EDGES, NODE_ATTRIBUTES

    from .conftest import CODE, PROSE, small_model_config
    from .test_site_stream import check_stream, random_chunks

    assert Path(sheafgnn.__file__).resolve().parent == Path.cwd().resolve() / "sheafgnn", "not the copy"
    assert PATCH_TYPES == (*BUILT_IN, "line", "output")
    assert {("token", "in", "line"), ("line", "next", "line"), ("line", "reads", "output")} <= set(EDGE_TYPES)
    assert ("line", "next", "line") in GLUE_EDGES and NODE_ATTRIBUTES["line"] == "indent"
    config = SiteConfig(patch_types=PATCH_TYPES, local_window=8, line_max_indent=4)
    assert SiteConfig.from_dict(config.to_dict()) == config
    assert config.with_overrides(["line_max_indent=2"]).line_max_indent == 2 and SiteConfig().line_max_indent == 8
    with pytest.raises(ValueError, match="line_max_indent must be a positive integer"):
        SiteConfig(line_max_indent=0)

    site = validate_site(build_site(CODE, config))
    lines = CODE.split("\n")[:-1]
    assert site["line"].indent.tolist() == [min(len(line) - len(line.lstrip(" ")), 4) for line in lines]
    ids = ByteTokenizer().encode(PROSE + CODE + "\n\t \n  x")
    check_stream(ids[:100], [1] * 100, config)
    check_stream(ids, random_chunks(ids.numel(), seed=7), config)

    torch.manual_seed(0)
    model = SheafStateLM(small_model_config(config)).eval()
    assert model.indent_embedding.num_embeddings == 5
    prefix = ids[:150]
    with torch.no_grad():
        full = model(build_site(prefix, config))
        stream = model.stream()
        streamed = torch.cat([stream.feed(chunk) for chunk in prefix.split(7)])
        torch.testing.assert_close(streamed, full, atol=1e-4, rtol=1e-4)
        model.indent_embedding.weight.normal_()
        assert not torch.allclose(model(build_site(prefix, config)), full), "the indent is not embedded"
