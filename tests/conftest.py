import importlib.util
import os
import random
from pathlib import Path

import pytest
import torch

from sheafgnn.flat_keys import nest_flat_keys
from sheafgnn.model import SheafStateConfig, SheafStateLM
from sheafgnn.nn import cpu_kernels, segment
from sheafgnn.site import PATCH_TYPES, SiteConfig, TopicModel, build_site
from sheafgnn.site.rules import split_sentences

torch.set_num_threads(1)

# The compiled code that `@pytest.mark.needs(name, ...)` names: whether it is usable here (a kernel is built on
# first use, during the first test that needs it).
COMPILED = {
    "block_topk": lambda: cpu_kernels.block_topk() is not None,  # sheafgnn/nn/csrc/block_topk.cpp
    "step_kernels": lambda: cpu_kernels.ssm_step() is not None,  # sheafgnn/nn/csrc/step_kernels.cpp
    "torch_scatter": lambda: segment.HAS_TORCH_SCATTER,
    "torch_sparse": lambda: segment.HAS_TORCH_SPARSE,
}


def pytest_runtest_setup(item: pytest.Item) -> None:
    """A test marked ``needs(name, ...)`` is skipped where one of them is unavailable (no compiler, no ninja,
    ``SHEAFGNN_CPU_KERNELS=0``, not installed); with ``SHEAFGNN_REQUIRE_KERNELS=1`` (CI: ``.ci/run``) it fails
    instead, so that a machine that cannot build them does not pass with the tests unrun."""
    for mark in item.iter_markers("needs"):
        absent = [name for name in mark.args if not COMPILED[name]()]
        if not absent:
            continue
        reason = f"{', '.join(absent)} unavailable (SHEAFGNN_CPU_KERNELS=0, no compiler or ninja, or not installed)"
        if os.environ.get("SHEAFGNN_REQUIRE_KERNELS") == "1":
            pytest.fail(f"{reason}; SHEAFGNN_REQUIRE_KERNELS=1 makes this a failure, not a skip", pytrace=False)
        pytest.skip(reason)

GATES = ("glue_gate", "broadcast_gate")  # the gluing's gates (glue_gate starts at 0, broadcast_gate at gate_init)
RESET = SheafStateLM.reset_parameters  # as the library defines it


def open_gates(model: SheafStateLM) -> SheafStateLM:
    """``model`` with its gluing gates drawn at random, N(0, 0.2^2) (in place; broadcast_gate's parameter is the
    gate over ``gluing.gate_scale``)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(GATES):
                p.normal_(0.0, 0.2 / (model.config.gluing.gate_scale if name.endswith("broadcast_gate") else 1.0))
    return model


@pytest.fixture(scope="session", autouse=True)
def models_with_open_gates():
    """Every ``SheafStateLM`` the tests build has its gluing gates drawn at random. At zero (glue_gate's
    initialisation, and broadcast_gate's with ``gluing.gate_init`` 0: the model starts as its ssm ablation) they keep
    the gluing out of the logits, and a test of causality, of the stream against the forward or of a kernel against
    its reference would pass whatever the gluing computed; drawn at random, no gate is at a value that hides a term.
    A test of the initial model itself is marked ``closed_gates``; a model built in a subprocess calls
    :func:`open_gates`."""
    def reset_with_open_gates(model: SheafStateLM) -> None:
        RESET(model)
        open_gates(model)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(SheafStateLM, "reset_parameters", reset_with_open_gates)
        yield


@pytest.fixture(autouse=True)
def closed_gates(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    if request.node.get_closest_marker("closed_gates"):
        monkeypatch.setattr(SheafStateLM, "reset_parameters", RESET)


PROSE = (
    "### Instruction: summarise the passage below.\n"
    "The cat sat on the mat. Then (it [went] away) to \"the\" store! The cat came back at 3.14 pm.\n\n"
    "Q: where did the cat go?\nUser: tell me about the cat and the store.\n"
    "Another paragraph begins here. The store sells fish; the cat likes fish. Fish, fish, fish.\n"
)
CODE = (
    "def gcd(a, b):\n"
    "    \"\"\"Greatest common divisor.\"\"\"\n"
    "    while b:\n"
    "        a, b = b, a % b\n"
    "    return a\n\n"
    "class Point:\n"
    "    def __init__(self, x, y):\n"
    "        self.x = x  # the x coordinate\n"
    "        self.y = y\n"
    "    def norm(self):\n"
    "        return (self.x ** 2 + self.y ** 2) ** 0.5\n"
    "print(gcd(12, 18), Point(3, 4).norm())\n"
)


@pytest.fixture(scope="session")
def topic_model() -> TopicModel:
    sentences = split_sentences(PROSE * 3) + split_sentences(CODE) + [f"sentence number {i}. " for i in range(20)]
    return TopicModel.fit(sentences, num_topics=4, n_features=1 << 10)


@pytest.fixture(scope="session")
def full_config(tmp_path_factory, topic_model) -> SiteConfig:
    """Every patch type switched on, small windows so short texts use them all."""
    path = tmp_path_factory.mktemp("topics") / "topics.safetensors"
    topic_model.save(path)
    return SiteConfig(patch_types=PATCH_TYPES, local_window=8, retrieval_key_len=2, memory_min_len=2,
                      topic_model=str(path))


def small_model_config(full_config: SiteConfig, **kwargs) -> SheafStateConfig:
    """A tiny SheafStateConfig on the every-type site config, with every proposal (the random ones too, which the
    default does without); ``kwargs`` override, by their field names (``map_kind=...`` sets ``gluing.map_kind``:
    :data:`~sheafgnn.flat_keys.FLAT_KEYS`, a shorthand for tests)."""
    values = dict(d_model=32, n_layers=2, ssm={"headdim": 16, "chunk_size": 16}, topology={"random_proposals": 4},
                  site=full_config.to_dict())
    nested, _ = nest_flat_keys(kwargs)
    for key, value in nested.items():
        values[key] = {**values.get(key, {}), **value} if isinstance(value, dict) and key != "site" else value
    return SheafStateConfig(**values)


def word_corpus(path, sentences: int) -> str:
    """``sentences`` random sentences over a 19-word vocabulary, written to ``path`` (a text a model learns in a
    few steps); returns the path."""
    rng = random.Random(0)
    words = "the cat sat on a mat and the dog ran to the park while birds sang in tall green trees".split()
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(4, 12))) + "." for _ in range(sentences)]
    path.write_text("\n".join(lines))
    return str(path)


SUFFIXES = [b" The end. (x) ###\n", b"\n\n    fish cat\nQ: why?\n", b"))]]\"\" the cat sat."]


def assert_logits_causal(model, text: str, trials: int, atol: float = 1e-5) -> None:
    """Perturbation test: logits at positions <= t are the same whatever text follows t,
    for ``trials`` random t in train and in eval mode."""
    site_config = model.config.site_config
    raw = text.encode()
    rng = random.Random(1)
    for mode in ("train", "eval"):
        model.train(mode == "train")
        for _ in range(trials):
            t = rng.randrange(8, len(raw) - 1)
            a, b = rng.sample(SUFFIXES, 2)
            ga, gb = build_site(raw[: t + 1] + a, site_config), build_site(raw[: t + 1] + b, site_config)
            with torch.no_grad():
                la, lb = model(ga)[: t + 1], model(gb)[: t + 1]
            assert torch.allclose(la, lb, atol=atol), f"{mode}: logits before t={t} depend on the future"


def load_benchmark(name: str):
    """The module of ``benchmarks/<name>.py`` (a script, not a package: loaded from its path)."""
    path = Path(__file__).resolve().parent.parent / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
