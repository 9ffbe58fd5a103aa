"""The core install: sheafgnn imports, builds, runs, streams and trains without its extras, and each
feature of an extra says which one to install (sheafgnn.optional, pyproject.toml)."""

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from sheafgnn.optional import PACKAGES, MissingExtra, install_hint, missing, require

ROOT = Path(__file__).resolve().parents[1]

# Every package the core install leaves out, as Python imports it (the fast extra's too: the code falls back).
ABSENT = ("sklearn", "scipy", "networkx", "matplotlib", "tensorboard", "torch.utils.tensorboard", "ninja",
          "torch_scatter", "torch_sparse")

# Run in a fresh interpreter. A None in sys.modules is how Python marks a module absent: importing it raises
# ModuleNotFoundError and importlib.util.find_spec answers None, as for a package that is not installed (torch
# asks find_spec about networkx and others while it imports, so a finder that raises would break torch itself).
CORE_ONLY = """
import sys, warnings
for name in sys.argv[3:]:
    sys.modules[name] = None
import torch
import sheafgnn
from sheafgnn import SheafStateConfig, SheafStateLM, build_site
from sheafgnn.cli import main
from sheafgnn.nn import segment
from sheafgnn.optional import MissingExtra
from sheafgnn.site import TopicModel
from sheafgnn.train import TrainConfig, train

out, corpus = sys.argv[1], sys.argv[2]
assert not segment.HAS_TORCH_SCATTER and not segment.HAS_TORCH_SPARSE
torch.manual_seed(0)
model = SheafStateLM(SheafStateConfig(d_model=32, n_layers=1, ssm={"headdim": 16, "chunk_size": 16})).eval()
data = build_site(open(corpus, "rb").read()[:300])  # the default site: every default patch type
ids = data["token"].x
data["token"].y = torch.cat([ids[1:], ids.new_full((1,), -100)])
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    with torch.no_grad():
        logits, loss = model(data), model.loss(data)
        stream = model.stream()
        streamed = torch.cat([stream.feed(ids[i : i + 1]) for i in range(40)])
kernel_warnings = [str(w.message) for w in caught if "C++ kernel" in str(w.message)]
assert len(kernel_warnings) == 1 and "sheafgnn[kernels]" in kernel_warnings[0], kernel_warnings
assert logits.shape == (ids.numel(), 256) and torch.isfinite(loss)
torch.testing.assert_close(streamed, logits[:40], atol=1e-4, rtol=1e-4)

config = TrainConfig(model="sheaf", model_config=dict(d_model=32, n_layers=1, headdim=16, chunk_size=16),
                     corpus=corpus, context=32, batch_size=2, steps=2, eval_every=2, eval_batches=1,
                     checkpoint_every=2, out_dir=out + "/run", num_threads=1, progress=False, tensorboard=False,
                     device="cpu")
assert sorted(train(config)["history"]) == [1, 2]

def refused(call, *needles):
    try:
        call()
    except MissingExtra as err:
        assert all(n in str(err) for n in needles), str(err)
    else:
        raise AssertionError(f"{call} ran without its extra")

refused(lambda: TopicModel.fit(["a sentence."] * 4, num_topics=2), "scikit-learn", "sheafgnn[experiments]")
refused(lambda: train(TrainConfig(**{**config.to_dict(), "out_dir": out + "/tb", "tensorboard": True})),
        "tensorboard", "sheafgnn[experiments]", "set tensorboard: false")
refused(lambda: __import__("sheafgnn.relations"), "scipy", "sheafgnn[experiments]")
assert main(["simulate", "--help"]) == 2
print("core only: ok")
"""


def test_the_core_install_imports_builds_runs_streams_and_trains(tmp_path):
    """Without any extra: a forward, a loss, a stream of 40 tokens, two training steps; a failed kernel build
    (no ninja on PATH) warns once; each extra's feature raises MissingExtra naming it; the CLI says so in one
    line."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("The cat sat on the mat. Then it went away to the store! The store sells fish. " * 40)
    env = {"PATH": str(tmp_path / "empty"), "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"), "HOME": str(tmp_path),
           "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", CORE_ONLY, str(tmp_path), str(corpus), *ABSENT],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0 and "core only: ok" in proc.stdout, proc.stderr[-4000:]
    assert "sheafgnn simulate: error: " in proc.stderr and "pip install 'sheafgnn[experiments]'" in proc.stderr


def _names(specs: list[str]) -> set[str]:
    """``["scikit-learn>=1.3", "tqdm"]`` -> ``{"scikit-learn", "tqdm"}``."""
    return {re.split(r"[<>=!~ \[;]", spec, maxsplit=1)[0].lower() for spec in specs}


def test_pyproject_extras_hold_what_the_code_calls_optional():
    """The core dependencies hold no optional package; each one is in the extra its error message names."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = _names(project["dependencies"])
    extras = {extra: _names(specs) for extra, specs in project["optional-dependencies"].items()}
    assert core == {"torch", "torch-geometric", "numpy", "pyyaml", "tokenizers", "safetensors", "tqdm"}
    for module, (package, extra) in PACKAGES.items():
        assert package in extras[extra] and package not in core, (module, package, extra)
    assert extras["fast"] == {"torch-scatter", "torch-sparse"}
    run_sh = (ROOT / "scripts" / "run.sh").read_text()
    assert '-e ".[experiments,kernels,dev]"' in run_sh and "--no-build-isolation torch-scatter torch-sparse" in run_sh


def test_require_and_missing_name_the_extra():
    assert require("json", "a test").dumps([]) == "[]"
    with pytest.raises(MissingExtra, match=r"plots needs matplotlib, .*: pip install 'sheafgnn\[experiments\]'"):
        require("matplotlib.no_such_module", "plots")
    with pytest.raises(MissingExtra, match=r"TensorBoard needs tensorboard, .*\[experiments\]'\, or set it off"):
        require("torch.utils.tensorboard.no_such_module", "TensorBoard", otherwise="set it off")
    with pytest.raises(MissingExtra, match=r"kernels needs ninja, .*: pip install 'sheafgnn\[kernels\]'"):
        missing("ninja", "kernels")(1, key=2)
    assert install_hint("sklearn.cluster") == "pip install 'sheafgnn[experiments]'"
