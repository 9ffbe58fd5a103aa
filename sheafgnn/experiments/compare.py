r"""``sheafgnn compare``: sheaf vs dense, local and ssm at equal parameters, tokens, seed and data.

::

    sheafgnn compare [--quick] [--out runs/compare] [--context 1024] [--tokens 131072] ...

    CompareConfig
      -> matched_options        sheaf width fixed; dense/local/ssm widths matched to its
                                parameter count within 10% (printed)
      -> a model already trained in out_dir/compare.json with the same settings and resolved
         model config is kept (``reused`` in the report), so a run adds models to an earlier one
      -> per model, in a fresh process (spawn; --in-process for tests):
           lr sweep (optional)   training only, at every lr of ``lr_sweep`` for ``sweep_tokens``;
                                 a best lr at an edge widens the sweep on that side by the
                                 sweep's own step, up to LR_WIDEN rates; the lr of the lowest
                                 validation bits/byte is the model's
           train_one             sheafgnn.train.train on the same corpus, seed, windows, tokens
                                 -> val bits/byte (and its curve: ``eval_points`` validations
                                    against tokens and seconds), training tokens/s, peak memory,
                                    inference tokens/s (forward, no grad, validation windows)
           sweep_one             build site + forward + backward of one window of n tokens,
                                 n = 1k ... 32k; a model stops at the first n over a cap
      -> out_dir/compare.json  compare.md  training.png  curves.png  sweep.png
         out_dir/train/<model>/  (each model's TrainConfig, metrics.csv, checkpoint; replaced per run)

Peak memory is measured by :class:`sheafgnn.memory.PeakMemory` (read its docstring).
Each model trains and sweeps in its own fresh process by default, so no model's
allocations count against another.

The context sweep builds the site of one window of ``n`` tokens (the
validation text, repeated if it is too short) and runs ``model.loss`` and
``backward``; the site building time is reported apart (``build_s``), and
the speed ratios use forward+backward time (``fwd_bwd_s``) as the issue asks,
with ``total_s`` (build + forward + backward) beside them. The same time and
memory caps apply to every model: once an n exceeds one, larger n are skipped
for that model, and the report states the caps.
"""

from __future__ import annotations

import csv
import json
import math
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict, dataclass, field, replace
from multiprocessing import get_context
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import Subset
from torch_geometric.data import Batch
from torch_geometric.loader import DataLoader
from tqdm import tqdm

from sheafgnn.config import ConfigFile
from sheafgnn.data import WindowDataset, scored_batches, train_validation_text
from sheafgnn.experiments.compare_report import figures, markdown
from sheafgnn.experiments.recurrence import loss_by_distance
from sheafgnn.experiments.report import config_from_args, report_parser, run_report_command, write_report
from sheafgnn.lm import MODEL_KINDS, build_model, matched_options, print_parameter_counts
from sheafgnn.memory import PeakMemory, tune_cpu
from sheafgnn.model import SheafStateConfig
from sheafgnn.site import ByteTokenizer, SiteConfig, build_site
from sheafgnn.train import TrainConfig, build_datasets, evaluate, resolve_device, train

SWEEP = (1024, 2048, 4096, 8192, 16384, 32768)
RATIO_AT = (16384, 32768)  # context lengths of the sheaf vs dense speed ratios
LR_WIDEN = 2  # rates an lr sweep may add beyond the edge where its best lies
# Settings that schedule a run without changing what it trains: a kept model may differ in these only.
SCHEDULING = ("out_dir", "models", "jobs", "progress")
BASELINE_SITE = {"patch_types": []}  # dense, local and ssm read tokens only: no patches to build
# The attention baselines with the short conv every Zoology baseline has; plain dense and local on request.
DEFAULT_MODELS = ("sheaf", "dense_conv", "local_conv", "ssm")


@dataclass
class CompareConfig(ConfigFile):
    """A comparison run (``print(config)`` shows every field)."""

    out_dir: str = "runs/compare"  # compare.json, compare.md, *.png, train/<model>/
    models: tuple[str, ...] = DEFAULT_MODELS  # any of sheafgnn.lm.MODEL_KINDS
    corpus: str = "mixed"  # docs | code | mixed (embedded) or a UTF-8 text file (byte tokenizer)
    context: int = 1024  # tokens per training window
    batch_size: int = 4  # windows per optimizer step
    tokens: int = 131072  # training tokens per model (the same for all)
    lr: float = 1e-3  # peak learning rate (warm-up + cosine), unless lr_sweep chooses one per model
    lr_sweep: tuple[float, ...] = ()  # peak lrs tried per model on sweep_tokens; the best one trains
    sweep_tokens: int = 0  # training tokens of each lr_sweep run (0: tokens // 8)
    eval_points: int = 1  # validations per training run, evenly spaced (the learning curves)
    warmup_steps: int = 8  # linear warm-up steps
    eval_batches: int = 8  # validation batches of batch_size windows (the same windows for every model)
    inference_batches: int = 2  # validation batches timed for inference tokens/s
    seed: int = 0  # init, data order
    d_model: int = SheafStateConfig().d_model  # the sheaf model's width; the others are matched to its parameters
    n_layers: int = 2  # blocks of every model
    n_heads: int = 4  # attention heads of dense and local
    window: int = 256  # local attention window (tokens)
    sheaf: dict = field(default_factory=dict)  # further SheafStateConfig fields (sheaf and ssm)
    site: dict = field(default_factory=dict)  # SiteConfig fields of the sheaf model's sites
    sweep: tuple[int, ...] = SWEEP  # context lengths of the forward+backward sweep
    sweep_repeats: int = 1  # timed repeats per point (the fastest is kept)
    time_cap_s: float = 120.0  # a model stops the sweep after an n whose forward+backward exceeds this
    memory_cap_gb: float = 8.0  # ... or whose peak extra memory exceeds this (GiB)
    tolerance: float = 0.1  # largest parameter-count mismatch vs the sheaf model
    isolate: bool = True  # each model in a fresh process (honest peak memory); False: in this process
    jobs: int = 1  # models trained at once, each in its own process (isolate); the context sweep runs alone
    device: str = "cpu"  # cpu | cuda | auto
    num_threads: int = 0  # torch CPU threads; 0: torch's default
    progress: bool = True  # tqdm bars

    def __post_init__(self) -> None:
        self.models, self.sweep = tuple(self.models), tuple(sorted(set(self.sweep)))
        self.lr_sweep = tuple(sorted(set(self.lr_sweep)))
        if any(not lr > 0 for lr in self.lr_sweep) or self.sweep_tokens < 0:
            raise ValueError(f"CompareConfig: lr_sweep must hold positive lrs and sweep_tokens be >= 0 "
                             f"(got {self.lr_sweep}, {self.sweep_tokens})")
        unknown = sorted(set(self.models) - set(MODEL_KINDS))
        if unknown or not self.models:
            raise ValueError(f"CompareConfig: models must be a non-empty subset of {MODEL_KINDS} (got {self.models})")
        for name in ("context", "batch_size", "tokens", "eval_batches", "inference_batches", "d_model",
                     "n_layers", "n_heads", "window", "sweep_repeats", "eval_points", "jobs"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"CompareConfig: {name} must be a positive integer (got {value!r})")
        if not self.sweep or min(self.sweep) < 2:
            raise ValueError(f"CompareConfig: sweep must hold context lengths >= 2 (got {self.sweep})")
        if self.jobs > 1 and not self.isolate:
            raise ValueError("CompareConfig: jobs > 1 needs isolate (one process per model)")
        if not (self.time_cap_s > 0 and self.memory_cap_gb > 0 and 0 < self.tolerance < 1):
            raise ValueError(f"CompareConfig: need time_cap_s > 0, memory_cap_gb > 0, 0 < tolerance < 1 "
                             f"(got {self.time_cap_s}, {self.memory_cap_gb}, {self.tolerance})")

    @classmethod
    def quick(cls, **overrides) -> CompareConfig:
        """A toy preset that runs in seconds (tests, smoke checks)."""
        values = dict(context=64, batch_size=2, tokens=2 * 64 * 3, warmup_steps=1, eval_batches=1,
                      inference_batches=1, d_model=32, n_layers=1, n_heads=2, window=16,
                      site={"local_window": 8}, sweep=(128, 256), time_cap_s=30.0, progress=False)
        values.update(overrides)
        return cls(**values)


# ---------------------------------------------------------------------------
# Parameter matching
# ---------------------------------------------------------------------------


def _site_of(kind: str, config: CompareConfig) -> dict:
    return dict(config.site) if kind == "sheaf" else dict(BASELINE_SITE)


def compare_options(config: CompareConfig) -> tuple[dict[str, dict], dict[str, int]]:
    """``build_model`` options and parameter counts of ``config.models``: the sheaf model at ``config``'s width
    and depth, every other model's width matched to its parameter count (:func:`~sheafgnn.lm.matched_options`)."""
    sheaf_options = {"d_model": config.d_model, "n_layers": config.n_layers, **config.sheaf}
    return matched_options(config.models, sheaf_options, ByteTokenizer.vocab_size, n_heads=config.n_heads,
                           window=config.window, site=config.site, tolerance=config.tolerance)


def compare_model(config: CompareConfig, kind: str, options: dict) -> tuple[nn.Module, SiteConfig]:
    """``kind`` built from ``options`` as :func:`sheafgnn.train.train` builds it (seeded with ``config.seed``),
    and the site rules its data is built with (the sheaf model's ``config.site``; tokens only for baselines)."""
    site = _site_of(kind, config)
    torch.manual_seed(config.seed)
    return build_model(kind, options, ByteTokenizer.vocab_size, site), SiteConfig.from_dict(site)


# ---------------------------------------------------------------------------
# Work done per model (each in a fresh process by default)
# ---------------------------------------------------------------------------


def _in_child(isolate: bool, fn: Callable, *args):
    """``fn(*args)`` in a fresh spawned process (``isolate``) or here."""
    if not isolate:
        return fn(*args)
    with ProcessPoolExecutor(max_workers=1, mp_context=get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def _train_config(config: CompareConfig, kind: str, options: dict, lr: float, tokens: int,
                  run: str) -> TrainConfig:
    steps = math.ceil(tokens / (config.batch_size * config.context))
    return TrainConfig(model=kind, model_config=options, site=_site_of(kind, config), corpus=config.corpus,
                       context=config.context, batch_size=config.batch_size, tokens=tokens, lr=lr,
                       warmup_steps=min(config.warmup_steps, steps), seed=config.seed,
                       eval_every=max(1, steps // config.eval_points), eval_batches=config.eval_batches,
                       checkpoint_every=steps, keep_checkpoints=1, log_every=1,
                       out_dir=str(Path(config.out_dir) / "train" / run), num_threads=config.num_threads,
                       device=config.device, tensorboard=False, progress=config.progress)


def _validation_curve(metrics_csv: Path) -> list[dict]:
    """The run's validations: tokens, seconds since the start and bits per byte at each."""
    with open(metrics_csv, newline="") as f:
        rows = [r for r in csv.DictReader(f) if r.get("val_bpb")]
    return [{"tokens": int(r["tokens"]), "elapsed_s": float(r["elapsed_s"]), "val_bpb": float(r["val_bpb"])}
            for r in rows]


def _median_train_tokens_per_s(metrics_csv: Path, overall: float) -> float:
    """Median tokens/s over the logged training steps that did not validate (the step time alone).

    A run of one step has none; then ``overall`` (``train``'s tokens / elapsed, validation included).
    """
    with open(metrics_csv, newline="") as f:
        rows = [r for r in csv.DictReader(f) if r.get("tokens_per_s") and not r.get("val_loss")]
    values = [float(r["tokens_per_s"]) for r in rows]
    return statistics.median(values) if values else overall


@torch.no_grad()
def _inference(model: nn.Module, dataset, config: CompareConfig, device: torch.device) -> dict:
    """Forward-only tokens/s on the first validation windows (site building timed apart)."""
    model.eval()
    n = min(len(dataset), config.inference_batches * config.batch_size)
    build_s = forward_s = 0.0
    tokens = 0
    with PeakMemory(device) as mem:
        for start in range(0, n, config.batch_size):
            t0 = time.perf_counter()
            batch = Batch.from_data_list([dataset[i] for i in range(start, min(n, start + config.batch_size))])
            batch = batch.to(device)
            t1 = time.perf_counter()
            model(batch)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            build_s, forward_s = build_s + t1 - t0, forward_s + time.perf_counter() - t1
            tokens += batch["token"].num_nodes
    return {"infer_tokens_per_s": tokens / max(forward_s, 1e-9),
            "infer_tokens_per_s_with_site": tokens / max(forward_s + build_s, 1e-9),
            **mem.as_dict("infer_")}


def _spread_loss(model: nn.Module, windows: WindowDataset, tokenizer, config: CompareConfig,
                 device: torch.device) -> float:
    """Next-token loss (nats/token; the forward's logits only, no auxiliary loss) on ``eval_batches x
    batch_size`` windows spread evenly over ``windows``: one measure for training and validation text."""
    n = min(len(windows), config.eval_batches * config.batch_size)
    picks = torch.linspace(0, len(windows) - 1, n).round().long().tolist()
    loader = DataLoader(Subset(windows, picks), batch_size=config.batch_size)
    return evaluate(model, scored_batches(loader, tokenizer), device, False, 1)["val_loss"]


def _fit(config: CompareConfig, kind: str, options: dict, lr: float, tokens: int, run: str
         ) -> tuple[nn.Module, dict, TrainConfig]:
    """Build the model exactly as :func:`sheafgnn.train.train` would (same seed) and train it in place
    under ``out_dir/train/<run>``, so that the trained weights stay at hand; (model, train's result, its
    config)."""
    train_config = _train_config(config, kind, options, lr, tokens, run)
    out = Path(train_config.out_dir)
    if out.exists():
        shutil.rmtree(out)  # compare owns out_dir/train/<run>; a stale checkpoint would block train()
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    model, _ = compare_model(config, kind, options)  # train_config.site is _site_of(kind, config)
    return model, train(train_config, model=model), train_config


def resolved_config(model: nn.Module) -> dict:
    """Every field of ``model.config``, defaults included, as JSON values: what a kept run must match, since
    a changed default changes the model without changing ``options``."""
    return json.loads(json.dumps(asdict(model.config), default=str))


def train_one(config: CompareConfig, kind: str, options: dict, lr: float | None = None) -> dict:
    """Train one model (``config.lr`` unless ``lr``) on ``config.tokens``; measure validation, training
    and inference speed and peak memory, inference on the trained weights."""
    lr = config.lr if lr is None else lr
    device = resolve_device(config.device)
    with PeakMemory(device) as mem:
        model, result, train_config = _fit(config, kind, options, lr, config.tokens, kind)
    out, (tokenizer, windows) = Path(train_config.out_dir), build_datasets(train_config)  # train and validation
    return {"model": kind, "lr": lr, "params": result["params"], "steps": result["step"], "tokens": result["tokens"],
            "train_loss": result["train_loss"], "train_loss_smoothed": result["train_loss_smoothed"],
            "val_loss": result["val_loss"], "val_bpb": result["val_bpb"],
            "train_tokens_per_s": _median_train_tokens_per_s(out / "metrics.csv", result["tokens_per_s"]),
            "train_tokens_per_s_overall": result["tokens_per_s"], "train_elapsed_s": result["elapsed_s"],
            **{f"{split}_windows_loss": _spread_loss(model, windows[split], tokenizer, config, device)
               for split in windows},
            **mem.as_dict("train_"), **_inference(model, windows["validation"], config, device),
            "memory_method": mem.method, "options": options, "model_config": resolved_config(model),
            "curve": _validation_curve(out / "metrics.csv"),
            "by_distance": loss_by_distance(model, windows["validation"], config.batch_size,
                                            config.eval_batches * config.batch_size, device)}


def next_rate(rows: list[dict], swept: int) -> float | None:
    """The lr a sweep of ``swept`` configured rates should try next: one step of the sweep's own ratio beyond
    the edge where the best of ``rows`` (sorted by lr) lies, or None when the best lies inside, the rates tie,
    there is no step to take (one rate) or ``LR_WIDEN`` rates were added already."""
    scores = [row["val_bpb"] for row in rows]
    if len(rows) < 2 or len(rows) >= swept + LR_WIDEN or len(set(scores)) == 1:
        return None
    best = scores.index(min(scores))
    if best not in (0, len(rows) - 1):
        return None
    edge, inner = (rows[0], rows[1]) if best == 0 else (rows[-1], rows[-2])
    return float(f"{edge['lr'] ** 2 / inner['lr']:.3g}")  # 2e-3 * (2e-3 / 4e-3) = 1e-3, not 0.000999...


def lr_sweep_one(config: CompareConfig, kind: str, options: dict) -> list[dict]:
    """Train at every lr of ``config.lr_sweep`` on ``sweep_tokens`` (the same data and seed), then beyond the
    edge where the best lies (:func:`next_rate`), measuring nothing but validation; rows of lr, validation
    bits/byte and training seconds, sorted by lr."""
    tokens = config.sweep_tokens or max(1, config.tokens // 8)
    rows, final_only = [], replace(config, eval_points=1)  # a sweep run needs its last validation only

    def fit(lr: float) -> None:
        _, r, _ = _fit(final_only, kind, options, lr, tokens, f"{kind}_lr{lr:g}")
        rows.append({"lr": lr, "tokens": r["tokens"], "val_bpb": r["val_bpb"], "train_elapsed_s": r["elapsed_s"]})
        rows.sort(key=lambda row: row["lr"])
        print(f"  {kind} lr {lr:g}: {r['val_bpb']:.4f} bits/byte after {r['tokens']:,} tokens", flush=True)

    for lr in config.lr_sweep:
        fit(lr)
    while (wider := next_rate(rows, len(config.lr_sweep))) is not None:
        print(f"  {kind}: the best lr lies at the edge of the sweep; widening it to {wider:.3g}", flush=True)
        fit(wider)
    return rows


def _sweep_ids(config: CompareConfig, n: int) -> torch.Tensor:
    """``n + 1`` byte ids of the validation text (repeated when too short)."""
    ids = ByteTokenizer().encode(train_validation_text(config.corpus)[1])
    return ids.repeat(math.ceil((n + 1) / ids.numel()))[: n + 1]


def _fwd_bwd(model: nn.Module, ids: torch.Tensor, n: int, site_config, device: torch.device) -> tuple[float, float]:
    """(site build s, forward+backward s) of one window of n tokens."""
    t0 = time.perf_counter()
    data = build_site(ids[:n], site_config)
    data["token"].y = ids[1 : n + 1]
    data = data.to(device)
    t1 = time.perf_counter()
    model.loss(data).backward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t2 = time.perf_counter()
    model.zero_grad(set_to_none=True)
    return t1 - t0, t2 - t1


def sweep_one(config: CompareConfig, kind: str, options: dict) -> list[dict]:
    """Site build + forward + backward time and peak memory of one model at each context length.

    A warm-up pass at the smallest n comes first (not recorded). After the
    first n over ``time_cap_s`` or ``memory_cap_gb`` the larger n are skipped.
    """
    device = resolve_device(config.device)
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    tune_cpu()  # every model alike (sheafgnn.memory)
    ids = _sweep_ids(config, max(config.sweep))
    model, site_config = compare_model(config, kind, options)
    model.to(device).train()
    _fwd_bwd(model, ids, min(config.sweep), site_config, device)  # warm-up
    points, capped_at = [], None
    cap_bytes = config.memory_cap_gb * (1 << 30)
    for n in tqdm(config.sweep, desc=f"sweep {kind}", disable=not config.progress, leave=False):
        if capped_at is not None:
            points.append({"n": n, "skipped": True, "reason": f"over a cap at n={capped_at}"})
            continue
        build, fb, peak = math.inf, math.inf, None
        for _ in range(config.sweep_repeats):
            with PeakMemory(device) as mem:
                b, f = _fwd_bwd(model, ids, n, site_config, device)
            build, fb = min(build, b), min(fb, f)
            peak = mem if peak is None or mem.extra_bytes > peak.extra_bytes else peak
        point = {"n": n, "skipped": False, "build_s": build, "fwd_bwd_s": fb, "total_s": build + fb,
                 **peak.as_dict(), "memory_method": peak.method}
        over = [c for c, hit in (("time", fb > config.time_cap_s), ("memory", peak.extra_bytes > cap_bytes)) if hit]
        if over:
            point["over_cap"] = over
            capped_at = n
        points.append(point)
    return points


# ---------------------------------------------------------------------------
# The run and its report
# ---------------------------------------------------------------------------


def speed_ratios(sweep: dict[str, list[dict]], at: tuple[int, ...] = RATIO_AT) -> dict[str, dict]:
    """Sheaf vs dense at each n of ``at``: dense time / sheaf time and sheaf memory / dense memory
    (dense: ``dense_conv`` where it ran, else ``dense``; the row's ``dense_model`` says which).

    Where dense was skipped (over a cap at a smaller n), the time ratio is
    None and ``time_ratio_at_least`` bounds it from below with dense's time at
    the n where it went over the cap (its time only grows with n).
    """
    out = {}
    dense = next((kind for kind in ("dense_conv", "dense") if kind in sweep), None)
    if "sheaf" not in sweep or dense is None:
        return out
    points = {kind: {p["n"]: p for p in sweep[kind]} for kind in ("sheaf", dense)}
    for n in at:
        s, d = points["sheaf"].get(n), points[dense].get(n)
        if s is None or d is None or s["skipped"]:
            continue
        row = {"dense_model": dense, "sheaf_fwd_bwd_s": s["fwd_bwd_s"], "sheaf_peak_extra_bytes": s["peak_extra_bytes"]}
        if d["skipped"]:
            measured = [p for p in sweep[dense] if not p["skipped"]]
            row.update(time_ratio=None, memory_ratio=None, dense="skipped: " + d["reason"],
                       time_ratio_at_least=measured[-1]["fwd_bwd_s"] / s["fwd_bwd_s"] if measured else None)
        else:
            row.update(dense_fwd_bwd_s=d["fwd_bwd_s"], dense_peak_extra_bytes=d["peak_extra_bytes"],
                       time_ratio=d["fwd_bwd_s"] / s["fwd_bwd_s"],
                       total_time_ratio=d["total_s"] / s["total_s"],
                       memory_ratio=s["peak_extra_bytes"] / max(d["peak_extra_bytes"], 1))
        out[str(n)] = row
    return out


def kept_models(config: CompareConfig, options: dict[str, dict]) -> dict[str, tuple[list[dict], dict]]:
    """The models of ``config`` already trained in ``out_dir/compare.json`` by a run with the same settings
    (every field but :data:`SCHEDULING`), at the same options and resolved model config (the code's defaults
    included) and with a finished lr sweep: {kind: (sweep rows, training result)}, as :func:`_train_model`
    returns them."""
    path = Path(config.out_dir) / "compare.json"
    if not path.exists():
        return {}
    try:
        earlier = json.loads(path.read_text())
        settings = {k: v for k, v in earlier["config"].items() if k not in SCHEDULING}
        training, sweeps = earlier["training"], earlier["lr_sweep"]
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise ValueError(f"compare: {path} is not a compare report ({error!r}); move it away or choose another "
                         f"out_dir") from error
    ours = json.loads(json.dumps({k: v for k, v in config.to_dict().items() if k not in SCHEDULING}))
    if settings != ours:
        return {}
    return {kind: (sweeps.get(kind, []), training[kind]) for kind in config.models
            if kind in training and training[kind]["options"] == options[kind]
            and training[kind].get("model_config") == resolved_config(compare_model(config, kind, options[kind])[0])
            and (not config.lr_sweep or next_rate(sweeps.get(kind, []), len(config.lr_sweep)) is None)}


def _train_model(config: CompareConfig, kind: str, options: dict) -> tuple[list[dict], dict]:
    """One model's learning-rate sweep (when configured), then its training at the best lr, each in a
    fresh process (``isolate``): (sweep rows, :func:`train_one`'s result)."""
    lr, rows = config.lr, []
    if config.lr_sweep:
        print(f"\n== {kind}: learning-rate sweep {', '.join(f'{v:g}' for v in config.lr_sweep)} ==", flush=True)
        rows = _in_child(config.isolate, lr_sweep_one, config, kind, options)
        lr = min(rows, key=lambda row: row["val_bpb"])["lr"]
    print(f"\n== {kind}: training {config.tokens:,} tokens at lr {lr:g} ==", flush=True)
    return rows, _in_child(config.isolate, train_one, config, kind, options, lr)


def run_compare(config: CompareConfig) -> dict:
    """Train and sweep every model of ``config``; write the report; return it as a dict.

    Returns:
        dict with ``config``, ``params`` (counts per model and the target),
        ``training`` (per model: val bits/byte, tokens/s, peak memory, ...),
        ``sweep`` (per model: list of points), ``ratios`` (sheaf vs dense at 16k
        and 32k), ``caps``, ``memory_method``, ``device`` and ``files``.
    """
    print(config)
    out = Path(config.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    options, counts = compare_options(config)
    print_parameter_counts(options, counts)
    kept = kept_models(config, options)
    if kept:
        print(f"kept from {out / 'compare.json'} (the same settings): {', '.join(kept)}", flush=True)
    with ThreadPoolExecutor(max_workers=config.jobs) as pool:  # each thread waits on its model's processes
        runs = dict(zip(config.models, pool.map(
            lambda kind: kept.get(kind) or _train_model(config, kind, options[kind]), config.models)))
    lr_sweep = {kind: rows for kind, (rows, _) in runs.items() if rows}
    training, sweep = {kind: result for kind, (_, result) in runs.items()}, {}
    for kind in tqdm(config.models, desc="context sweep", disable=not config.progress):
        try:
            sweep[kind] = _in_child(config.isolate, sweep_one, config, kind, options[kind])
        except BrokenProcessPool:  # the child was killed, e.g. by the kernel's out-of-memory killer
            reason = "the sweep process died (out of memory?); lower memory_cap_gb"
            sweep[kind] = [{"n": n, "skipped": True, "reason": reason} for n in config.sweep]
            print(f"sweep {kind}: {reason}", file=sys.stderr)
    report = {"config": config.to_dict(), "params": counts, "training": training, "lr_sweep": lr_sweep,
              "reused": list(kept), "sweep": sweep,
              "ratios": speed_ratios(sweep),
              "caps": {"time_cap_s": config.time_cap_s, "memory_cap_gb": config.memory_cap_gb},
              "memory_method": next(iter(training.values()))["memory_method"],
              "device": str(resolve_device(config.device)),
              "threads": config.num_threads or torch.get_num_threads(), "cpu_count": os.cpu_count()}
    report["files"] = write_report(report, out, "compare", markdown(report), figures(report))
    print("\n" + markdown(report))
    return report


# ---------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------


def parse_compare_args(argv: list[str] | None = None) -> CompareConfig:
    """``sheafgnn compare`` flags -> a :class:`CompareConfig` (``--quick`` starts from the toy preset)."""
    parser = report_parser("sheafgnn compare", "sheaf vs dense, local and ssm at equal parameters and tokens: "
                           "training, speed, memory and a context sweep", CompareConfig, "runs/compare")
    parser.add_argument("--in-process", action="store_true", help="run every model in this process, not a fresh "
                        "one each (faster start; peak memory is still reset per phase)")
    CompareConfig.add_arguments(parser, skip=("out_dir", "isolate", "progress"))
    namespace = parser.parse_args(argv)
    return config_from_args(CompareConfig, namespace, **({"isolate": False} if namespace.in_process else {}))


def main_compare(argv: list[str] | None = None) -> int:
    """``sheafgnn compare [flags]``; returns the exit status."""
    return run_report_command(parse_compare_args, run_compare, argv)


if __name__ == "__main__":
    sys.exit(main_compare())
