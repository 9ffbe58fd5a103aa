"""Memory through training: the resident set against the live memory, step by step, sheaf vs dense.

Each run trains in a fresh process (the C heap is per process) as a user's
run does: windows of the embedded corpus built into sites, PyG DataLoader,
AdamW, :func:`~sheafgnn.train.train_step`, at the compare's sizes (the
default sheaf model, 2 layers; dense matched to its parameters within 10%). Every
``--every`` steps it records:

- ``rss_bytes``: the process's resident set (``VmRSS``);
- ``interval_peak_rss_bytes``: the peak resident set since the record before
  (``VmHWM``, reset at each record: :func:`sheafgnn.memory.take_peak_resident_bytes`),
  which a record between steps misses: the steps' own peaks;
- ``live_tensor_bytes``: the storages of every tensor the garbage collector
  can reach (parameters, optimizer state, the corpus ids; between steps);
- glibc's heap (:func:`sheafgnn.memory.heap_stats`): ``heap_bytes``,
  ``in_use_bytes``, ``free_bytes`` (free inside the heap: fragmentation when
  it grows while the live memory does not), ``mmap_bytes``;
- ``elapsed_s`` since the first step.

Every run first calls :func:`sheafgnn.memory.tune_cpu`, as ``sheafgnn.train.train``
does: glibc's thresholds and oneDNN's primitive cache bound
(:func:`sheafgnn.memory.bound_onednn_cache`); large tensors are on huge pages
as ``import sheafgnn`` sets them (:func:`sheafgnn.memory.huge_pages_on`), and
each run records what ``tune_cpu`` reported. Four runs: ``sheaf``,
``sheaf_onednn_1024`` (the cache at oneDNN's default size, set in the
environment, which ``tune_cpu`` leaves alone), ``sheaf_no_huge_pages``
(``THP_MEM_ALLOC_ENABLE=0``) and ``dense`` (``--runs`` picks some). It writes ``train_memory.json``
(rows per run; the growth of each figure from the first record to the last;
each run's peak resident set and how far the resident set rose after the
warm-up, from the record at step ``--warmup`` to the highest one after it; the
trend of the interval peaks after the warm-up (the least-squares slope, MiB per
1,000 steps: growth that goes on shows as a slope, windows whose sites need more
memory as scatter around it); and sheaf's peak over dense's) and ``train_memory.png``.

``--trim-every N`` hands the heap's free pages back to the kernel every N steps
(:func:`sheafgnn.memory.release_free_memory`: glibc's ``malloc_trim``). Training
keeps freed memory in the heap (:func:`sheafgnn.memory.keep_freed_memory`), so
without it the resident set is the heap's high-water mark, free pages included;
with it, each interval's peak is the pages its own steps touched.

Usage::

    python benchmarks/bench_train_memory.py [--out benchmarks/results] [--steps 60] [--every 5] [--warmup 20]
        [--threads 1] [--runs sheaf dense] [--trim-every 0]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch_geometric.loader import DataLoader

from sheafgnn.data import WindowDataset, corpus_ids
from sheafgnn.experiments.compare import CompareConfig, compare_model, compare_options
from sheafgnn.experiments.report import pyplot, save_figure
from sheafgnn.memory import (
    HUGE_PAGES_VARIABLE,
    ONEDNN_CACHE_VARIABLE,
    heap_stats,
    release_free_memory,
    resident_bytes,
    take_peak_resident_bytes,
    tune_cpu,
)
from sheafgnn.optim import make_optimizer
from sheafgnn.site import SiteBuilder
from sheafgnn.train import train_step

KINDS = ("sheaf", "dense")
RUNS = {"sheaf": ("sheaf", {}), "sheaf_onednn_1024": ("sheaf", {ONEDNN_CACHE_VARIABLE: "1024"}),
        "sheaf_no_huge_pages": ("sheaf", {HUGE_PAGES_VARIABLE: "0"}),
        "dense": ("dense", {})}  # name -> (model kind, environment of its process)


def live_tensor_bytes() -> int:
    """Bytes of the distinct tensor storages the garbage collector reaches."""
    storages = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and not obj.is_meta:
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def train_here(kind: str, steps: int, every: int, context: int, batch_size: int, trim_every: int = 0) -> dict:
    """Train one model ``steps`` steps in this process: what :func:`tune_cpu` reported, and a record every
    ``every`` steps (and the last), after handing the heap's free pages back every ``trim_every`` steps (0: never)."""
    settings = tune_cpu()  # what the training loop does first
    compare = CompareConfig(models=KINDS)
    model, site = compare_model(compare, kind, compare_options(compare)[0][kind])
    model.train()
    optimizer = make_optimizer(model, lr=1e-3, weight_decay=0.1)
    ids = corpus_ids(context * batch_size * steps + 1)
    loader = DataLoader(WindowDataset(ids, context, SiteBuilder(site)), batch_size=batch_size)
    rows, start = [], time.perf_counter()
    take_peak_resident_bytes()  # the first interval starts at step 1
    for step, batch in enumerate(loader, start=1):
        train_step(model, batch, optimizer, lr=1e-3, grad_clip=1.0)
        if trim_every and step % trim_every == 0:
            release_free_memory()
        if step % every == 0 or step == steps:
            rows.append({"step": step, "elapsed_s": time.perf_counter() - start, "rss_bytes": resident_bytes(),
                         "interval_peak_rss_bytes": take_peak_resident_bytes(),
                         "live_tensor_bytes": live_tensor_bytes(), **(heap_stats() or {})})
        if step == steps:
            break
    return {"tune_cpu": settings, "rows": rows}


def growth(rows: list[dict]) -> dict:
    """Last record minus first, per figure."""
    return {key: rows[-1][key] - rows[0][key] for key in rows[0]
            if key not in ("step", "elapsed_s") and rows[0][key] is not None}


def after_warmup(rows: list[dict], warmup: int) -> dict:
    """The peak resident set (the highest interval peak where the kernel reports them, else the highest record),
    its rise after the warm-up (the highest record after step ``warmup`` minus the first record at or after it: 0
    when the resident set stays flat; ``None`` if no record is that late) and the least-squares slope of the
    interval peaks after the warm-up, in bytes per 1,000 steps (``None`` without interval peaks or with fewer
    than 2 records that late)."""
    late = [r for r in rows if r["step"] >= warmup]
    peaks = [r.get("interval_peak_rss_bytes") for r in rows]
    out = {"peak_rss_bytes": max(peaks) if None not in peaks else max(r["rss_bytes"] for r in rows),
           "warmup_step": late[0]["step"] if late else None, "rss_rise_after_warmup_bytes": None,
           "rss_rise_after_warmup": None, "interval_peak_slope_bytes_per_1000_steps": None}
    if late:
        rise = max(r["rss_bytes"] for r in late) - late[0]["rss_bytes"]
        out.update(rss_rise_after_warmup_bytes=rise, rss_rise_after_warmup=rise / late[0]["rss_bytes"])
    if len(late) >= 2 and None not in peaks:
        fit = statistics.linear_regression([r["step"] for r in late], [r["interval_peak_rss_bytes"] for r in late])
        out["interval_peak_slope_bytes_per_1000_steps"] = 1000 * fit.slope
    return out


def plot(result: dict, path: Path) -> None:
    names = list(result["runs"])
    fig, axes = pyplot().subplots(1, len(names), figsize=(5 * len(names), 4), sharey=True, squeeze=False)
    axes = axes[0]
    for ax, name in zip(axes, names):
        rows = result["runs"][name]["rows"]
        steps = [r["step"] for r in rows]
        for key, label in (("interval_peak_rss_bytes", "peak since the record before"),
                           ("rss_bytes", "resident set"), ("heap_bytes", "glibc heap"),
                           ("in_use_bytes", "heap in use"), ("live_tensor_bytes", "live tensors")):
            if rows[0].get(key) is not None:
                ax.plot(steps, [r[key] / 2**20 for r in rows], label=label)
        ax.axvline(result["warmup"], color="grey", ls="--", lw=0.8)
        ax.set_title(name)
        ax.set_xlabel("training step")
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("MiB")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"Memory through training, context {result['context']}, batch {result['batch_size']}")
    save_figure(fig, path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=20, help="the step after which the resident set should be flat")
    parser.add_argument("--runs", nargs="+", choices=list(RUNS), default=list(RUNS))
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--trim-every", type=int, default=0,
                        help="hand the heap's free pages back every this many steps (malloc_trim; 0: never)")
    parser.add_argument("--one", choices=KINDS, help=argparse.SUPPRESS)  # the child process: one run
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.one:
        print(json.dumps(train_here(args.one, args.steps, args.every, args.context, args.batch_size, args.trim_every)))
        return
    result = {"machine": {"platform": platform.platform(), "threads": args.threads, "torch": torch.__version__},
              "steps": args.steps, "context": args.context, "batch_size": args.batch_size, "warmup": args.warmup,
              "trim_every": args.trim_every, "runs": {}}
    for name in args.runs:
        kind, env = RUNS[name]
        command = [sys.executable, __file__, "--one", kind, *sys.argv[1:]]
        out = subprocess.run(command, check=True, capture_output=True, text=True, env={**os.environ, **env}).stdout
        run = json.loads(out.splitlines()[-1])
        rows = run["rows"]
        result["runs"][name] = {"kind": kind, "environment": env, "tune_cpu": run["tune_cpu"], "rows": rows,
                                "growth": growth(rows), **after_warmup(rows, args.warmup)}
        first, last = rows[0], rows[-1]
        print(f"  {name:<17} step {first['step']} -> {last['step']}: RSS {first['rss_bytes'] / 2**20:,.0f} -> "
              f"{last['rss_bytes'] / 2**20:,.0f} MiB, live tensors {first['live_tensor_bytes'] / 2**20:,.0f} -> "
              f"{last['live_tensor_bytes'] / 2**20:,.0f} MiB"
              + (f", heap in use {first['in_use_bytes'] / 2**20:,.0f} -> {last['in_use_bytes'] / 2**20:,.0f} MiB, "
                 f"free in it {first['free_bytes'] / 2**20:,.0f} -> {last['free_bytes'] / 2**20:,.0f} MiB"
                 if "free_bytes" in first else ""), flush=True)
    runs = result["runs"]
    if "sheaf" in runs and "dense" in runs:
        result["sheaf_over_dense_peak_rss"] = runs["sheaf"]["peak_rss_bytes"] / runs["dense"]["peak_rss_bytes"]
    for name, run in runs.items():
        rise = run["rss_rise_after_warmup_bytes"]
        rose = "has no record" if rise is None else f"rose {rise / 2**20:,.1f} MiB ({run['rss_rise_after_warmup']:.1%})"
        slope = run["interval_peak_slope_bytes_per_1000_steps"]
        trend = "" if slope is None else f"; its step peaks' trend {slope / 2**20:+,.1f} MiB per 1,000 steps"
        print(f"  {name:<17} peak RSS {run['peak_rss_bytes'] / 2**20:,.0f} MiB, after step {run['warmup_step']} {rose}"
              + trend)
    if "sheaf_over_dense_peak_rss" in result:
        print(f"  sheaf / dense peak RSS: {result['sheaf_over_dense_peak_rss']:.2f}x")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "train_memory.json").write_text(json.dumps(result, indent=2))
    plot(result, out / "train_memory.png")
    print(f"wrote {out / 'train_memory.json'}, {out / 'train_memory.png'}")


if __name__ == "__main__":
    main()
