"""The layout of the package: imports go downwards, no cycles, small modules and functions, no module reaching
into another's private names, a stream that computes no layer, and a patch type is one file.

experiments -> train -> lm / model / data -> site / nn (DESIGN.md, "Layout"). Imports are read
from the source (module level and inside functions), so a lazy import cannot hide a cycle. An import under
``if TYPE_CHECKING:`` names a type for the checker and never runs: it counts for the layers, not for cycles.
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


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _type_only(tree: ast.Module) -> set[ast.AST]:
    """The import statements under ``if TYPE_CHECKING:``."""
    return {node for block in ast.walk(tree) if isinstance(block, ast.If) and ast.unparse(block.test) in
            ("TYPE_CHECKING", "typing.TYPE_CHECKING") for statement in block.body for node in ast.walk(statement)
            if isinstance(node, (ast.Import, ast.ImportFrom))}


def _imports(path: Path, modules: dict[str, Path], type_only: bool = False) -> set[str]:
    """The sheafgnn modules ``path`` imports at run time (``type_only``: under ``if TYPE_CHECKING:`` only);
    ``from pkg import sub`` counts as importing ``pkg.sub``."""
    tree = ast.parse(path.read_text())
    for_types = _type_only(tree)
    out = set()
    for node in ast.walk(tree):
        if (node in for_types) != type_only:
            continue
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                out.add(sub if sub in modules else node.module)
    return {name for name in out if name in modules}


def import_graph(type_only: bool = False) -> nx.DiGraph:
    """The run-time imports between sheafgnn's modules, and with ``type_only`` those under TYPE_CHECKING too."""
    modules = _modules()
    graph = nx.DiGraph()
    for name, path in modules.items():
        graph.add_node(name)
        targets = _imports(path, modules) | (_imports(path, modules, type_only=True) if type_only else set())
        for target in targets:
            # a package's __init__ re-exporting its own submodules is not an upward import
            if not (path.name == "__init__.py" and target.startswith(name + ".")):
                graph.add_edge(name, target)
    return graph


def test_no_import_cycles():
    cycles = list(nx.simple_cycles(import_graph()))
    assert not cycles, f"import cycles: {cycles}"


@pytest.mark.parametrize("lower", sorted(LAYERS))
def test_imports_go_downwards(lower):
    graph = import_graph(type_only=True)
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


# What the stream may import at run time: the generic stream, the caches and deltas it hands to the layers, and
# the site deltas; the model for its type only. What computes a layer (sheafgnn.nn's layers and kernels) is the
# model's: the stream is its consumer, as lm.py is.
STREAM_IMPORTS = ("sheafgnn.generation", "sheafgnn.nn.inference", "sheafgnn.site")
STREAM_TYPE_IMPORTS = {"sheafgnn.model"}


def _under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def test_the_stream_computes_no_layer():
    """stream.py is bookkeeping of deltas and rows: each layer owns its step (SelectiveSSM.continue_chains,
    LearnedTopology.step, SheafBlock.step), so the stream imports nothing that computes a layer's math."""
    modules = _modules()
    runtime = _imports(modules["sheafgnn.stream"], modules)
    type_only = _imports(modules["sheafgnn.stream"], modules, type_only=True)
    assert not [m for m in runtime if not _under(m, STREAM_IMPORTS)], f"sheafgnn.stream imports {sorted(runtime)}"
    assert type_only <= STREAM_TYPE_IMPORTS, f"sheafgnn.stream imports {sorted(type_only)} for types"


def _private(name: str | None) -> bool:
    return name is not None and name.startswith("_") and not name.startswith("__")


def _private_uses(path: Path, modules: dict[str, Path]) -> list[str]:
    """Where ``path`` imports a private name of another sheafgnn module (or binds one of its names to a private
    alias), reads one through the module, or calls a private method of anything but ``self``, ``cls`` and
    ``super()``; third-party objects (torch's private ops) are their libraries' affair."""
    tree = ast.parse(path.read_text())
    third_party, sheafgnn_modules, found = set(), set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                bound = alias.asname or alias.name.split(".")[0]
                (sheafgnn_modules if alias.name.startswith("sheafgnn") else third_party).add(bound)
        elif isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                if not node.module.startswith("sheafgnn"):
                    third_party.add(alias.asname or alias.name)
                elif f"{node.module}.{alias.name}" in modules:
                    sheafgnn_modules.add(alias.asname or alias.name)
                elif _private(alias.name) or _private(alias.asname):
                    found.append(f"{node.lineno}: from {node.module} import {ast.unparse(alias)}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr) and isinstance(node.value, ast.Name) and \
                node.value.id in sheafgnn_modules:
            found.append(f"{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and _private(node.func.attr):
            owner = node.func.value
            if (isinstance(owner, ast.Name) and owner.id in ("self", "cls")) or ast.unparse(owner) == "super()":
                continue
            root = owner
            while isinstance(root, (ast.Attribute, ast.Call, ast.Subscript)):
                root = root.func if isinstance(root, ast.Call) else root.value
            if not (isinstance(root, ast.Name) and root.id in third_party):
                found.append(f"{node.lineno}: {ast.unparse(node.func)}(...)")
    return found


def test_no_module_uses_another_modules_private_names():
    modules = _modules()
    bad = {name: uses for name, path in modules.items() for uses in [_private_uses(path, modules)] if uses}
    assert not bad, f"private names used across modules: {bad}"


def test_the_private_name_check_sees_each_kind(tmp_path):
    """The private-name check is not vacuous: an import, an alias, a read through a module and a call are found;
    a call on self and a third-party private op are not."""
    source = ("import torch\nfrom sheafgnn.nn import topology\nfrom sheafgnn.nn.gluing import _x\n"
              "from sheafgnn.nn.gluing import weigh as _w\n\n\nclass A:\n    def f(self, t):\n"
              "        self._g()\n        torch._int_mm(t, t)\n        topology._y\n        return t._score(1)\n")
    path = tmp_path / "a.py"
    path.write_text(source)
    found = _private_uses(path, {"sheafgnn.nn.topology": path})
    assert [use.split(":")[0] for use in found] == ["3", "4", "11", "12"], found


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

    from .conftest import CODE, PROSE, open_gates, small_model_config
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
    model = open_gates(SheafStateLM(small_model_config(config))).eval()  # a subprocess: no conftest fixture
    assert model.indent_embedding.num_embeddings == 5
    prefix = ids[:150]
    with torch.no_grad():
        full = model(build_site(prefix, config))
        stream = model.stream()
        streamed = torch.cat([stream.feed(chunk) for chunk in prefix.split(7)])
        torch.testing.assert_close(streamed, full, atol=1e-4, rtol=1e-4)
        model.indent_embedding.weight.normal_()
        assert not torch.allclose(model(build_site(prefix, config)), full), "the indent is not embedded"


MAX_CONFIG_FIELDS = 12


def test_the_model_config_is_a_few_groups():
    """SheafStateConfig composes one config per part of the model (each defined by the module that builds from it)
    and keeps at most MAX_CONFIG_FIELDS top-level fields."""
    from dataclasses import fields

    from sheafgnn.model import SheafStateConfig

    assert len(fields(SheafStateConfig)) <= MAX_CONFIG_FIELDS, [f.name for f in fields(SheafStateConfig)]
