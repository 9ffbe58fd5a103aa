"""The report of ``sheafgnn compare`` (:mod:`sheafgnn.experiments.compare`): its Markdown, its figures and the
one-line standing that the demo reads."""

from __future__ import annotations

import numpy as np

from sheafgnn.experiments.recurrence import bucket_names
from sheafgnn.experiments.report import pyplot

MIB = 1 << 20


def standing(training: dict) -> str:
    """One line: the models from the lowest validation bits per byte up, each with its gap to the first."""
    ranked = sorted(training.items(), key=lambda item: item[1]["val_bpb"])
    best = ranked[0][1]["val_bpb"]
    rest = ", ".join(f"{kind} {r['val_bpb']:.4f} (+{r['val_bpb'] - best:.4f})" for kind, r in ranked[1:])
    return f"Ahead at this budget: **{ranked[0][0]}** ({best:.4f} bits/byte)" + (f"; then {rest}." if rest else ".")


def _mib(value) -> str:
    return "-" if value is None else f"{value / MIB:,.0f}"


def _by_distance_table(training: dict, cfg: dict) -> list[str]:
    """Validation bits per token by the distance to the previous occurrence of each position's 4-gram
    (:mod:`sheafgnn.experiments.recurrence`), a column per model."""
    kinds = [k for k, r in training.items() if "by_distance" in r]
    if not kinds:
        return []
    lines = ["", f"## Where the models differ: validation bits per token by the distance to the previous "
             f"occurrence of the context's last 4 tokens ({cfg['eval_batches'] * cfg['batch_size']} windows)", "",
             "| distance (tokens) | positions | " + " | ".join(kinds) + " |", "|---|---:|" + "---:|" * len(kinds)]
    for name in [*bucket_names(), "all"]:
        first = training[kinds[0]]["by_distance"][name]
        cells = [training[k]["by_distance"][name]["bits_per_token"] for k in kinds]
        lines.append(f"| {name} | {first['tokens']:,} | "
                     + " | ".join("-" if c is None else f"{c:.4f}" for c in cells) + " |")
    return lines


def at_equal_seconds(training: dict) -> tuple[float, dict[str, dict | None]]:
    """Every model's validation at the training seconds of the first to finish (all train the same tokens).

    A model's bits per byte and tokens at that time are read off its validation curve, linearly between the
    two validations around it (the first to finish is at its last); ``None`` for a model that had not yet
    validated then. The seconds are wall time since the run's start, validations included.

    Returns:
        ``(seconds, {model: {"tokens", "val_bpb"} or None})``.
    """
    seconds = min(r["curve"][-1]["elapsed_s"] for r in training.values())
    at = {}
    for kind, r in training.items():
        elapsed = [p["elapsed_s"] for p in r["curve"]]
        at[kind] = None if seconds < elapsed[0] else {
            key: float(np.interp(seconds, elapsed, [p[key] for p in r["curve"]])) for key in ("tokens", "val_bpb")}
    return seconds, at


def _equal_seconds_table(training: dict) -> list[str]:
    """Validation bits per byte at equal tokens (the run's end) and at equal training seconds."""
    seconds, at = at_equal_seconds(training)
    lines = ["", f"## At equal tokens and at equal seconds: validation bits/byte at the end of training and at "
             f"{seconds:,.0f} s, when the first model finished", "",
             "Read off each model's validation curve, linearly between two validations (`eval_points` sets how "
             "many); the seconds are each run's wall time, validations included.", "",
             "| model | at equal tokens | at equal seconds | tokens trained by then |", "|---|---:|---:|---:|"]
    for kind, r in training.items():
        cell = at[kind]
        lines.append(f"| {kind} | {r['val_bpb']:.4f} | " + ("- (no validation yet) | - |" if cell is None else
                     f"{cell['val_bpb']:.4f} | {cell['tokens']:,.0f} |"))
    return lines


def _lr_sweep_table(report: dict) -> list[str]:
    """Validation bits/byte of every model at every rate its sweep tried: the configured ones, and those it
    added beyond an edge where its best lay (none without a sweep)."""
    if not report["lr_sweep"]:
        return []
    rates = sorted({row["lr"] for rows in report["lr_sweep"].values() for row in rows})
    lines = ["", f"## Learning-rate sweep: validation bits/byte after "
             f"{next(iter(report['lr_sweep'].values()))[0]['tokens']:,} tokens (the best trains in full; configured "
             f"{', '.join(f'{lr:g}' for lr in report['config']['lr_sweep'])}, widened where the best lay at an edge)",
             "", "| model | " + " | ".join(f"lr {lr:g}" for lr in rates) + " |", "|---|" + "---:|" * len(rates)]
    for kind, rows in report["lr_sweep"].items():
        score = {row["lr"]: row["val_bpb"] for row in rows}
        lines.append(f"| {kind} | " + " | ".join(f"{score[lr]:.4f}" if lr in score else "-" for lr in rates) + " |")
    return lines


def markdown(report: dict) -> str:
    """The report as Markdown: training table, sweep table, ratios, caps and method."""
    training, sweep, caps = report["training"], report["sweep"], report["caps"]
    cfg = report["config"]
    lines = ["# sheafgnn compare\n",
             f"{cfg['tokens']:,} training tokens per model, context {cfg['context']}, batch {cfg['batch_size']}, "
             f"seed {cfg['seed']}, corpus `{cfg['corpus']}` (byte tokenizer), device {report['device']}, "
             f"{report['threads']} thread(s) on {report['cpu_count']} CPU(s).\n",
             "| model | d_model | params | peak lr | val bits/byte | training objective, last 10% of steps (nats) "
             "| loss on train / val windows (nats) | train tok/s | infer tok/s | infer tok/s (with site) "
             "| peak train RSS (MiB) | peak train extra (MiB) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for kind, r in training.items():
        peak = r.get("train_peak_rss_bytes", r.get("train_peak_bytes"))
        lines.append(f"| {kind} | {r['options']['d_model']} | {r['params']:,} | {r['lr']:g} | {r['val_bpb']:.4f} "
                     f"| {r['train_loss_smoothed']:.4f} | {r['train_windows_loss']:.4f} / "
                     f"{r['validation_windows_loss']:.4f} "
                     f"| {r['train_tokens_per_s']:,.0f} | {r['infer_tokens_per_s']:,.0f} "
                     f"| {r['infer_tokens_per_s_with_site']:,.0f} | {_mib(peak)} "
                     f"| {_mib(r['train_peak_extra_bytes'])} |")
    lines += ["", standing(training), "",
              "The training objective is what the optimizer minimised: for sheaf, the next-token loss plus "
              "its auxiliary losses (each block's pool read, the experts' balance), so it is not comparable "
              "with a validation loss. The loss on train / val windows is one measure for both texts: the "
              f"trained model's next-token loss on {cfg['eval_batches'] * cfg['batch_size']} windows spread evenly "
              "over each (the generalisation gap)."]
    if report.get("reused"):
        lines += ["", f"Kept from an earlier run of the same settings in this folder, not trained again: "
                  f"{', '.join(report['reused'])}."]
    lines += _lr_sweep_table(report)
    lines += _equal_seconds_table(training)
    lines += _by_distance_table(training, cfg)
    kinds = list(sweep)
    lines += ["", "## Context sweep: one window, site build + forward + backward", "",
              "Forward+backward seconds / peak extra MiB (site build seconds in brackets).", "",
              "| n | " + " | ".join(kinds) + " |", "|---:|" + "---:|" * len(kinds)]
    for i, n in enumerate(cfg["sweep"]):
        cells = []
        for kind in kinds:
            p = sweep[kind][i]
            cells.append("skipped" if p["skipped"] else
                         f"{p['fwd_bwd_s']:.2f} s / {_mib(p['peak_extra_bytes'])} MiB ({p['build_s']:.2f})"
                         + (" over cap" if p.get("over_cap") else ""))
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    lines += ["", f"Caps, the same for every model: forward+backward over {caps['time_cap_s']:g} s or peak extra "
              f"memory over {caps['memory_cap_gb']:g} GiB at some n skips the larger n.", "",
              "## Sheaf vs dense", ""]
    if not report["ratios"]:
        lines.append("No ratio: the sweep reached neither 16k nor 32k for both models.")
    for n, r in report["ratios"].items():
        if r["time_ratio"] is None:
            bound = r.get("time_ratio_at_least")
            lines.append(f"- n = {n}: {r['dense_model']} {r['dense']}; sheaf {r['sheaf_fwd_bwd_s']:.2f} s"
                         + (f", so dense/sheaf time >= {bound:.2f}x" if bound else ""))
        else:
            lines.append(f"- n = {n}: sheaf forward+backward {r['time_ratio']:.2f}x faster than {r['dense_model']} "
                         f"({r['sheaf_fwd_bwd_s']:.2f} s vs {r['dense_fwd_bwd_s']:.2f} s; "
                         f"{r['total_time_ratio']:.2f}x with site building), peak extra memory "
                         f"{r['memory_ratio']:.3f} of dense's ({_mib(r['sheaf_peak_extra_bytes'])} vs "
                         f"{_mib(r['dense_peak_extra_bytes'])} MiB)")
    if not cfg["isolate"]:
        where = ("this one process, one after another (--in-process; free memory is trimmed before each phase, "
                 "but what earlier models left cached can make later models' extra memory read low).")
    elif cfg.get("jobs", 1) > 1:
        where = (f"its own fresh process, {cfg['jobs']} models training at once (their training tokens/s share the "
                 "machine); the context sweep ran one model at a time.")
    else:
        where = "its own fresh process."
    lines += ["", f"Memory: {report['memory_method']}; 'extra' is the peak minus the resident set at the start of "
              f"the phase (see `sheafgnn.experiments.compare`). Each model ran in {where}"]
    return "\n".join(lines) + "\n"


def figures(report: dict) -> dict:
    """The report's figures by file name: training.png (bits per byte, tokens/s, memory), curves.png
    (validation bits per byte against training tokens and seconds), sweep.png."""
    plt = pyplot()
    training, sweep = report["training"], report["sweep"]
    kinds = list(training)
    training_fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    axes[0].bar(kinds, [training[k]["val_bpb"] for k in kinds], color="tab:blue")
    axes[0].set_title("validation bits per byte")
    x = range(len(kinds))
    axes[1].bar([i - 0.2 for i in x], [training[k]["train_tokens_per_s"] for k in kinds], 0.4, label="train")
    axes[1].bar([i + 0.2 for i in x], [training[k]["infer_tokens_per_s"] for k in kinds], 0.4, label="inference")
    axes[1].set_xticks(list(x), kinds)
    axes[1].set_title("tokens / s")
    axes[1].legend()
    axes[2].bar(kinds, [training[k]["train_peak_extra_bytes"] / MIB for k in kinds], color="tab:red")
    axes[2].set_title("peak extra memory in training (MiB)")

    sweep_fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for kind, points in sweep.items():
        done = [p for p in points if not p["skipped"]]
        axes[0].plot([p["n"] for p in done], [p["fwd_bwd_s"] for p in done], "o-", label=kind)
        axes[1].plot([p["n"] for p in done], [p["peak_extra_bytes"] / MIB for p in done], "o-", label=kind)
    axes[0].axhline(report["caps"]["time_cap_s"], color="grey", ls="--", lw=1, label="time cap")
    for ax, title in zip(axes, ("forward+backward (s)", "peak extra memory (MiB)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context length n")
        ax.set_title(title)
        ax.legend()
    curves_fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for kind, r in training.items():
        label = f"{kind} (lr {r['lr']:g})"
        axes[0].plot([p["tokens"] for p in r["curve"]], [p["val_bpb"] for p in r["curve"]], "o-", label=label)
        axes[1].plot([p["elapsed_s"] for p in r["curve"]], [p["val_bpb"] for p in r["curve"]], "o-", label=label)
    for ax, xlabel in zip(axes, ("training tokens", "training seconds (validation included)")):
        ax.set_xlabel(xlabel)
        ax.set_ylabel("validation bits per byte")
        ax.grid(True, alpha=0.3)
        ax.legend()
    return {"training.png": training_fig, "curves.png": curves_fig, "sweep.png": sweep_fig}
