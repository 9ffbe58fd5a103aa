"""The `sheafgnn` command: dispatch, inspect on a config and on a trained run, clear errors."""

import pytest
import yaml

from sheafgnn.cli import load_model, main
from sheafgnn.model import SheafStateLM

from .conftest import PROSE


def test_inspect_from_config_and_from_a_training_run(tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text(PROSE)
    config = tmp_path / "model.yaml"
    config.write_text(yaml.safe_dump({"d_model": 32, "n_layers": 1, "headdim": 16}))
    assert main(["inspect", str(config), "--text", str(text), "--out", str(tmp_path / "a")]) == 0
    assert (tmp_path / "a" / "topology.graphml").is_file()

    run = tmp_path / "run"
    train = tmp_path / "train.yaml"
    train.write_text(yaml.safe_dump({
        "model": "sheaf", "model_config": {"d_model": 32, "n_layers": 1, "headdim": 16}, "context": 64,
        "batch_size": 2, "steps": 2, "eval_every": 2, "eval_batches": 1, "checkpoint_every": 2,
        "out_dir": str(run), "progress": False, "tensorboard": False}))
    assert main(["train", "--config", str(train)]) == 0
    model, tokenizer = load_model(run)
    assert isinstance(model, SheafStateLM) and not model.training and tokenizer.vocab_size == 256
    assert main(["inspect", str(run), "--text", str(text), "--out", str(tmp_path / "b")]) == 0
    assert "wrote" in capsys.readouterr().out


def test_clear_errors(tmp_path, capsys):
    assert main(["inspect", str(tmp_path / "missing"), "--text", __file__]) == 1
    assert "no checkpoint folder or config file" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["inspect", str(tmp_path / "empty"), "--text", __file__]) == 1
    assert "holds no checkpoint" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["nonsense"])
    with pytest.raises(SystemExit):
        main(["inspect", str(tmp_path), "--text", __file__, "--no-such-flag"])
