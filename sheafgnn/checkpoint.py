"""Checkpoints: atomic, self-checking, loadable with ``weights_only=True``.

A checkpoint is a directory per step, published by renaming a finished
temporary directory, and a ``latest`` pointer file replaced atomically after
it. A run killed at any moment leaves ``latest`` naming a complete pair::

    out_dir/checkpoints/
        step_000400/
            model.safetensors   the weights (tied tensors stored once)
            state.pt            config, optimizer, schedule, RNG, data position,
                                SHA-256 of model.safetensors
        step_000800/
        latest                  "step_000800"

``state.pt`` holds only tensors and plain Python types, so
``torch.load(..., weights_only=True)`` reads it. Every way a checkpoint can
be unreadable (missing, truncated, hash mismatch, weights that do not fit the
model) raises :class:`CheckpointError` with the path and what to do.
"""

from __future__ import annotations

import hashlib
import os
import random
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

WEIGHTS = "model.safetensors"
STATE = "state.pt"
LATEST = "latest"
# Bumped when the layout of state.pt or what its weights compute changes: 2 since the gluing into the tokens adds
# what each output gathered, not the output state (SheafBlock.token_tail); 3 since the topology normalises its
# queries and keys (TopologyConfig.qk_norm, on by default): read_state gives the sheaf model config of an earlier
# format ``topology.qk_norm: false`` where it is silent, which is what its weights compute; 4 since the learned
# restriction maps start at the identity (GluingConfig.map_init, default identity): an earlier format's silence
# means ``gluing.map_init: random``. A model that computes otherwise with an earlier format's weights names the
# oldest format it reads as ``oldest_checkpoint_format``.
FORMATS = (1, 2, 3, 4)  # the formats read_state reads
# Format -> (group, field, value): a sheaf model config of an earlier format that is silent on the field was
# written when its default was the value (a flat config's ``gluing: bool`` gets it from FLAT_DEFAULTS instead)
SILENT_BEFORE = {3: ("topology", "qk_norm", False), 4: ("gluing", "map_init", "random")}
FORMAT = FORMATS[-1]  # the one save_checkpoint writes


class CheckpointError(RuntimeError):
    """A checkpoint is missing, corrupt, or does not match the run."""


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def step_name(step: int) -> str:
    return f"step_{step:06d}"


def save_checkpoint(ckpt_dir: str | os.PathLike, step: int, model: nn.Module, state: dict, keep: int = 2) -> Path:
    """Write ``model``'s weights and ``state`` as checkpoint ``step``, then point ``latest`` at it.

    Order: files into ``step_N.tmp/`` (fsync) -> rename to ``step_N/`` -> write
    ``latest.tmp`` -> rename to ``latest``. Older checkpoints beyond the newest
    ``keep`` are removed afterwards (``keep=0`` keeps all).

    Returns:
        The checkpoint directory.
    """
    from safetensors.torch import save_model

    ckpt_dir = Path(ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    final = ckpt_dir / step_name(step)
    tmp = ckpt_dir / (step_name(step) + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)  # left by a run killed mid-write
    tmp.mkdir()
    save_model(model, str(tmp / WEIGHTS))
    _fsync(tmp / WEIGHTS)
    state = {**state, "format": FORMAT, "step": step, "weights_sha256": _sha256(tmp / WEIGHTS)}
    torch.save(state, tmp / STATE)
    _fsync(tmp / STATE)
    if final.exists():  # a stale step_N from before a resume to an earlier step
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync(ckpt_dir)
    write_latest(ckpt_dir, final.name)
    if keep > 0:
        done = sorted(p for p in ckpt_dir.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp"))
        for old in done[:-keep]:
            if old != final:
                shutil.rmtree(old, ignore_errors=True)
    return final


def write_latest(ckpt_dir: Path, name: str) -> None:
    """Atomically replace the ``latest`` pointer with ``name``."""
    tmp = ckpt_dir / (LATEST + ".tmp")
    tmp.write_text(name + "\n")
    _fsync(tmp)
    os.replace(tmp, ckpt_dir / LATEST)
    _fsync(ckpt_dir)


def latest_checkpoint(ckpt_dir: str | os.PathLike) -> Path | None:
    """The directory ``latest`` points to, or ``None`` if nothing was ever saved."""
    pointer = Path(ckpt_dir) / LATEST
    if not pointer.exists():
        return None
    name = pointer.read_text().strip()
    path = Path(ckpt_dir) / name
    if not name.startswith("step_") or not path.is_dir():
        raise CheckpointError(f"{pointer} names {name!r}, which is not a checkpoint directory in {ckpt_dir}; "
                              "fix the pointer to an existing step_* directory or start a new out_dir")
    return path


def read_state(path: str | os.PathLike) -> dict:
    """The state dict of the checkpoint at ``path`` (a step directory), read without unpickling code
    (``weights_only``); what :func:`load_checkpoint` returns, for a caller that needs the config in it
    to build the model first.

    Raises:
        CheckpointError: the state file is corrupt, unreadable or of an unknown layout.
    """
    path = Path(path)
    state_file = path / STATE
    try:
        state = torch.load(state_file, map_location="cpu", weights_only=True)
    except Exception as err:
        raise CheckpointError(f"checkpoint {state_file} is corrupt or unreadable ({type(err).__name__}: "
                              f"{err}); delete {path} and repoint {path.parent / LATEST} "
                              "to an earlier step, or start a new out_dir") from None
    if not isinstance(state, dict) or state.get("format") not in FORMATS:
        raise CheckpointError(f"checkpoint {state_file} has an unknown layout "
                              f"(format {state.get('format') if isinstance(state, dict) else None}, "
                              f"expected one of {FORMATS})")
    config, model_config = state.get("config"), state.get("model_config")
    sheaf = not isinstance(config, dict) or config.get("model", "sheaf") == "sheaf"  # a train run's, or the model's
    if sheaf and isinstance(model_config, dict):
        for fmt, (group, name, value) in SILENT_BEFORE.items():
            part = model_config.get(group)
            if state["format"] < fmt and (part is None or isinstance(part, dict)):  # not a flat `gluing: bool`
                model_config[group] = {name: value, **(part or {})}
    return state


def load_checkpoint(path: str | os.PathLike, model: nn.Module, device: torch.device | str = "cpu",
                    check: Callable[[dict], None] | None = None) -> dict:
    """Load the weights at ``path`` (a step directory) into ``model``; return the state dict.

    ``check(state)``, if given, runs after the files are verified and before
    the weights are loaded: it can refuse a checkpoint of another run with a
    clearer message than a shape mismatch.

    Raises:
        CheckpointError: the files are missing, truncated, fail their hash,
            are older than ``model.oldest_checkpoint_format``, or the weights
            do not fit ``model``.
    """
    from safetensors.torch import load_model

    path = Path(path)
    weights, state_file = path / WEIGHTS, path / STATE
    for f in (weights, state_file):
        if not f.is_file():
            raise CheckpointError(f"checkpoint {path} is incomplete: {f.name} is missing")
    state = read_state(path)
    if _sha256(weights) != state.get("weights_sha256"):
        raise CheckpointError(f"checkpoint {weights} is corrupt: its SHA-256 does not match the one recorded "
                              f"in {STATE} (truncated or overwritten?); delete {path} and repoint "
                              f"{path.parent / LATEST} to an earlier step, or start a new out_dir")
    if check is not None:
        check(state)
    oldest = getattr(model, "oldest_checkpoint_format", FORMATS[0])
    if state["format"] < oldest:
        raise CheckpointError(f"checkpoint {path} has format {state['format']}: it was written by a version whose "
                              f"{type(model).__name__} computed otherwise with the same weights (this one reads "
                              f"format {oldest} and later); retrain it with this version")
    try:
        load_model(model, str(weights), strict=True, device=str(device))
    except Exception as err:
        raise CheckpointError(f"checkpoint {weights} does not fit the model ({type(err).__name__}: "
                              f"{str(err)[:500]}); resume with the config that wrote it") from None
    return state


# ---------------------------------------------------------------------------
# RNG state as tensors and plain types (weights_only-safe)
# ---------------------------------------------------------------------------


def rng_state() -> dict:
    """Torch (CPU and CUDA), Python and NumPy RNG states, as tensors and plain types."""
    version, internal, gauss = random.getstate()
    out = {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "python": {"version": version, "state": torch.tensor(internal, dtype=torch.int64), "gauss": gauss},
    }
    try:
        import numpy as np

        name, keys, pos, has_gauss, cached = np.random.get_state()
        out["numpy"] = {"name": name, "keys": torch.from_numpy(keys.astype("int64")), "pos": int(pos),
                        "has_gauss": int(has_gauss), "cached": float(cached)}
    except ImportError:
        pass
    return out


def set_rng_state(state: dict) -> None:
    """Restore what :func:`rng_state` returned."""
    torch.set_rng_state(state["torch"].cpu())
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"].tolist()), py["gauss"]))
    if "numpy" in state:
        import numpy as np

        s = state["numpy"]
        np.random.set_state((s["name"], s["keys"].numpy().astype("uint32"), s["pos"], s["has_gauss"], s["cached"]))
