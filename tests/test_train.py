"""The training loop: loss falls, exact resume after SIGKILL, bad checkpoints, NaN steps, DDP."""

from __future__ import annotations

import copy
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from torch import nn

from sheafgnn.baselines import CausalTransformer, TransformerConfig
from sheafgnn.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint
from sheafgnn.cli import main
from sheafgnn.data import StepSampler, WindowDataset
from sheafgnn.lm import SequenceLM, build_model
from sheafgnn.model import SheafStateConfig
from sheafgnn.optim import cosine_lr, make_optimizer, param_groups
from sheafgnn.site import ByteTokenizer, SiteBuilder, SiteConfig
from sheafgnn.train import TrainConfig, TrainingDiverged, evaluate, train, train_step

from .conftest import word_corpus

TINY = dict(d_model=32, n_layers=1, n_heads=2)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    """About 16 KB of random sentences over a small vocabulary: learnable in a few steps."""
    return word_corpus(tmp_path_factory.mktemp("corpus") / "corpus.txt", 400)


def tiny(corpus: str, out_dir: Path, **overrides) -> TrainConfig:
    values = dict(model="dense", model_config=dict(TINY), site={"patch_types": []}, corpus=corpus, context=64,
                  batch_size=4, steps=12, lr=3e-3, warmup_steps=2, eval_every=4, eval_batches=2, checkpoint_every=4,
                  log_every=1, out_dir=str(out_dir), num_threads=1, progress=False, tensorboard=False, device="cpu")
    values.update(overrides)
    return TrainConfig(**values)


# ---------------------------------------------------------------------------
# Pieces
# ---------------------------------------------------------------------------


def test_config_round_trip(tmp_path):
    config = TrainConfig(model="local", model_config={"d_model": 32, "window": 16}, site={"local_window": 8},
                         corpus="docs", tokens=10_000, context=100, batch_size=4, bf16=True)
    assert config.total_steps == 25  # ceil(10_000 / 400)
    config.save(tmp_path / "c.yaml")
    assert TrainConfig.load(tmp_path / "c.yaml") == config
    (tmp_path / "c.json").write_text(__import__("json").dumps(config.to_dict()))
    assert TrainConfig.load(tmp_path / "c.json") == config
    (tmp_path / "c.toml").write_text('model = "local"\ncorpus = "docs"\ntokens = 10000\ncontext = 100\n'
                                     'batch_size = 4\nbf16 = true\n[model_config]\nd_model = 32\nwindow = 16\n'
                                     '[site]\nlocal_window = 8\n')
    assert TrainConfig.load(tmp_path / "c.toml") == config
    text = str(config)
    assert all(f"  {name} " in text for name in config.to_dict())
    with pytest.raises(ValueError, match=r"unknown fields \['learning_rate'\]"):
        TrainConfig.from_dict({"learning_rate": 1.0})
    with pytest.raises(ValueError, match="model must be one of"):
        TrainConfig(model="gpt")
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        TrainConfig(batch_size=0)
    (tmp_path / "bad.yaml").write_text("model: [unclosed")
    with pytest.raises(ValueError, match="not valid yaml"):
        TrainConfig.load(tmp_path / "bad.yaml")


def test_step_sampler_is_a_function_of_the_step():
    full = StepSampler(10, 4, seed=3)
    it = iter(full)
    batches = [next(it) for _ in range(6)]  # 2 batches per epoch (2 windows dropped), 3 epochs
    for epoch in range(3):
        seen = batches[2 * epoch] + batches[2 * epoch + 1]
        assert len(set(seen)) == 8 and set(seen) <= set(range(10))
    assert batches[0:2] != batches[2:4]  # a new order each epoch
    resumed = iter(StepSampler(10, 4, seed=3, start_step=3))
    assert [next(resumed) for _ in range(3)] == batches[3:]
    shards = [iter(StepSampler(10, 4, seed=3, start_step=1, rank=r, world_size=2)) for r in range(2)]
    for b in batches[1:4]:
        assert next(shards[0]) + next(shards[1]) == b
    with pytest.raises(ValueError, match="fewer than batch_size"):
        StepSampler(3, 4, seed=0)
    with pytest.raises(ValueError, match="multiple of the 3 processes"):
        StepSampler(10, 4, seed=0, world_size=3)


def test_lr_schedule():
    lr = lambda step: cosine_lr(step, peak_lr=1.0, total_steps=110, warmup_steps=10, min_lr_ratio=0.1)
    assert lr(0) == pytest.approx(0.1)
    assert lr(9) == pytest.approx(1.0)
    assert lr(10) == pytest.approx(1.0)
    assert lr(60) == pytest.approx(0.55)
    assert lr(110) == pytest.approx(0.1)


def test_param_groups_decay_matrices_only():
    model = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3))
    decay, no_decay = param_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert [p.shape for p in decay["params"]] == [torch.Size([3, 4])]
    assert len(no_decay["params"]) == 3  # the linear bias, the norm's weight and bias


def test_make_optimizer_is_fused_adamw_and_agrees_with_the_loop():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3))
    reference = copy.deepcopy(model)
    fused = make_optimizer(model, lr=1e-2, weight_decay=0.1)
    loop = torch.optim.AdamW(param_groups(reference, 0.1), lr=1e-2, betas=(0.9, 0.95))
    assert fused.defaults["fused"] and not loop.defaults["fused"]
    x = torch.randn(8, 4)
    for _ in range(5):
        for net, optimizer in ((model, fused), (reference, loop)):
            net(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    for a, b in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b)


def test_train_step_clips_steps_and_skips_non_finite():
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    model.loss = lambda x: (model(x) ** 2).mean()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    before = model.weight.detach().clone()
    result = train_step(model, torch.ones(2, 3) * 100, optimizer, lr=0.5, grad_clip=1.0)
    assert result.finite and result.grad_norm > 1.0 and optimizer.param_groups[0]["lr"] == 0.5
    assert (model.weight - before).norm() <= 0.5 + 1e-6  # one SGD step of a clipped gradient
    assert all(p.grad is None for p in model.parameters())
    after = model.weight.detach().clone()
    result = train_step(model, torch.full((2, 3), float("nan")), optimizer, lr=0.5, grad_clip=1.0)
    assert not result.finite and torch.equal(model.weight, after)  # skipped


def test_every_training_loop_uses_train_step(corpus, tmp_path, monkeypatch):
    """train, the task runner and the learned-topology study each take their steps with train_step."""
    import sheafgnn.train as training
    from sheafgnn.experiments import learned_topology, synthetic, task_runner

    calls = []

    def counted(*args, **kwargs):
        calls.append(loop)
        return train_step(*args, **kwargs)

    for module in (training, task_runner, learned_topology):
        assert module.train_step is train_step  # one function, imported, not a copy
        monkeypatch.setattr(module, "train_step", counted)
    torch.set_num_threads(1)
    loop = "train"
    train(tiny(corpus, tmp_path / "run", steps=3, eval_every=3, checkpoint_every=3))
    loop = "task_runner"
    config = task_runner.TasksConfig.quick(steps=2, tasks=("induction_heads",), models=("dense",))
    spec = task_runner.task_specs(config)["induction_heads"]
    model = build_model("dense", {"d_model": 16, "n_layers": 1, "n_heads": 2}, spec.vocab_size)
    task_runner.train_task(model, spec, config, SiteConfig.from_dict(task_runner.BASELINE_SITE))
    loop = "learned_topology"
    model = learned_topology.SheafStateLM(learned_topology.learned_model_config(d_model=16, n_layers=1))
    sequences = [synthetic.generate(65, seed).ids for seed in range(2)]
    learned_topology.train_learned(model, sequences, synthetic.matched_site_config(), steps=2, window=64)
    assert calls == ["train"] * 3 + ["task_runner"] * 2 + ["learned_topology"] * 2


def test_sequence_lm_matches_the_transformer(corpus):
    torch.manual_seed(0)
    net = CausalTransformer(TransformerConfig(**TINY)).eval()
    ids = ByteTokenizer().encode(Path(corpus).read_text()[:1000])
    data = WindowDataset(ids, 64, SiteBuilder(SiteConfig(patch_types=())))
    from torch_geometric.data import Batch

    batch = Batch.from_data_list([data[0], data[1], data[2]])
    lm = SequenceLM(net)
    idx = torch.stack([ids[i * 64 : (i + 1) * 64] for i in range(3)])
    torch.testing.assert_close(lm(batch), net(idx).flatten(0, 1))
    torch.testing.assert_close(lm.loss(batch), net.loss(idx, torch.stack([ids[i * 64 + 1 : (i + 1) * 64 + 1]
                                                                           for i in range(3)])))
    assert lm.config is net.config


def test_build_model_errors():
    with pytest.raises(ValueError, match="needs model_config.window"):
        build_model("local", TINY, 256)
    with pytest.raises(ValueError, match="unknown fields"):
        build_model("dense", {"d_modle": 32}, 256)
    with pytest.raises(ValueError, match="vocab_size=100 but the tokenizer has 256"):
        build_model("dense", {"vocab_size": 100}, 256)


def test_evaluate_bits_per_byte():
    """Uniform logits: loss = ln V nats per token, bits per byte = log2 V * tokens / bytes."""

    class Uniform(nn.Module):
        def forward(self, batch):
            return torch.zeros(batch["token"].num_nodes, 256)

    from torch_geometric.data import Batch

    data = WindowDataset(torch.arange(200) % 256, 64, SiteBuilder(SiteConfig(patch_types=())))
    batch = Batch.from_data_list([data[0], data[1]])
    m = evaluate(Uniform(), [(batch, 128), (batch, 384)], torch.device("cpu"), bf16=False, world=1)
    assert m["val_loss"] == pytest.approx(math.log(256))
    assert m["val_bpb"] == pytest.approx(8.0 * 256 / 512)  # 256 tokens over 512 bytes (as for BPE)
    assert m["val_ppl"] == pytest.approx(256)


# ---------------------------------------------------------------------------
# Training runs
# ---------------------------------------------------------------------------


def test_loss_falls(corpus, tmp_path):
    result = train(tiny(corpus, tmp_path, steps=30, eval_every=10, checkpoint_every=10, tensorboard=True))
    h = result["history"]
    assert len(h) == 30 and h[30] < h[1] - 1.0, h
    assert result["val_loss"] < math.log(256) - 1.0
    assert result["val_bpb"] == pytest.approx(result["val_loss"] / math.log(2))  # byte tokenizer
    assert result["step"] == 30 and result["tokens"] == 30 * 4 * 64 and result["skipped_steps"] == 0
    rows = (tmp_path / "metrics.csv").read_text().splitlines()
    assert rows[0].startswith("step,tokens,loss,lr") and len(rows) == 31
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert TrainConfig.load(tmp_path / "config.yaml") == tiny(corpus, tmp_path, steps=30, eval_every=10,
                                                               checkpoint_every=10, tensorboard=True)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step_000020", "step_000030"]


@pytest.mark.parametrize("kind", ["local", "sheaf", "ssm"])
def test_every_model_kind_trains(corpus, tmp_path, kind):
    sheaf = dict(d_model=32, n_layers=1, ssm={"headdim": 16, "chunk_size": 16})
    options = {"local": dict(TINY, window=16), "sheaf": sheaf, "ssm": sheaf}[kind]
    site = {"patch_types": []} if kind == "local" else {"local_window": 8}
    result = train(tiny(corpus, tmp_path, model=kind, model_config=options, site=site, steps=3, eval_every=3,
                        eval_batches=1))
    assert all(math.isfinite(v) for v in result["history"].values()) and math.isfinite(result["val_bpb"])
    state = torch.load(tmp_path / "checkpoints" / "step_000003" / "state.pt", weights_only=True)
    if kind != "local":
        assert state["model_config"]["gluing"]["mode"] == (SheafStateConfig().gluing.mode if kind == "sheaf" else "off")
        assert state["model_config"]["site"] == SiteConfig.from_dict(site).to_dict()


def test_bpe_tokenizer_run(corpus, tmp_path):
    result = train(tiny(corpus, tmp_path, tokenizer="bpe", bpe_vocab_size=300, steps=2, eval_every=2))
    assert (tmp_path / "tokenizer.json").exists()
    # a BPE token covers at least one byte, so bits per byte <= bits per token
    assert result["val_bpb"] < result["val_loss"] / math.log(2)


# ---------------------------------------------------------------------------
# Checkpoints and exact resume
# ---------------------------------------------------------------------------

# Trains the config at argv[1] and hangs, for the test to SIGKILL it, in the second checkpoint's write: with
# argv[3] == "pointer" when the checkpoint is complete on disk and its pointer not yet moved; with "weights"
# when its weights are half written in step_N.tmp. argv[2]: a file written once it hangs.
DRIVER = """
import pathlib, sys, time
import safetensors.torch
import sheafgnn.checkpoint as ck
from sheafgnn.train import main_train

calls = [0]
def hang_at_the_second(name):
    calls[0] += 1
    if calls[0] == 2:
        pathlib.Path(sys.argv[2]).write_text(name)
        time.sleep(600)

real_latest, real_save_model = ck.write_latest, safetensors.torch.save_model
def write_latest(ckpt_dir, name):
    hang_at_the_second(name)
    real_latest(ckpt_dir, name)
def save_model(model, filename, *args, **kwargs):
    real_save_model(model, filename, *args, **kwargs)
    data = pathlib.Path(filename).read_bytes()
    pathlib.Path(filename).write_bytes(data[: len(data) // 2])  # as if the kill came halfway through
    hang_at_the_second(filename)
    pathlib.Path(filename).write_bytes(data)
if sys.argv[3] == "pointer":
    ck.write_latest = write_latest
else:
    safetensors.torch.save_model = save_model
sys.exit(main_train(["--config", sys.argv[1]]))
"""

SHEAF = dict(d_model=32, n_layers=1, headdim=16, chunk_size=16)


@pytest.mark.slow
@pytest.mark.parametrize("kind, kill", [("dense", "pointer"), ("sheaf", "pointer"), ("sheaf", "weights")])
def test_sigkill_then_resume_equals_uninterrupted_run(corpus, tmp_path, kind, kill):
    """SIGKILL in the second checkpoint's write (after it, before its pointer moved; halfway through its weights):
    the first checkpoint loads, and the resumed run's losses and weights equal an uninterrupted run's, bitwise."""
    # dense: dropout, so the RNG state must come back too; sheaf: every default patch type, the learned topology
    options, site = (dict(TINY, dropout=0.1), {"patch_types": []}) if kind == "dense" else (SHEAF, {"local_window": 8})
    full = train(tiny(corpus, tmp_path / "full", model=kind, model_config=options, site=site))

    killed = tiny(corpus, tmp_path / "killed", model=kind, model_config=options, site=site)
    killed.save(tmp_path / "killed.yaml")
    marker = tmp_path / "hung"
    proc = subprocess.Popen([sys.executable, "-c", DRIVER, str(tmp_path / "killed.yaml"), str(marker), kill],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120  # imports and 8 steps; a loaded 2-core machine is slow
    while not marker.exists():
        if proc.poll() is not None:
            pytest.fail(f"the run ended before it was killed:\n{proc.communicate()[1][-3000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail("the run did not reach its second checkpoint in 120 s")
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    ckpt_dir = tmp_path / "killed" / "checkpoints"
    assert latest_checkpoint(ckpt_dir).name == "step_000004"  # step 8 was never published
    if kill == "pointer":
        assert (ckpt_dir / "step_000008" / "state.pt").exists()
    else:
        assert not (ckpt_dir / "step_000008").exists() and not (ckpt_dir / "step_000008.tmp" / "state.pt").exists()
        assert (ckpt_dir / "step_000008.tmp" / "model.safetensors").stat().st_size > 0
    model = build_model(kind, options, 256, site)
    assert load_checkpoint(latest_checkpoint(ckpt_dir), model)["step"] == 4

    resumed = train(killed, resume=True)
    assert sorted(resumed["history"]) == list(range(5, 13))
    assert resumed["history"] == {step: full["history"][step] for step in range(5, 13)}  # bitwise
    assert resumed["val_loss"] == full["val_loss"]
    assert not list(ckpt_dir.glob("*.tmp"))
    a = load_file(tmp_path / "full" / "checkpoints" / "step_000012" / "model.safetensors")
    b = load_file(ckpt_dir / "step_000012" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    rows = (tmp_path / "killed" / "metrics.csv").read_text().splitlines()
    assert [int(r.split(",")[0]) for r in rows[1:]] == list(range(1, 13))  # no duplicate rows from the killed run


@pytest.fixture(scope="module")
def trained_run(corpus, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("trained")
    train(tiny(corpus, out, steps=4, checkpoint_every=2))
    return out


def _copy(run: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(run, out)
    return out


@pytest.mark.parametrize("damage, message", [
    ("truncate_weights", "corrupt: its SHA-256 does not match"),
    ("truncate_state", "corrupt or unreadable"),
    ("delete_state", "incomplete: state.pt is missing"),
    ("bad_pointer", "not a checkpoint directory"),
])
def test_corrupt_checkpoint_gives_a_clear_error(corpus, trained_run, tmp_path, capsys, damage, message):
    out = _copy(trained_run, tmp_path)
    step = out / "checkpoints" / "step_000004"
    if damage == "truncate_weights":
        data = (step / "model.safetensors").read_bytes()
        (step / "model.safetensors").write_bytes(data[: len(data) // 2])
    elif damage == "truncate_state":
        data = (step / "state.pt").read_bytes()
        (step / "state.pt").write_bytes(data[: len(data) // 2])
    elif damage == "delete_state":
        (step / "state.pt").unlink()
    else:
        (out / "checkpoints" / "latest").write_text("step_000099\n")
    config = tiny(corpus, out, steps=6, checkpoint_every=2)
    with pytest.raises(CheckpointError, match=message):
        train(config, resume=True)
    config.save(tmp_path / "config.yaml")
    assert main(["train", "--config", str(tmp_path / "config.yaml"), "--resume"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("sheafgnn train: error:") and message.split(":")[0] in err and err.count("\n") == 1


def test_mismatched_checkpoint_gives_a_clear_error(corpus, trained_run, tmp_path):
    out = _copy(trained_run, tmp_path)
    with pytest.raises(CheckpointError, match=r"model_config.d_model: 32 \(checkpoint\) vs 48 \(now\)"):
        train(tiny(corpus, out, steps=6, checkpoint_every=2, model_config=dict(TINY, d_model=48)), resume=True)
    with pytest.raises(CheckpointError, match="already holds checkpoints; pass --resume"):
        train(tiny(corpus, out, steps=6, checkpoint_every=2))
    with pytest.raises(CheckpointError, match="nothing to resume"):
        train(tiny(corpus, tmp_path / "empty"), resume=True)
    # what may change on resume: the length of the run, the learning rate, logging
    result = train(tiny(corpus, out, steps=6, checkpoint_every=2, lr=1e-3, log_every=3), resume=True)
    assert sorted(result["history"]) == [5, 6]


# ---------------------------------------------------------------------------
# Non-finite losses
# ---------------------------------------------------------------------------


class NaNAt(nn.Module):
    """A model whose loss is NaN on the given (1-based) calls of ``loss``."""

    def __init__(self, inner: nn.Module, bad_calls) -> None:
        super().__init__()
        self.inner, self.config, self.bad_calls, self.calls = inner, inner.config, bad_calls, 0

    def forward(self, batch):
        return self.inner(batch)

    def loss(self, batch):
        self.calls += 1
        loss = self.inner.loss(batch)
        return loss * float("nan") if self.calls in self.bad_calls else loss


def _nan_model(bad_calls) -> NaNAt:
    torch.manual_seed(0)
    return NaNAt(build_model("dense", TINY, 256), bad_calls)


def test_nan_steps_are_skipped(corpus, tmp_path):
    with pytest.warns(RuntimeWarning) as record:
        result = train(tiny(corpus, tmp_path, steps=8), model=_nan_model({3, 4}))
    messages = [str(w.message) for w in record]
    assert len(messages) == 2 and messages[0].startswith("step 3: non-finite loss nan")
    assert messages[1].endswith("step skipped (2 in a row, max_bad_steps=5)")
    assert result["skipped_steps"] == 2 and math.isnan(result["history"][3]) and math.isfinite(result["history"][8])
    # steps 3 and 4 made no update; step 4's checkpoint was postponed
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*")) == ["step_000008"]
    state = torch.load(tmp_path / "checkpoints" / "step_000008" / "state.pt", weights_only=True)
    assert all(s["step"].item() == 6 for s in state["optimizer"]["state"].values())


def test_nan_streak_stops_the_run_and_keeps_the_last_good_checkpoint(corpus, tmp_path):
    model = _nan_model(set(range(6, 100)))
    with pytest.warns(RuntimeWarning, match="non-finite"):
        with pytest.raises(TrainingDiverged, match=r"stopped at step 8: 3 non-finite losses in a row .*step_000004"):
            train(tiny(corpus, tmp_path, steps=20, max_bad_steps=3), model=model)
    good = latest_checkpoint(tmp_path / "checkpoints")
    assert good.name == "step_000004"
    assert load_checkpoint(good, _nan_model(set()))["step"] == 4


# ---------------------------------------------------------------------------
# Two processes (gloo)
# ---------------------------------------------------------------------------


def _ddp_worker(rank: int, world: int, port: int, values: dict, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    config = TrainConfig.from_dict(values)
    torch.manual_seed(config.seed)
    model = build_model(config.model, config.model_config, 256, config.site)
    result = train(config, model=model)
    torch.save({"history": result["history"], "params": model.state_dict()}, f"{out}/rank{rank}.pt")


@pytest.mark.slow
def test_two_process_gloo_ddp_matches_one_process(corpus, tmp_path):
    config = tiny(corpus, tmp_path / "single", steps=5, eval_every=5, checkpoint_every=5)
    torch.manual_seed(config.seed)
    single_model = build_model(config.model, config.model_config, 256, config.site)
    single = train(config, model=single_model)

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    values = tiny(corpus, tmp_path / "ddp", steps=5, eval_every=5, checkpoint_every=5).to_dict()
    torch.multiprocessing.spawn(_ddp_worker, args=(2, port, values, str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]

    p0, p1 = ranks[0]["params"], ranks[1]["params"]
    assert all(torch.equal(p0[k], p1[k]) for k in p0)  # identical on both ranks
    for k, v in single_model.state_dict().items():
        torch.testing.assert_close(p0[k], v, atol=1e-5, rtol=1e-4)
    assert ranks[0]["history"] == ranks[1]["history"]  # the loss is all-reduced
    for step, loss in single["history"].items():
        assert ranks[0]["history"][step] == pytest.approx(loss, abs=1e-5)
    assert (tmp_path / "ddp" / "checkpoints" / "step_000005").is_dir()
    with open(tmp_path / "ddp" / "config.yaml") as f:
        assert yaml.safe_load(f)["batch_size"] == 4


def test_data_order_does_not_depend_on_workers(corpus, tmp_path):
    runs = [train(tiny(corpus, tmp_path / str(w), steps=3, eval_every=3, num_workers=w)) for w in (0, 2)]
    assert runs[0]["history"] == runs[1]["history"] and runs[0]["val_loss"] == runs[1]["val_loss"]
