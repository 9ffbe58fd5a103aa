"""Training: the one training toolkit, and the loop for the sheaf model and the baselines.

The toolkit, used by every training loop of the project (this one, the task
runner and the learned-topology study in :mod:`sheafgnn.experiments`), with the
optimizer and schedule of :mod:`sheafgnn.optim` (``make_optimizer``, ``cosine_lr``)::

    train_step(model, batch, optimizer, lr=, grad_clip=) -> StepResult
        set lr, loss, backward, clip, step unless non-finite, zero the gradients

The loop::

    sheafgnn train --config run.yaml [--set KEY=VALUE ...] [--resume]   one process
    torchrun --nproc_per_node 2 -m sheafgnn.cli train --config run.yaml   DDP (gloo on CPU, NCCL on GPU)

    TrainConfig -> corpus -> tokenizer -> ids -> WindowDataset (sites)
                -> DataLoader(batch_sampler=StepSampler)       global batch split over ranks
                -> model (lm.build_model) -> DDP -> train_step: make_optimizer, cosine_lr, clipping, bf16
                -> every eval_every: validation loss, bits per byte, perplexity
                -> every checkpoint_every: checkpoint (sheafgnn.checkpoint), rank 0 only
    out_dir/config.yaml  metrics.csv  tb/  checkpoints/step_N/  checkpoints/latest

``step`` counts the global batches consumed (a skipped non-finite step counts
too). Batch ``s`` is a pure function of (seed, s): the windows of epoch
``e = s // batches_per_epoch`` are permuted by a generator seeded with
(seed, e), so a checkpoint needs only ``step`` to resume the data exactly.
"""

from __future__ import annotations

import csv
import json
import math
import os
import time
import warnings
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import AdamW
from torch.utils.data import Subset
from torch_geometric.loader import DataLoader
from tqdm import tqdm

from sheafgnn import checkpoint as ckpt
from sheafgnn.config import ArgumentParser, ConfigFile
from sheafgnn.data import KINDS, StepSampler, WindowDataset, scored_batches, train_validation_text
from sheafgnn.lm import MODEL_KINDS, build_model, config_dict
from sheafgnn.memory import process_peak_bytes, tune_cpu
from sheafgnn.optim import cosine_lr, make_optimizer
from sheafgnn.optional import require
from sheafgnn.site import BPETokenizer, ByteTokenizer, SiteBuilder, SiteConfig

# Fields that fix the model, the data and its order: a resumed run must match them.
FROZEN = ("model", "model_config", "site", "corpus", "tokenizer", "bpe_vocab_size", "context", "batch_size", "seed")


class TrainingDiverged(RuntimeError):
    """Too many non-finite losses in a row."""


@dataclass
class TrainConfig(ConfigFile):
    """A training run. Loads from YAML/TOML/JSON (:meth:`load`); ``print(config)`` shows every field."""

    model: str = "sheaf"  # sheaf | dense | local | ssm (sheaf with gluing off)
    model_config: dict = field(default_factory=dict)  # fields of SheafStateConfig / TransformerConfig
    site: dict = field(default_factory=dict)  # SiteConfig fields: how windows become sites
    corpus: str = "mixed"  # docs | code | mixed (embedded corpus) or a UTF-8 text file (last 10% held out)
    tokenizer: str = "byte"  # byte | bpe (trained on the train split, saved in out_dir) | path of a BPE json
    bpe_vocab_size: int = 4096  # vocabulary of a tokenizer trained by tokenizer: bpe
    context: int = 256  # tokens per window (the sequence length T)
    batch_size: int = 16  # windows per optimizer step, summed over all processes
    steps: int = 1000  # optimizer steps; ignored when tokens is set
    tokens: int | None = None  # token budget: steps = ceil(tokens / (batch_size * context))
    lr: float = 1e-3  # peak learning rate, reached after warmup_steps
    min_lr_ratio: float = 0.1  # the cosine decays to lr * min_lr_ratio at the last step
    warmup_steps: int = 100  # linear warm-up from lr / warmup_steps
    weight_decay: float = 0.1  # AdamW decay on matrices (not on biases, norms)
    beta1: float = 0.9  # AdamW betas
    beta2: float = 0.95
    grad_clip: float = 1.0  # clip the global gradient norm to this; 0: no clipping
    bf16: bool = False  # bfloat16 autocast for forward and loss (CPU or CUDA)
    seed: int = 0  # model init, data order and dropout
    deterministic: bool = True  # deterministic kernels (torch.use_deterministic_algorithms, warn only)
    eval_every: int = 200  # validate every this many steps, and at the end
    eval_batches: int = 20  # validation batches of batch_size windows (the same ones each time)
    checkpoint_every: int = 200  # checkpoint every this many steps, and at the end
    keep_checkpoints: int = 2  # newest checkpoints kept; 0: keep all
    max_bad_steps: int = 5  # stop after this many non-finite losses in a row
    log_every: int = 10  # steps between CSV / TensorBoard rows and progress-bar updates
    out_dir: str = "runs/train"  # config.yaml, metrics.csv, tb/, checkpoints/
    num_workers: int = 0  # DataLoader workers building sites
    num_threads: int = 0  # torch CPU threads per process; 0: torch's default
    device: str = "auto"  # auto (cuda if present) | cpu | cuda
    ddp_find_unused: bool = False  # DDP find_unused_parameters: set if a step can leave parameters without gradient
    tensorboard: bool = True  # also write TensorBoard events to out_dir/tb
    progress: bool = True  # show a tqdm bar (rank 0)

    def __post_init__(self) -> None:
        if self.model not in MODEL_KINDS:
            raise ValueError(f"TrainConfig: model must be one of {MODEL_KINDS} (got {self.model!r})")
        for name in ("context", "batch_size", "steps", "eval_every", "eval_batches", "checkpoint_every",
                     "max_bad_steps", "log_every", "bpe_vocab_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"TrainConfig: {name} must be a positive integer (got {value!r})")
        for name in ("warmup_steps", "keep_checkpoints", "num_workers", "num_threads", "seed"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"TrainConfig: {name} must be a non-negative integer (got {value!r})")
        if self.tokens is not None and self.tokens < 1:
            raise ValueError(f"TrainConfig: tokens must be None or positive (got {self.tokens})")
        if not (self.lr > 0 and 0 <= self.min_lr_ratio <= 1 and self.weight_decay >= 0 and self.grad_clip >= 0):
            raise ValueError(f"TrainConfig: need lr > 0, 0 <= min_lr_ratio <= 1, weight_decay >= 0, grad_clip >= 0 "
                             f"(got {self.lr}, {self.min_lr_ratio}, {self.weight_decay}, {self.grad_clip})")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"TrainConfig: device must be auto, cpu or cuda (got {self.device!r})")
        if self.corpus not in KINDS and not Path(self.corpus).is_file():
            raise ValueError(f"TrainConfig: corpus must be one of {KINDS} or an existing text file "
                             f"(got {self.corpus!r})")
        SiteConfig.from_dict(self.site)  # validate early

    @property
    def total_steps(self) -> int:
        """Optimizer steps of the whole run (from ``tokens`` when set)."""
        return self.steps if self.tokens is None else math.ceil(self.tokens / (self.batch_size * self.context))


# ---------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------


def load_tokenizer(config: TrainConfig, train_text: str | None = None):
    """The run's tokenizer; ``bpe`` is trained once and kept in ``out_dir/tokenizer.json``."""
    if config.tokenizer == "byte":
        return ByteTokenizer()
    path = Path(config.out_dir) / "tokenizer.json" if config.tokenizer == "bpe" else Path(config.tokenizer)
    if config.tokenizer == "bpe" and not path.exists():
        if train_text is None:  # not rank 0: wait for it
            raise ValueError(f"load_tokenizer: {path} is missing")
        path.parent.mkdir(parents=True, exist_ok=True)
        BPETokenizer.train(train_text.split("\n\n"), config.bpe_vocab_size).save(path)
    if not path.is_file():
        raise ValueError(f"TrainConfig: tokenizer must be byte, bpe or a BPE tokenizer file (no file at {path})")
    return BPETokenizer.load(path)


def build_datasets(config: TrainConfig, rank: int = 0, world: int = 1) -> tuple[object, dict[str, WindowDataset]]:
    """The tokenizer and the ``train`` / ``validation`` window datasets of ``config``.

    With ``tokenizer: bpe`` rank 0 trains the tokenizer (once per out_dir) while
    the other ranks wait.
    """
    train_text, val_text = train_validation_text(config.corpus)
    tokenizer = load_tokenizer(config, train_text) if rank == 0 else None
    if world > 1 and config.tokenizer == "bpe":
        dist.barrier()
    if tokenizer is None:
        tokenizer = load_tokenizer(config)
    builder = SiteBuilder(SiteConfig.from_dict(config.site), tokenizer)
    datasets = {}
    for split, text in (("train", train_text), ("validation", val_text)):
        ids = tokenizer.encode(text)
        if ids.numel() <= config.context:
            raise ValueError(f"the {split} split of corpus {config.corpus!r} has {ids.numel()} tokens, "
                             f"not enough for one window of context {config.context}")
        datasets[split] = WindowDataset(ids, config.context, builder)
    return tokenizer, datasets


# ---------------------------------------------------------------------------
# Schedule, evaluation, distributed plumbing
# ---------------------------------------------------------------------------


@dataclass
class StepResult:
    """What :func:`train_step` did."""

    loss: float  # the batch's loss (mean over processes)
    grad_norm: float  # global gradient norm before clipping
    finite: bool  # False: the loss or the gradient norm was not finite and the update was skipped


def train_step(model: nn.Module, batch, optimizer: torch.optim.Optimizer, *, lr: float, grad_clip: float,
               loss_fn: Callable | None = None, bf16: bool = False, world: int = 1) -> StepResult:
    """One optimizer step, the one every training loop of the project takes.

    Sets ``lr`` on every parameter group; computes ``loss_fn(batch)`` (default:
    ``model.loss``, e.g. a DDP-wrapped module instead), under bfloat16 autocast
    with ``bf16``; back-propagates; clips the global gradient norm of
    ``model``'s parameters to ``grad_clip`` (0: no clipping); steps the
    optimizer unless the loss or the gradient norm is not finite (the update
    is skipped); zeroes the gradients. With ``world`` > 1 processes the
    reported loss is their mean. ``batch`` is already on the model's device.
    """
    for group in optimizer.param_groups:
        group["lr"] = lr
    device_type = next(model.parameters()).device.type
    with torch.autocast(device_type, dtype=torch.bfloat16, enabled=bf16):
        loss = (loss_fn or model.loss)(batch)
    loss.backward()  # always, so every rank joins DDP's gradient all-reduce
    grad_norm = nn.utils.clip_grad_norm_(model.parameters(), grad_clip or math.inf).item()
    loss_value = (_all_sum(loss.detach().float().clone(), world) / world).item()
    finite = math.isfinite(loss_value) and math.isfinite(grad_norm)
    if finite:  # the same decision on every rank: the loss is all-reduced, the gradients too
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return StepResult(loss_value, grad_norm, finite)


def _all_sum(t: Tensor, world: int) -> Tensor:
    if world > 1:
        dist.all_reduce(t)
    return t


@torch.no_grad()
def evaluate(model: nn.Module, batches: list, device: torch.device, bf16: bool, world: int) -> dict[str, float]:
    """Validation loss (nats/token), bits per byte and perplexity over ``batches``.

    ``batches`` holds (batch, target bytes) pairs; bits per byte = total nats /
    ln 2 / total bytes of the targets (equal to loss / ln 2 for the byte tokenizer).
    """
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # nats, tokens, bytes
    for batch, num_bytes in batches:
        batch = batch.to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            logits = model(batch)  # (num_tokens, V)
        y = batch["token"].y
        nats = nn.functional.cross_entropy(logits.float(), y, ignore_index=-100, reduction="sum")
        totals += torch.stack([nats.double(), (y != -100).sum().double(), totals.new_tensor(num_bytes)])
    model.train()
    nats, tokens, num_bytes = _all_sum(totals, world).tolist()
    loss = nats / max(tokens, 1)
    return {"val_loss": loss, "val_bpb": nats / math.log(2) / max(num_bytes, 1), "val_ppl": math.exp(min(loss, 700))}


class _Loss(nn.Module):
    """``model.loss`` as ``forward``, so DDP sees the call that builds the graph."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, batch) -> Tensor:
        return self.model.loss(batch)


def resolve_device(name: str) -> torch.device:
    """``auto`` (CUDA if present, else CPU), ``cpu`` or ``cuda`` -> the device."""
    cuda = name == "cuda" or (name == "auto" and torch.cuda.is_available())
    return torch.device("cuda" if cuda else "cpu")


def _distributed(config: TrainConfig) -> tuple[int, int, torch.device]:
    """(rank, world size, device); joins the process group when launched by torchrun."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cuda = resolve_device(config.device).type == "cuda"
    if world == 1:
        return 0, 1, torch.device("cuda" if cuda else "cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    return dist.get_rank(), world, torch.device(f"cuda:{local_rank}" if cuda else "cpu")


@contextmanager
def _process_settings(config: TrainConfig):
    """Threads and determinism for the run; the previous settings come back afterwards."""
    threads, det = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    tune_cpu()  # allocator and oneDNN cache settings (sheafgnn.memory)
    if config.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(det, warn_only=warn_only)


class _Log:
    """metrics.csv and TensorBoard; on rank 0 only (``enabled``)."""

    COLUMNS = ("step", "tokens", "loss", "lr", "grad_norm", "tokens_per_s", "skipped",
               "val_loss", "val_bpb", "val_ppl", "elapsed_s")

    def __init__(self, out_dir: Path, start_step: int, enabled: bool, tensorboard: bool) -> None:
        self.enabled, self.tb = enabled, None
        if not enabled:
            return
        path = out_dir / "metrics.csv"
        kept = []  # rows up to the resumed step; later ones were lost with the killed run
        if start_step > 0 and path.exists():
            with open(path, newline="") as f:
                kept = [r for r in csv.DictReader(f) if int(r["step"]) <= start_step]
        self.file = open(path, "w", newline="")
        self.csv = csv.DictWriter(self.file, self.COLUMNS)
        self.csv.writeheader()
        self.csv.writerows(kept)
        if tensorboard:
            SummaryWriter = require("torch.utils.tensorboard", "TrainConfig.tensorboard",
                                    otherwise="set tensorboard: false").SummaryWriter
            self.tb = SummaryWriter(str(out_dir / "tb"), purge_step=start_step + 1 if start_step else None)

    def write(self, row: dict) -> None:
        if not self.enabled:
            return
        self.csv.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in row.items()})
        self.file.flush()
        if self.tb is not None:
            for key, value in row.items():
                if key not in ("step", "tokens", "skipped") and value is not None:
                    self.tb.add_scalar(key, value, row["step"])

    def close(self) -> None:
        if self.enabled:
            self.file.close()
            if self.tb is not None:
                self.tb.close()


def _diff(saved: dict, current: dict, prefix: str = "") -> list[str]:
    out = []
    for key in sorted(set(saved) | set(current)):
        a, b = saved.get(key), current.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _diff(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}: {a!r} (checkpoint) vs {b!r} (now)")
    return out


def _check_resume(state: dict, config: TrainConfig, model: nn.Module, path: Path) -> None:
    saved = {k: state["config"].get(k) for k in FROZEN}
    diffs = _diff(saved, {k: getattr(config, k) for k in FROZEN})
    diffs += _diff(state["model_config"], config_dict(model), "model.config.")
    if diffs:
        raise ckpt.CheckpointError(f"checkpoint {path} was written by a different run: " + "; ".join(diffs[:8])
                                   + ". Resume with the config that wrote it, or start a new out_dir.")


# ---------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------


def train(config: TrainConfig, *, resume: bool = False, model: nn.Module | None = None) -> dict:
    """Train ``config.model`` on ``config.corpus``; return the final metrics.

    Args:
        config (TrainConfig): the run.
        resume (bool): continue from ``out_dir/checkpoints/latest`` exactly.
        model (nn.Module, optional): train this model instead of building one
            from ``config`` (it is trained in place).

    Returns:
        dict with ``step``, ``tokens``, ``train_loss`` (the last step's), ``train_loss_smoothed``
        (the mean over the last 10% of this invocation's steps: one batch's loss is noisy and may be
        an easy batch), ``val_loss``, ``val_bpb``, ``val_ppl``, ``tokens_per_s``, ``elapsed_s``,
        ``params``, ``skipped_steps``, ``checkpoint`` and ``history`` (step -> training loss, this invocation).

    Raises:
        CheckpointError: nothing to resume, or a corrupt or mismatched checkpoint.
        TrainingDiverged: ``max_bad_steps`` non-finite losses in a row.
    """
    with _process_settings(config):
        rank, world, device = _distributed(config)
        try:
            return _train(config, resume, model, rank, world, device)
        finally:
            if world > 1 and dist.is_initialized():
                dist.destroy_process_group()


def _train(config: TrainConfig, resume: bool, model: nn.Module | None, rank: int, world: int,
           device: torch.device) -> dict:
    master = rank == 0
    out_dir = Path(config.out_dir)
    latest = _checkpoint_to_resume(out_dir / "checkpoints", resume)
    if master:
        out_dir.mkdir(parents=True, exist_ok=True)
        print(config)
    tokenizer, datasets = build_datasets(config, rank, world)
    model, optimizer, step, metrics = _model_and_optimizer(config, model, tokenizer.vocab_size, latest, device,
                                                           rank, world)
    bad, checkpoint_path = 0, latest
    n_params = sum(p.numel() for p in model.parameters())
    if master:
        print(f"{config.model}: {n_params:,} parameters, {config.total_steps} steps of {config.batch_size} x "
              f"{config.context} tokens, {world} process(es) on {device}"
              + (f", resuming at step {step}" if step else ""))
        config.save(out_dir / "config.yaml")
    loader, val_loader = _loaders(config, datasets, step, rank, world, device)
    val_batches = None  # built on first use, then reused: the same windows every time
    loss_fn = _Loss(model) if world == 1 else nn.parallel.DistributedDataParallel(
        _Loss(model), find_unused_parameters=config.ddp_find_unused)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    log = _Log(out_dir, step, master, config.tensorboard)
    bar = tqdm(total=config.total_steps, initial=step, disable=not (master and config.progress), dynamic_ncols=True)
    tokens_per_step = config.batch_size * config.context
    history, skipped = {}, 0
    t_start = t_last = time.perf_counter()
    step_last = step
    model.train()
    try:
        for batch in loader:
            if step >= config.total_steps:
                break
            lr = _lr(step, config)
            result = train_step(model, batch.to(device, non_blocking=True), optimizer, lr=lr,
                                grad_clip=config.grad_clip, loss_fn=loss_fn, bf16=config.bf16, world=world)
            step += 1
            bad = 0 if result.finite else bad + 1
            skipped += not result.finite
            if bad:
                _warn_bad_step(step, result, bad, config, master, checkpoint_path)
            history[step] = result.loss
            bar.update(1)
            # -- evaluate, log, checkpoint --------------------------------------------------------------
            last = step == config.total_steps
            row = {"step": step, "tokens": step * tokens_per_step, "loss": result.loss, "lr": lr,
                   "grad_norm": result.grad_norm, "skipped": int(bad > 0)}
            if step % config.eval_every == 0 or last:
                if val_batches is None:
                    val_batches = scored_batches(val_loader, tokenizer)
                metrics = evaluate(model, val_batches, device, config.bf16, world)
                row.update(metrics)
                if master:
                    bar.write(f"step {step}: val loss {metrics['val_loss']:.4f}, {metrics['val_bpb']:.4f} "
                              f"bits/byte, ppl {metrics['val_ppl']:.2f}")
            if step % config.log_every == 0 or last or "val_loss" in row:
                now = time.perf_counter()
                row["tokens_per_s"] = (step - step_last) * tokens_per_step / max(now - t_last, 1e-9)
                row["elapsed_s"] = now - t_start
                t_last, step_last = now, step
                bar.set_postfix(loss=f"{result.loss:.4f}", tok_s=f"{row['tokens_per_s']:.0f}", lr=f"{lr:.2e}")
                log.write(row)
            if (step % config.checkpoint_every == 0 or last) and bad == 0:  # never checkpoint mid-divergence
                checkpoint_path = _save(config, step, model, optimizer, metrics, rank, world) or checkpoint_path
    finally:
        bar.close()
        log.close()
    elapsed = time.perf_counter() - t_start
    tail = list(history.values())[-max(1, len(history) // 10):]
    return {"step": step, "tokens": step * tokens_per_step, "train_loss": history.get(step, math.nan),
            "train_loss_smoothed": sum(tail) / len(tail) if history else math.nan,
            **metrics, "tokens_per_s": len(history) * tokens_per_step / max(elapsed, 1e-9), "elapsed_s": elapsed,
            "peak_memory_bytes": process_peak_bytes(device), "params": n_params, "skipped_steps": skipped,
            "checkpoint": str(checkpoint_path or ""), "history": history}


def _lr(step: int, config: TrainConfig) -> float:
    """The run's learning rate at update ``step``: :func:`cosine_lr` with the config's numbers."""
    return cosine_lr(step, peak_lr=config.lr, total_steps=config.total_steps, warmup_steps=config.warmup_steps,
                     min_lr_ratio=config.min_lr_ratio)


def _checkpoint_to_resume(ckpt_dir: Path, resume: bool) -> Path | None:
    """The checkpoint to resume (None for a fresh run); refuses a resume without one, a fresh run over one."""
    latest = ckpt.latest_checkpoint(ckpt_dir)
    if resume and latest is None:
        raise ckpt.CheckpointError(f"nothing to resume: no checkpoint in {ckpt_dir}")
    if not resume and latest is not None:
        raise ckpt.CheckpointError(f"{ckpt_dir.parent} already holds checkpoints; pass --resume to continue that "
                                   "run or choose another out_dir")
    return latest


def _model_and_optimizer(config: TrainConfig, model: nn.Module | None, vocab_size: int, latest: Path | None,
                         device: torch.device, rank: int, world: int) -> tuple[nn.Module, AdamW, int, dict]:
    """The model (built from ``config`` unless given) and its AdamW on ``device``, at checkpoint ``latest``
    when resuming. Returns (model, optimizer, step, metrics)."""
    torch.manual_seed(config.seed)  # the same initial weights on every rank
    model = (model if model is not None else build_model(config.model, config.model_config, vocab_size,
                                                         config.site)).to(device)
    optimizer = make_optimizer(model, lr=config.lr, weight_decay=config.weight_decay,
                               betas=(config.beta1, config.beta2))
    torch.manual_seed(config.seed + rank)  # dropout streams differ between ranks
    if latest is None:
        return model, optimizer, 0, {}
    return model, optimizer, *_resume(latest, config, model, optimizer, device, rank, world)


def _resume(latest: Path, config: TrainConfig, model: nn.Module, optimizer: torch.optim.Optimizer,
            device: torch.device, rank: int, world: int) -> tuple[int, dict]:
    """Load the model, optimizer and RNG state of checkpoint ``latest``; return its (step, metrics)."""
    state = ckpt.load_checkpoint(latest, model, device, check=lambda s: _check_resume(s, config, model, latest))
    try:
        optimizer.load_state_dict(state["optimizer"])
    except (ValueError, KeyError) as err:
        raise ckpt.CheckpointError(f"checkpoint {latest}: optimizer state does not fit ({err})") from None
    step = state["step"]
    if len(state["rng"]) == world:
        ckpt.set_rng_state(state["rng"][rank])
    else:
        warnings.warn(f"resuming {len(state['rng'])}-process RNG state in {world} processes: data order is "
                      "exact, dropout is reseeded", RuntimeWarning, stacklevel=5)
        torch.manual_seed(config.seed + rank + 7919 * step)
    return step, state["metrics"]


def _loaders(config: TrainConfig, datasets: dict[str, WindowDataset], step: int, rank: int, world: int,
             device: torch.device) -> tuple[DataLoader, DataLoader]:
    """This rank's training loader from ``step`` on and its share of the validation windows."""
    loader_args = dict(num_workers=config.num_workers, pin_memory=device.type == "cuda",
                       generator=torch.Generator().manual_seed(config.seed))  # keeps the global RNG untouched
    sampler = StepSampler(len(datasets["train"]), config.batch_size, config.seed, step, rank, world)
    loader = DataLoader(datasets["train"], batch_sampler=sampler, **loader_args)
    val = datasets["validation"]
    n_val = min(len(val), config.eval_batches * config.batch_size)
    val_loader = DataLoader(Subset(val, list(range(rank, n_val, world))), batch_size=config.batch_size // world,
                            **loader_args)
    return loader, val_loader


def _warn_bad_step(step: int, result: StepResult, bad: int, config: TrainConfig, master: bool,
                   checkpoint_path: Path | None) -> None:
    """Warn of a skipped non-finite step; raise :class:`TrainingDiverged` at ``max_bad_steps`` in a row."""
    if master:
        warnings.warn(f"step {step}: non-finite loss {result.loss} or gradient norm {result.grad_norm}; "
                      f"step skipped ({bad} in a row, max_bad_steps={config.max_bad_steps})",
                      RuntimeWarning, stacklevel=4)
    if bad >= config.max_bad_steps:
        raise TrainingDiverged(
            f"training stopped at step {step}: {bad} non-finite losses in a row (max_bad_steps="
            f"{config.max_bad_steps}); the last good checkpoint is {checkpoint_path or 'none'}. Lower lr, "
            "raise warmup_steps or set grad_clip, then resume or restart.")


def _save(config: TrainConfig, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, metrics: dict,
          rank: int, world: int) -> Path | None:
    """Checkpoint ``step``: every rank hands in its RNG state, rank 0 writes. Returns the path on rank 0."""
    rngs = [ckpt.rng_state()]
    if world > 1:
        rngs = [None] * world
        dist.all_gather_object(rngs, ckpt.rng_state())
    if rank != 0:
        return None
    state = {"config": config.to_dict(), "model_config": config_dict(model), "optimizer": optimizer.state_dict(),
             "scheduler": {"step": step, "lr": _lr(step - 1, config)}, "rng": rngs, "world_size": world,
             "metrics": metrics}
    return ckpt.save_checkpoint(Path(config.out_dir) / "checkpoints", step, model, state, config.keep_checkpoints)


# ---------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------


def main_train(argv: list[str] | None = None) -> int:
    """``sheafgnn train --config FILE [--set KEY=VALUE ...] [--resume]``; returns the exit status.

    Bad input raises (``sheafgnn.cli.main`` reports it in one line)."""
    parser = ArgumentParser(prog="sheafgnn train", description="train a model (see sheafgnn.train)")
    parser.add_argument("--config", required=True, help="a TrainConfig as YAML, TOML or JSON (examples: configs/)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a field of the config; VALUE is YAML, a dotted KEY reaches a nested field "
                        "(model_config.d_model=64, site.local_window=8); repeatable")
    parser.add_argument("--resume", action="store_true", help="continue from out_dir/checkpoints/latest")
    args = parser.parse_args(argv)
    result = train(TrainConfig.load(args.config).with_overrides(args.overrides), resume=args.resume)
    result.pop("history")
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(result, indent=2))
    return 0
