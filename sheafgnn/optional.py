"""Optional dependencies: imported where a feature uses them, with an error that names the extra to install.

The core install (torch, torch-geometric, numpy, PyYAML, tokenizers, safetensors, tqdm) imports
``sheafgnn``, builds sites, trains, streams and generates. The extras of ``pyproject.toml`` add the rest::

    sheafgnn[experiments]  scikit-learn  TopicModel (topic patches)
                           scipy         sheafgnn.relations (simulation, learned-topology study, inspect)
                           networkx      sheafgnn inspect
                           matplotlib    the experiments' and benchmarks' plots
                           tensorboard   TrainConfig.tensorboard
    sheafgnn[kernels]      ninja         builds the optional C++ kernels (sheafgnn.nn.cpu_kernels)
    sheafgnn[fast]         torch-scatter, torch-sparse: compiled segment reductions (sheafgnn.nn.segment
                           falls back to PyTorch); built with --no-build-isolation, see scripts/run.sh

::

    require(module, feature) -> module         the module, or MissingExtra naming the extra
    missing(module, feature) -> callable       a stand-in for a class of an absent package: calling it raises
    install_hint(module) -> str                "pip install 'sheafgnn[EXTRA]'"
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import ModuleType
from typing import NoReturn

# import name -> (the distribution pip installs, the extra of sheafgnn that brings it)
PACKAGES = {
    "sklearn": ("scikit-learn", "experiments"),
    "scipy": ("scipy", "experiments"),
    "networkx": ("networkx", "experiments"),
    "matplotlib": ("matplotlib", "experiments"),
    "tensorboard": ("tensorboard", "experiments"),
    "ninja": ("ninja", "kernels"),
}


class MissingExtra(ImportError):
    """A feature's optional dependency is not installed; the message says which extra installs it."""


def _package(module: str) -> tuple[str, str]:
    """(distribution, extra) of an optional module: its top-level package's (torch.utils.tensorboard: tensorboard's)."""
    return PACKAGES[module.removeprefix("torch.utils.").split(".")[0]]


def install_hint(module: str) -> str:
    """The command that installs the optional ``module``: ``pip install 'sheafgnn[EXTRA]'``."""
    return f"pip install 'sheafgnn[{_package(module)[1]}]'"


def _message(module: str, feature: str, otherwise: str | None) -> str:
    text = f"{feature} needs {_package(module)[0]}, which the core install leaves out: {install_hint(module)}"
    return text if otherwise is None else f"{text}, or {otherwise}"


def require(module: str, feature: str, otherwise: str | None = None) -> ModuleType:
    """Import the optional ``module`` for ``feature`` (e.g. ``"sheafgnn inspect"``).

    Raises:
        MissingExtra: it does not import; the message names the extra that installs it, and
            ``otherwise`` (e.g. ``"set tensorboard: false"``) when given.
    """
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise MissingExtra(_message(module, feature, otherwise)) from err


def missing(module: str, feature: str) -> Callable[..., NoReturn]:
    """A stand-in for a class or function of the absent optional ``module``: the module that imports it
    still imports, and calling the stand-in raises :class:`MissingExtra` for ``feature``."""
    message = _message(module, feature, None)

    def absent(*args, **kwargs) -> NoReturn:
        raise MissingExtra(message)

    return absent
