"""The `sheafgnn` command: build, the shipped configs, --set overrides, inspect, one-line errors."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from sheafgnn.baselines import count_parameters
from sheafgnn.cli import load_model, main
from sheafgnn.lm import build_model
from sheafgnn.model import SheafStateLM
from sheafgnn.site import ALL_TEXT_PATCH_TYPES, SiteConfig, build_site, validate_site
from sheafgnn.train import TrainConfig

from .conftest import CODE, PROSE

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
TRAIN_CONFIGS = ("sheaf", "dense", "local", "ssm")
# Keeps a shipped config's 2 training steps fast (on the CPU, also where a GPU is); the model sizes stay as shipped.
FAST = ["--set", "steps=2", "--set", "context=32", "--set", "batch_size=2", "--set", "eval_batches=1",
        "--set", "progress=false", "--set", "tensorboard=false", "--set", "device=cpu"]


def run(argv: list[str], capsys) -> tuple[int, str, str]:
    """``sheafgnn ARGV`` in this process: (exit status, stdout, stderr)."""
    try:
        status = main(argv)
    except SystemExit as exit:  # argparse
        status = exit.code
    out, err = capsys.readouterr()
    return status, out, err


# ---------------------------------------------------------------------------
# sheafgnn build
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name, text", [("prose.txt", PROSE), ("code.py", CODE)])
def test_build_saves_the_validated_site_and_prints_statistics(tmp_path, capsys, name, text):
    path = tmp_path / name
    path.write_text(text)
    status, out, _ = run(["build", str(path), "--out", str(tmp_path / "graph.pt"), "--stats", "--all-types"], capsys)
    assert status == 0
    saved = validate_site(torch.load(tmp_path / "graph.pt", weights_only=False))
    expected = build_site(text, SiteConfig(patch_types=ALL_TEXT_PATCH_TYPES))
    assert saved.node_types == expected.node_types and saved.edge_types == expected.edge_types
    for node_type in expected.node_types:
        assert saved[node_type].num_nodes == expected[node_type].num_nodes, node_type
    for edge_type in expected.edge_types:
        assert torch.equal(saved[edge_type].edge_index, expected[edge_type].edge_index), edge_type
    tokens = len(text.encode())
    assert f"{tokens:,} tokens -> {expected.num_nodes:,} nodes, {expected.num_edges:,} edges" in out
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines()[2:] if line.split()}
    assert rows["token"] == [str(tokens), "1.000"]
    assert f"{expected.num_edges / tokens:.3f}" in out.splitlines()[-2]  # the "all edges" row
    assert int(rows["token__in__sentence" if name == "prose.txt" else "token__in__syntax"][0]) > 0


def test_build_with_a_site_config_and_without_output(tmp_path, capsys):
    (tmp_path / "text.txt").write_text(PROSE)
    (tmp_path / "site.yaml").write_text(yaml.safe_dump({"patch_types": ["local"], "local_window": 8}))
    status, out, _ = run(["build", str(tmp_path / "text.txt"), "--config", str(tmp_path / "site.yaml")], capsys)
    expected = build_site(PROSE, SiteConfig(patch_types=("local",), local_window=8))
    assert status == 0 and f"{expected.num_edges:,} edges" in out and "wrote" not in out
    assert expected["sentence"].num_nodes == 0 and expected["local"].num_nodes == len(PROSE.encode()) // 8


# ---------------------------------------------------------------------------
# --set overrides and the shipped configs
# ---------------------------------------------------------------------------


def test_overrides_reach_nested_fields():
    config = TrainConfig(model_config={"d_model": 32}).with_overrides([
        "steps=2", "lr=3e-4", "tokens=null", "bf16=true", "out_dir=runs/x", "model_config.d_model=64",
        "model_config.n_layers=1", "site.local_window=8", "site.patch_types=[local, sentence]"])
    assert (config.steps, config.lr, config.tokens, config.bf16, config.out_dir) == (2, 3e-4, None, True, "runs/x")
    assert config.model_config == {"d_model": 64, "n_layers": 1}
    assert config.site == {"local_window": 8, "patch_types": ["local", "sentence"]}
    assert SiteConfig().with_overrides(["local_window=4"]).local_window == 4  # every ConfigFile has it


@pytest.mark.parametrize("assignment, message", [
    ("stepz=2", r"TrainConfig has no field 'stepz' \(did you mean 'steps'\?\)"),
    ("steps", "expected KEY=VALUE"),
    ("steps=two", r"TrainConfig: steps must be an integer \(got 'two'\)"),
    ("lr=fast", "lr must be a number"),
    ("steps=-1", "steps must be a positive integer"),
    ("steps.every=1", "steps is 1000, not a mapping"),
    ("site.local_window=0", "SiteConfig: local_window must be a positive integer"),
    ("site.local_windw=8", r"SiteConfig: unknown fields \['local_windw'\] \(did you mean 'local_window'\?\)"),
    ("model_config=[1", "the value is not valid YAML"),
])
def test_bad_overrides_say_what_is_wrong(assignment, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig().with_overrides([assignment])


def test_shipped_training_configs_are_matched_in_parameters():
    counts = {}
    for kind in TRAIN_CONFIGS:
        config = TrainConfig.load(CONFIGS / f"{kind}.yaml")
        assert config.model == kind
        counts[kind] = count_parameters(build_model(kind, config.model_config, 256, config.site))
    print(counts)
    assert max(counts.values()) / min(counts.values()) <= 1.1, counts


@pytest.mark.parametrize("kind", TRAIN_CONFIGS)
def test_each_shipped_training_config_trains_two_steps(tmp_path, capsys, kind):
    status, out, err = run(["train", "--config", str(CONFIGS / f"{kind}.yaml"), *FAST,
                            "--set", f"out_dir={tmp_path}"], capsys)
    assert status == 0, err
    saved = TrainConfig.load(tmp_path / "config.yaml")
    assert saved.steps == 2 and saved.model == kind and saved.model_config == TrainConfig.load(
        CONFIGS / f"{kind}.yaml").model_config
    assert '"step": 2' in out and (tmp_path / "checkpoints" / "latest").is_file()


def test_the_shipped_task_config_trains_two_steps(tmp_path, capsys):
    tiny = ["--d-model", "64", "--n-layers", "1", "--window", "16", "--sheaf", '{"ssm": {"headdim": 16}}',
            "--batch-size", "2",
            "--test-examples", "2", "--mqar-seq-len", "64", "--mqar-pairs", "4", "--mqar-vocab", "64",
            "--copy-seq-len", "32", "--copy-tokens", "4", "--induction-train-len", "32", "--induction-test-lens", "32"]
    status, out, err = run(["tasks", "--config", str(CONFIGS / "tasks.yaml"), "--steps", "2", *tiny,
                            "--out", str(tmp_path), "--no-progress"], capsys)
    assert status == 0, err
    assert (tmp_path / "tasks.json").is_file() and "wrote" in out


# ---------------------------------------------------------------------------
# sheafgnn inspect
# ---------------------------------------------------------------------------


def test_inspect_from_config_and_from_a_training_run(tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text(PROSE)
    config = tmp_path / "model.yaml"
    config.write_text(yaml.safe_dump({"d_model": 32, "n_layers": 1, "ssm": {"headdim": 16}}))
    assert main(["inspect", str(config), "--text", str(text), "--out", str(tmp_path / "a")]) == 0
    assert (tmp_path / "a" / "topology.graphml").is_file()

    run_dir = tmp_path / "run"
    train = tmp_path / "train.yaml"
    train.write_text(yaml.safe_dump({
        "model": "sheaf", "model_config": {"d_model": 32, "n_layers": 1, "ssm": {"headdim": 16}}, "context": 64,
        "batch_size": 2, "steps": 2, "eval_every": 2, "eval_batches": 1, "checkpoint_every": 2,
        "out_dir": str(run_dir), "progress": False, "tensorboard": False, "device": "cpu"}))
    assert main(["train", "--config", str(train)]) == 0
    model, tokenizer = load_model(run_dir)
    assert isinstance(model, SheafStateLM) and not model.training and tokenizer.vocab_size == 256
    assert main(["inspect", str(run_dir), "--text", str(text), "--out", str(tmp_path / "b")]) == 0
    assert "wrote" in capsys.readouterr().out

    # a shipped training config: its sheaf model, untrained; a dense config is refused in one line
    model, _ = load_model(CONFIGS / "sheaf.yaml")
    shipped = TrainConfig.load(CONFIGS / "sheaf.yaml").model_config
    assert isinstance(model, SheafStateLM) and model.config.d_model == shipped["d_model"]
    assert main(["inspect", str(CONFIGS / "dense.yaml"), "--text", str(text)]) == 2
    assert "needs a sheaf model" in capsys.readouterr().err


# ---------------------------------------------------------------------------
# Bad input: one line on stderr, exit status 2, for every command
# ---------------------------------------------------------------------------


@pytest.fixture
def bad_files(tmp_path) -> dict[str, str]:
    (tmp_path / "bad.yaml").write_text("model: sheaf\nsteps: [1\n")
    (tmp_path / "lr.yaml").write_text("lr: fast\n")
    (tmp_path / "train.yaml").write_text("steps: 3\n")
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "model.yaml").write_text(yaml.safe_dump({"d_model": 32, "n_layers": 1, "headdim": 16}))
    (tmp_path / "no_checkpoints").mkdir()
    names = ("bad.yaml", "lr.yaml", "train.yaml", "empty.txt", "model.yaml", "no_checkpoints", "missing.txt",
             "missing.yaml")
    return {name.replace(".", "_"): str(tmp_path / name) for name in names}


BAD_INPUT = [
    ("demo", ["--tokens", "-5"], "argument --tokens: expected an integer >= 2, got -5"),
    ("demo", ["--context", "many"], "expected an integer >= 2, got 'many'"),
    ("demo", ["--tokens", "100"], "--tokens (100) must be at least --context (1024)"),
    ("build", ["{missing_txt}"], "No such file or directory: {missing_txt}"),
    ("build", ["{empty_txt}"], "is empty"),
    ("build", ["{model_yaml}", "--config", "{bad_yaml}"], "is not valid yaml: expected ',' or ']'"),
    ("build", ["{model_yaml}", "--config", "{missing_yaml}"], "no config file at"),
    ("train", ["--config", "{missing_yaml}"], "no config file at"),
    ("train", ["--config", "{bad_yaml}"], "is not valid yaml"),
    ("train", ["--config", "{lr_yaml}"], "lr must be a number (got 'fast')"),
    ("train", ["--config", "{model_yaml}"], "unknown fields ['d_model', 'headdim', 'n_layers']"),
    ("train", ["--config", "{train_yaml}", "--set", "lr=1e-3", "--set", "stepz=2"], "has no field 'stepz'"),
    ("train", ["--config", "{train_yaml}", "--set", "steps=-5"], "steps must be a positive integer (got -5)"),
    ("train", ["--config", "{train_yaml}", "--set", "model_config.d_model.x=1"], "model_config.d_model is None"),
    ("train", [], "the following arguments are required: --config"),
    ("compare", ["--tokens", "-5"], "tokens must be a positive integer (got -5)"),
    ("compare", ["--config", "{bad_yaml}"], "is not valid yaml"),
    ("compare", ["--models", "gpt"], "models must be a non-empty subset"),
    ("tasks", ["--tasks", "sorting"], "tasks must be"),
    ("tasks", ["--steps", "x"], "argument --steps: invalid int value: 'x'"),
    ("tasks", ["--config", "{missing_yaml}"], "no config file at"),
    ("simulate", ["--n", "-5"], "argument --n: expected an integer >= 8, got -5"),
    ("simulate", ["--max-log2", "3"], "expected an integer >= 10, got 3"),
    ("inspect", ["{model_yaml}", "--text", "{missing_txt}"], "No such file or directory: {missing_txt}"),
    ("inspect", ["{no_checkpoints}", "--text", "{model_yaml}"], "holds no checkpoint"),
    ("inspect", ["{missing_txt}", "--text", "{model_yaml}"], "no checkpoint folder or config file"),
    ("inspect", ["{model_yaml}", "--text", "{model_yaml}", "--hops", "0"], "expected an integer >= 1, got 0"),
    ("generate", ["{missing_txt}", "--prompt", "hi", "--max-new-tokens", "3"], "no checkpoint folder or config file"),
    ("generate", ["{no_checkpoints}", "--prompt", "hi", "--max-new-tokens", "3"], "holds no checkpoint"),
    ("generate", ["{model_yaml}", "--prompt", "", "--max-new-tokens", "3"], "the prompt is empty"),
    ("generate", ["{model_yaml}", "--prompt-file", "{empty_txt}", "--max-new-tokens", "3"],
     "the prompt file {empty_txt} is empty"),
    ("generate", ["{model_yaml}", "--prompt-file", "{missing_txt}", "--max-new-tokens", "3"],
     "No such file or directory: {missing_txt}"),
    ("generate", ["{model_yaml}", "--prompt", "a", "--prompt-file", "{model_yaml}", "--max-new-tokens", "3"],
     "argument --prompt-file: not allowed with argument --prompt"),
    ("generate", ["{model_yaml}", "--max-new-tokens", "3"], "one of the arguments --prompt --prompt-file is required"),
    ("generate", ["{model_yaml}", "--prompt", "a"], "the following arguments are required: --max-new-tokens"),
    ("generate", ["{model_yaml}", "--prompt", "a", "--max-new-tokens", "0"], "expected an integer >= 1, got 0"),
    ("generate", ["{model_yaml}", "--prompt", "a", "--max-new-tokens", "2", "--temperature", "0"],
     "argument --temperature: expected a finite number > 0, got 0"),
    ("generate", ["{model_yaml}", "--prompt", "a", "--max-new-tokens", "2", "--temperature", "hot"],
     "expected a number > 0, got 'hot'"),
    ("generate", ["{model_yaml}", "--prompt", "a", "--max-new-tokens", "2", "--top-k", "0"],
     "argument --top-k: expected an integer >= 1, got 0"),
]


@pytest.mark.parametrize("command, args, message", BAD_INPUT)
def test_bad_input_gives_one_line_and_status_2(bad_files, capsys, command, args, message):
    status, _, err = run([command, *[a.format(**bad_files) for a in args]], capsys)
    assert status == 2
    assert err.count("\n") == 1 and err.startswith(f"sheafgnn {command}: error: "), err
    assert message.format(**bad_files) in err, err


def test_every_command_has_a_bad_input_case():
    from sheafgnn.cli import DELEGATED

    assert {command for command, _, _ in BAD_INPUT} == {"demo", "build", "inspect", "generate", *DELEGATED}


def test_bad_input_in_a_fresh_process_has_no_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "sheafgnn.cli", "simulate", "--n", "-5"], cwd=tmp_path,
                          env={"PYTHONPATH": str(ROOT), "PATH": ""}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == "" and not list(tmp_path.iterdir())
    assert proc.stderr == "sheafgnn simulate: error: argument --n: expected an integer >= 8, got -5 " \
                          "(see sheafgnn simulate --help)\n"


# ---------------------------------------------------------------------------
# sheafgnn generate
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained_runs(tmp_path_factory) -> dict[str, Path]:
    """A run of every model kind, 2 training steps each on a tiny model (a few seconds)."""
    from sheafgnn.train import train

    root = tmp_path_factory.mktemp("generate")
    corpus = root / "corpus.txt"
    corpus.write_text(PROSE * 10)
    runs = {}
    attention = {"d_model": 32, "n_layers": 1, "n_heads": 2}
    sheaf = {"d_model": 32, "n_layers": 1, "headdim": 16}
    for kind, options, site in (("dense", attention, {"patch_types": []}),
                                ("local", {**attention, "window": 8}, {"patch_types": []}),
                                ("sheaf", sheaf, {"local_window": 8}), ("ssm", sheaf, {"patch_types": []})):
        runs[kind] = root / kind
        train(TrainConfig(model=kind, model_config=options, site=site, corpus=str(corpus), context=32, batch_size=2,
                          steps=2, eval_every=2, eval_batches=1, checkpoint_every=2, out_dir=str(runs[kind]),
                          num_threads=1, progress=False, tensorboard=False, device="cpu"))
    return runs


@pytest.mark.parametrize("kind", ["dense", "local", "sheaf", "ssm"])
def test_generate_prints_the_prompt_then_the_sampled_tokens(trained_runs, tmp_path, capsys, kind):
    prompt = "The cat sat on the mat. Then"
    args = ["--max-new-tokens", "40", "--temperature", "0.8", "--top-k", "20", "--seed", "7"]
    status, out, err = run(["generate", str(trained_runs[kind]), "--prompt", prompt, *args], capsys)
    assert status == 0, err
    model, tokenizer = load_model(trained_runs[kind])
    stream = model.stream()
    stream.feed(tokenizer.encode(prompt))
    ids = stream.generate(40, temperature=0.8, top_k=20, generator=torch.Generator().manual_seed(7))
    assert ids.shape == (40,)
    assert out == prompt + bytes(ids.tolist()).decode("utf-8", errors="replace") + "\n"
    assert out.startswith(prompt)
    # the same run from a prompt file and from the checkpoint step folder: the same text
    (tmp_path / "prompt.txt").write_text(prompt)
    step = sorted((trained_runs[kind] / "checkpoints").glob("step_*"))[-1]
    status, again, err = run(["generate", str(step), "--prompt-file", str(tmp_path / "prompt.txt"), *args], capsys)
    assert status == 0 and again == out, err


def test_generate_refuses_ids_out_of_vocab_and_prompts_too_long(trained_runs, capsys, monkeypatch):
    from sheafgnn import cli
    from sheafgnn.baselines import TransformerStream
    from sheafgnn.site import ByteTokenizer

    monkeypatch.setattr(TransformerStream, "max_tokens", 10)
    status, out, err = run(["generate", str(trained_runs["dense"]), "--prompt", "0123456", "--max-new-tokens", "4"],
                           capsys)
    assert status == 2 and out == "" and err.count("\n") == 1
    assert "the prompt (7 tokens) plus --max-new-tokens 4 exceeds the model's limit of 10 tokens" in err
    assert run(["generate", str(trained_runs["dense"]), "--prompt", "0123456", "--max-new-tokens", "3"],
               capsys)[0] == 0
    monkeypatch.undo()

    small = build_model("dense", {"d_model": 32, "n_layers": 1, "n_heads": 2}, 64).eval()
    monkeypatch.setattr(cli, "load_model", lambda path: (small, ByteTokenizer()))
    status, out, err = run(["generate", "anything", "--prompt", "hi ~", "--max-new-tokens", "2"], capsys)
    assert status == 2 and out == "" and err.count("\n") == 1
    assert "the prompt encodes to id 126, outside the model's 64 ids" in err


def test_generate_on_an_untrained_sheaf_config(bad_files, capsys):
    """An untrained model from a SheafStateConfig file streams too."""
    status, out, err = run(["generate", bad_files["model_yaml"], "--prompt", "The cat", "--max-new-tokens", "5",
                            "--seed", "0"], capsys)
    assert status == 0 and out.startswith("The cat") and out.endswith("\n"), err


def test_write_tokens_decodes_characters_split_across_tokens():
    import io

    from sheafgnn.cli import write_tokens
    from sheafgnn.site import ByteTokenizer

    class Recorder(io.StringIO):
        flushes: list[str] = []

        def flush(self) -> None:
            self.flushes.append(self.getvalue())

    out = Recorder()
    data = "é€a".encode() + b"\xff" + b"!"  # 2-byte, 3-byte, ASCII, invalid, ASCII
    write_tokens((torch.tensor([b]) for b in data), ByteTokenizer(), out)
    assert out.getvalue() == "é€a\ufffd!"
    assert out.flushes[:6] == ["", "é", "é", "é", "é€", "é€a"]  # each token flushed as it arrives


def test_long_result_is_the_mean_of_the_seeds_every_model_ran(tmp_path, monkeypatch):
    """Each seed's models from every folder, a later folder's run replacing an earlier one's; the mean over
    the models every seed ran; the newest folder with runs names the line, a run from another names its own."""
    from sheafgnn import cli

    def write(folder, seed, training):
        (tmp_path / folder / f"seed{seed}").mkdir(parents=True)
        (tmp_path / folder / f"seed{seed}" / "compare.json").write_text(
            json.dumps({"config": {"tokens": 8388608}, "training": training}))

    for seed, (sheaf, ssm) in enumerate([(1.95, 1.96), (1.99, 1.97)]):
        training = {"sheaf": {"val_bpb": sheaf}, "ssm": {"val_bpb": ssm}}
        write("text", seed, training | ({"dense": {"val_bpb": 1.0}} if seed else {}))  # dense: one seed only
    write("newer", 1, {"sheaf": {"val_bpb": 1.93}})  # replaces seed 1's sheaf run
    monkeypatch.setattr(cli, "LONG_RESULTS", (tmp_path / "text", tmp_path / "newer", tmp_path / "absent"))
    line = cli._long_result()
    assert "8,388,608 tokens per model, mean of 2 seed(s) (benchmarks/results/newer/)" in line
    mean, by_seed = line.split(" By seed: ")
    assert "**sheaf** (1.9400 bits/byte); then ssm 1.9650 (+0.0250)." in mean
    assert mean.endswith("Not run in every seed, so not in the mean: dense.")
    assert by_seed == ("seed0: sheaf 1.9500 (text/), ssm 1.9600 (text/); seed1: sheaf 1.9300, ssm 1.9700 (text/), "
                       "dense 1.0000 (text/).")
    monkeypatch.setattr(cli, "LONG_RESULTS", (tmp_path / "absent",))
    assert cli._long_result().endswith("is not in this checkout.")


def test_demo_compares_and_says_which_model_is_ahead(tmp_path, capsys, monkeypatch):
    """The demo at toy sizes: site statistics, a comparison of the default models, and a verdict that names the
    model ahead at its budget and where the long comparison stands (here: absent)."""
    from sheafgnn import cli

    monkeypatch.setattr(cli, "LONG_RESULTS", (tmp_path / "absent",))
    assert main(["demo", "--out", str(tmp_path), "--context", "64", "--tokens", "128", "--quick", "--in-process",
                 "--num-threads", "1"]) == 0
    verdict = (tmp_path / "verdict.md").read_text()
    report = json.loads((tmp_path / "compare" / "compare.json").read_text())
    best = min(report["training"], key=lambda kind: report["training"][kind]["val_bpb"])
    assert f"**{best}**" in verdict and "tokens per model, the demo's budget" in verdict
    assert "not in this checkout" in verdict and (tmp_path / "site_stats.json").exists()
    assert set(report["training"]) == {"sheaf", "dense_conv", "local_conv", "ssm"}
