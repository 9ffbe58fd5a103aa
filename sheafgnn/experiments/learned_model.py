"""The learned-topology study's trained model, kept for later diagnosis (``sheafgnn simulate --learned
--save-model DIR``): a study trains for about an hour, and a question about what it learned should not
need another hour.

The weights go through :mod:`sheafgnn.checkpoint` (safetensors, written atomically, checked by hash on
load); the model's config rides in the checkpoint's state, so :func:`load_learned_model` needs nothing
else::

    save_learned_model(model, DIR, step)     DIR/step_N/ and DIR/latest
    load_learned_model(DIR) -> SheafStateLM  in eval mode
"""

from __future__ import annotations

import os
from pathlib import Path

from sheafgnn import checkpoint as ckpt
from sheafgnn.model import SheafStateConfig, SheafStateLM


def save_learned_model(model: SheafStateLM, ckpt_dir: str | os.PathLike, step: int) -> Path:
    """Write ``model`` (weights and config) as checkpoint ``step`` of ``ckpt_dir``; returns its folder."""
    return ckpt.save_checkpoint(ckpt_dir, step, model, {"model_config": model.config.to_dict()}, keep=1)


def load_learned_model(ckpt_dir: str | os.PathLike) -> SheafStateLM:
    """The model :func:`save_learned_model` wrote last in ``ckpt_dir``, in eval mode.

    Raises:
        CheckpointError: ``ckpt_dir`` holds no checkpoint, or its files are missing, corrupt or of another
            model.
    """
    step = ckpt.latest_checkpoint(ckpt_dir)
    if step is None:
        raise ckpt.CheckpointError(f"{ckpt_dir} holds no checkpoint (write one with sheafgnn simulate --learned "
                                   "--save-model DIR)")
    state = ckpt.read_state(step)
    try:
        config = SheafStateConfig.from_dict(state["model_config"])
    except Exception as err:
        raise ckpt.CheckpointError(f"checkpoint {step} holds no readable model config ({type(err).__name__}: "
                                   f"{err})") from None
    model = SheafStateLM(config)
    ckpt.load_checkpoint(step, model)  # verifies the files and their hash
    return model.eval()
