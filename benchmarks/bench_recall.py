"""Recall as the field measures it: MQAR and a scattered layout, every seed, a learning-rate sweep per model.

One default sheaf model (the default ``SheafStateConfig``; only the vocabulary, the length and the width come
from the task), hash retrieval off, against attention with the short conv every Zoology baseline has
(``dense_conv``), plain attention (``dense``) and the sheaf model's own ssm ablation (``ssm``), each at the
parameter count of the sheaf model (``sheafgnn.lm.matched_options``). Fresh rows every step, vocabulary 1,024,
batches of 32 rows, at most 3,000 steps, tested every 100 steps on 64 held-out rows and stopped at 0.99
(Zoology's early stop)::

    sweep      MQAR (128, 8), seed 0, each model at the 3 rates of RATES; the best is the middle of the rates
               that pass 0.99 (else the most accurate); at an edge of the sweep it widens the sweep by one rate
               on that side (up to WIDEN times); the best trains every run after
    sizes      MQAR (128, 8), (256, 16) and (512, 32), seeds 0-2; (256, 16) is also tested at 1,024 and 4,096
               tokens with the same pair density (length generalisation)
    scattered  scattered_recall (256, 16), seeds 0-2: binds anywhere in the row, queries at random distances
    induction  induction heads trained at 256 tokens, tested at 256, 1k, 4k and 16k, seeds 0-2
    components the sheaf model with one part switched (``--variants``, default :data:`COMPONENTS`: the
               restriction maps fixed to the identity, orthogonal or general, or started the other way, each
               patch type of the task site, the proposals, QK-norm, the previous-token key's start, the gate),
               on MQAR (256, 16) (``--component-sizes``: others, e.g. ``256x16 512x32``), seeds 0-2;
               the default itself (diag maps) is the sizes stage's. The changes are bench_ablation's
               (:mod:`sheafgnn.experiments.components`), so a part's text and recall verdicts are of one change

Every run is one ``sheafgnn tasks`` process (one model, task, seed and rate; one thread) whose report lands in
``<out>/runs/<name>/tasks.json``; a run whose report exists is not run again, so the stages resume where they
stopped. ``--jobs`` runs go at once (2 on a 2-core machine: the times of concurrent runs share it).

Usage::

    python benchmarks/bench_recall.py [--stages sweep sizes ...] [--models sheaf dense_conv ...] [--jobs 2]
        [--seeds 0 1 2] [--variants no_local ...] [--component-sizes 256x16 ...] [--out benchmarks/results/recall]
        [--quick] [--report]
    -> <out>/summary.json (rows: task, seq_len, pairs, vocab, model, variant, map_kind, seed, lr,
       hash_retrieval, accuracy, steps, seconds), <out>/recall.md, <out>/recall.png (accuracy against steps,
       every run drawn)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from sheafgnn.experiments.components import component_changes, without_patch_type
from sheafgnn.experiments.report import pyplot, save_figure, write_json
from sheafgnn.experiments.task_runner import TASK_SITE

MODELS = ("sheaf", "dense_conv", "dense", "ssm")
RATES = {"sheaf": (3e-4, 1e-3, 3e-3), "dense_conv": (1e-3, 3e-3, 1e-2), "dense": (1e-3, 3e-3, 1e-2),
         "ssm": (1e-3, 3e-3, 1e-2)}
WIDEN = 2  # extra rates a sweep may add on the side of its best
SEEDS = (0, 1, 2)
STAGES = ("sweep", "sizes", "scattered", "induction", "components")
# the parts switched on recall: the restriction maps of issue 35's table, and every part that text alone does not
# justify (docs/results.md#ablation-of-the-default-what-each-part-pays-on-text)
COMPONENTS = ("identity_maps", "orthogonal_maps", "general_maps", "map_init", "no_workspace", "no_content_proposals",
              "random_proposals", "qk_norm", "key_previous_init", "rezero_gate", "gate_init")
BUDGET = {"steps": 3000, "batch_size": 32, "eval_every": 100, "stop_accuracy": 0.99, "test_examples": 64,
          "warmup_steps": 50, "d_model": 64, "n_layers": 2, "n_heads": 2}
QUICK = {"steps": 4, "batch_size": 4, "eval_every": 2, "stop_accuracy": 0.99, "test_examples": 4, "warmup_steps": 1,
         "d_model": 64, "n_layers": 2, "n_heads": 2}
VOCAB = 1024
MQAR_SIZES = ((128, 8), (256, 16), (512, 32))
SCATTERED = (256, 16)
INDUCTION_LENGTHS = (256, 1024, 4096, 16384)  # trained at the first
LENGTHS = (1024, 4096)  # MQAR (256, 16) also tested here, at its pair density
# --quick: toy sizes that check the plumbing in a few minutes
QUICK_SIZES = {"vocab": 64, "mqar": ((32, 2), (64, 4), (128, 8)), "scattered": (48, 4), "induction": (32, 64),
               "lengths": (), "components": ((64, 4),)}
SIZES = {"vocab": VOCAB, "mqar": MQAR_SIZES, "scattered": SCATTERED, "induction": INDUCTION_LENGTHS,
         "lengths": LENGTHS, "components": ((256, 16),)}
SUMMARY = ("task", "seq_len", "pairs", "vocab", "model", "variant", "map_kind", "seed", "lr", "hash_retrieval",
           "accuracy", "steps", "seconds")


def task_flags(task: str, seq_len: int, pairs: int | None, sizes: dict) -> list[str]:
    """The ``sheafgnn tasks`` flags of one task at one size (``sizes``: :data:`SIZES` or :data:`QUICK_SIZES`)."""
    vocab = str(sizes["vocab"])
    if task == "mqar":
        tests = sizes["lengths"] if seq_len == sizes["mqar"][1][0] else ()
        return ["--tasks", "mqar", "--mqar-seq-len", str(seq_len), "--mqar-pairs", str(pairs), "--mqar-vocab",
                vocab] + (["--mqar-test-lens", *map(str, tests)] if tests else [])
    if task == "scattered_recall":
        return ["--tasks", "scattered_recall", "--scatter-seq-len", str(seq_len), "--scatter-pairs", str(pairs),
                "--mqar-vocab", vocab]
    lengths = sizes["induction"]
    return ["--tasks", "induction_heads", "--induction-train-len", str(lengths[0]), "--induction-test-lens",
            *map(str, lengths)]


def mqar_size(text: str) -> tuple[int, int]:
    """``"512x32"`` -> (512, 32): an MQAR length and its number of pairs."""
    try:
        seq_len, pairs = map(int, text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"an MQAR size is LENxPAIRS, e.g. 256x16 (got {text!r})") from None
    if not 0 < 2 * pairs < seq_len:
        raise argparse.ArgumentTypeError(f"an MQAR size needs 0 < 2 * pairs < length (got {text!r})")
    return seq_len, pairs


def run_name(task: str, seq_len: int, model: str, lr: float, seed: int, variant: str = "") -> str:
    return f"{task}{seq_len}_{model}{'_' * bool(variant)}{variant}_lr{lr:g}_s{seed}"


def variant_options() -> dict[str, dict]:
    """Variant -> the sheaf model's ``sheaf`` and ``site`` options (the task site's own for the default, "")."""
    options = {"": {"sheaf": {}, "site": TASK_SITE}}
    options |= {name: {"sheaf": change, "site": TASK_SITE} for name, change in component_changes().items()}
    switchable = [p for p in TASK_SITE["patch_types"] if p != "output"]  # output is the readout: always on
    options |= {f"no_{p}": {"sheaf": {}, "site": {**TASK_SITE, **without_patch_type(TASK_SITE["patch_types"], p)}}
                for p in switchable}
    return options


def variant_of(config: dict) -> str:
    """The variant a run's ``sheafgnn tasks`` config trained ("-": the default; JSON: options of no variant)."""
    options = {"sheaf": config["sheaf"], "site": config["site"]}
    name = next((name for name, known in variant_options().items() if known == options), None)
    return json.dumps(options) if name is None else name or "-"


def run(out: Path, name: str, flags: list[str], budget: dict) -> dict:
    """One ``sheafgnn tasks`` process (unless its report exists): its tasks.json."""
    report = out / "runs" / name / "tasks.json"
    if not report.exists():
        log = out / "runs" / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        args = [sys.executable, "-m", "sheafgnn.cli", "tasks", "--out", str(report.parent), "--num-threads", "1",
                "--no-progress", *flags]
        for key, value in budget.items():
            args += [f"--{key.replace('_', '-')}", str(value)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        with open(log, "w") as f:
            done = subprocess.run(args, stdout=f, stderr=subprocess.STDOUT, env=env)
        if done.returncode:
            raise RuntimeError(f"bench_recall: run {name} failed (exit {done.returncode}); see {log}")
        print(f"  done {name}: {log.read_text().splitlines()[-1] if log.stat().st_size else ''}", flush=True)
    return json.loads(report.read_text())


def runs_at_once(out: Path, jobs: int, specs: list[tuple[str, list[str]]], budget: dict) -> dict[str, dict]:
    """Each (name, flags) of ``specs``, ``jobs`` at a time: name -> its report."""
    with ThreadPoolExecutor(jobs) as pool:
        reports = pool.map(lambda spec: run(out, *spec, budget), specs)
        return dict(zip([name for name, _ in specs], reports))


def final_accuracy(report: dict) -> tuple[float, int]:
    """(accuracy at the training length, steps trained) of a one-model, one-task report."""
    (task,) = report["tasks"].values()
    (model,) = task["models"].values()
    return model["accuracy"][str(task["train_len"])], model["steps"]


def best_rate(scores: dict[float, tuple[float, int]], stop_accuracy: float) -> float:
    """The middle of the rates whose runs reached ``stop_accuracy`` (the lower of two middles), else the most
    accurate (then the fewest steps).

    A run stops at its first test at or above ``stop_accuracy``, so the accuracies of passing runs are not ranked:
    they differ by an answer or two of the test. Each end of the passing rates has failed a larger size where the
    rate next to it passed: the largest at (256, 16) seed 1 (the default of 509a9dd at 3e-3, dense_conv at 1e-2:
    on the plateau), the lowest at (512, 32) seed 1 (the default of cd576a1 at 3e-4: at chance after the budget,
    where 1e-3 passes every seed). The middle is the farthest from both
    (docs/results.md#the-rate-of-a-sweep-the-middle-of-those-that-pass)."""
    passing = sorted(lr for lr, (accuracy, _) in scores.items() if accuracy >= stop_accuracy)
    return passing[(len(passing) - 1) // 2] if passing else max(scores, key=lambda lr: (scores[lr][0], -scores[lr][1]))


def sweep(out: Path, models: tuple[str, ...], jobs: int, budget: dict, sizes: dict) -> dict[str, float]:
    """Each model's rate on the first MQAR size at seed 0 (:func:`best_rate`), widened at an edge."""
    seq_len, pairs = sizes["mqar"][0]
    flags = task_flags("mqar", seq_len, pairs, sizes)
    rates = {m: list(RATES[m]) for m in models}
    best = {}
    for _ in range(WIDEN + 1):
        specs = [(run_name("mqar", seq_len, m, lr, 0), flags + ["--models", m, "--lr", f"{lr:g}", "--seed", "0"])
                 for m in models if m not in best for lr in rates[m]]
        reports = runs_at_once(out, jobs, specs, budget)
        for m in [m for m in models if m not in best]:
            scores = {lr: final_accuracy(reports[run_name("mqar", seq_len, m, lr, 0)]) for lr in rates[m]}
            top = best_rate(scores, budget["stop_accuracy"])
            edge = rates[m].index(top) in (0, len(rates[m]) - 1) and len(set(scores.values())) > 1
            if not edge or len(rates[m]) >= len(RATES[m]) + WIDEN:
                best[m] = top
            else:  # widen on the side of the best by one step of the half-decade grid (1e-2 -> 3e-2 -> 1e-1)
                low = top == rates[m][0]
                new = float(f"{10 ** ((round(2 * math.log10(top)) + (-1 if low else 1)) / 2):.1g}")
                rates[m].insert(0, new) if low else rates[m].append(new)
        if len(best) == len(models):
            break
    # a sweep of some models keeps the rates of the others swept before
    done = json.loads((out / "rates.json").read_text()) if (out / "rates.json").exists() else {"best": {}, "swept": {}}
    write_json(out / "rates.json", {"best": {**done["best"], **best}, "swept": {**done["swept"], **rates}})
    return best


def swept_models(stages: list[str], models: tuple[str, ...]) -> tuple[str, ...]:
    """The models whose rates the stages train at (a finished sweep's runs are reused): every model's, but only
    the sheaf model's when the components stage runs alone, since it trains only the sheaf model."""
    if set(stages) == {"components"}:
        return ("sheaf",)
    return models if "components" not in stages or "sheaf" in models else ("sheaf", *models)


def stage_specs(stage: str, models: tuple[str, ...], best: dict[str, float], sizes: dict, seeds: tuple[int, ...],
                variants: tuple[str, ...] = COMPONENTS) -> list[tuple[str, list]]:
    """The runs of a stage after the sweep: (name, flags)."""
    if stage == "components":
        options, lr = variant_options(), best["sheaf"]
        return [(run_name("mqar", n, "sheaf", lr, seed, variant),
                 task_flags("mqar", n, pairs, sizes) + ["--models", "sheaf", "--lr", f"{lr:g}", "--seed", str(seed),
                                                        "--sheaf", json.dumps(options[variant]["sheaf"]),
                                                        "--site", json.dumps(options[variant]["site"])])
                for n, pairs in sizes["components"] for variant in variants for seed in seeds]
    runs = {"sizes": [("mqar", n, p) for n, p in sizes["mqar"]],
            "scattered": [("scattered_recall", *sizes["scattered"])],
            "induction": [("induction_heads", sizes["induction"][0], None)]}[stage]
    return [(run_name(task, n, model, best[model], seed),
             task_flags(task, n, pairs, sizes) + ["--models", model, "--lr", f"{best[model]:g}", "--seed", str(seed)])
            for task, n, pairs in runs for model in models for seed in seeds]


def summary_rows(out: Path) -> list[dict]:
    """Every finished run's rows (one per test length) with the fields of :data:`SUMMARY`."""
    rows = []
    for report in sorted((out / "runs").glob("*/tasks.json")):
        data = json.loads(report.read_text())
        for row in data["summary"]:
            # a baseline reads no site nor sheaf options: its runs are of no variant, whichever site they were given
            variant = variant_of(data["config"]) if row.get("model") == "sheaf" else "-"
            rows.append({k: row.get(k) for k in SUMMARY} | {"variant": variant,
                                                            "map_kind": row.get("map_kind") or "-",
                                                            "run": report.parent.name})
    return rows


def curves(out: Path) -> dict:
    """The accuracy-against-steps figure: a panel per task and training length, every run drawn."""
    plt = pyplot()
    runs = {}
    for report in sorted((out / "runs").glob("*/tasks.json")):
        data = json.loads(report.read_text())
        for task, r in data["tasks"].items():
            for model, m in r["models"].items():
                variant = variant_of(data["config"])
                kind = model if variant == "-" else f"{model} {variant}"
                runs.setdefault((task, r["train_len"]), []).append((kind, data["config"]["lr"], data["config"]["seed"],
                                                                    m["curve"]))
    if not runs:
        return {}
    panels = sorted(runs)
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), squeeze=False)
    colors = {}  # one per model and rate (the sweep draws each rate; later stages train at one)
    for ax, key in zip(axes[0], panels):
        for kind, lr, seed, curve in runs[key]:
            color = colors.setdefault((kind, lr), f"C{len(colors) % 10}")
            ax.plot([0] + [p["step"] for p in curve], [0.0] + [p["accuracy"] for p in curve], color=color,
                    linestyle=("-", "--", ":")[seed % 3], label=f"{kind} lr {lr:g} seed {seed}", linewidth=1.2)
        ax.set_title(f"{key[0]} @{key[1]}")
        ax.set_xlabel("steps (32 rows each)")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("accuracy (held-out rows)")
    unique = {}
    for ax in axes[0]:
        unique.update(zip(*reversed(ax.get_legend_handles_labels())))
    # beside the last panel: save_figure's tight layout makes room for an axes' legend, not for a figure's
    axes[0][-1].legend(unique.values(), unique.keys(), fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    return {"recall.png": fig}


def markdown(rows: list[dict], rates: dict, budget: dict, sizes: dict) -> str:
    """A table per task and training length: accuracy (steps) per model and seed."""
    lines = ["# Recall (benchmarks/bench_recall.py)", "",
             f"Budget per run: {budget['steps']} steps of {budget['batch_size']} fresh rows, early stop at "
             f"{budget['stop_accuracy']}, vocabulary {sizes['vocab']}, hash retrieval off. Best rates of the sweep: "
             f"{json.dumps(rates) if rates else 'none yet (the sweep has not finished)'}.", ""]
    by_task = {}
    for row in rows:
        by_task.setdefault((row["task"], row["seq_len"], row["pairs"]), []).append(row)
    for (task, n, pairs), group in sorted(by_task.items()):
        lines += [f"## {task} at {n} tokens" + (f", {pairs} pairs" if pairs else ""), "",
                  "| model | variant | lr | seed | accuracy | steps | seconds |", "|---|---|---:|---:|---:|---:|---:|"]
        for r in sorted(group, key=lambda r: (r["model"], r["variant"], r["lr"], r["seed"])):
            lines.append(f"| {r['model']} | {r['variant']} | {r['lr']:g} | {r['seed']} | {r['accuracy']:.4f} | "
                         f"{r['steps']} | {r['seconds']:.0f} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", nargs="+", default=list(STAGES), choices=STAGES)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--seeds", nargs="+", type=int, default=list(SEEDS), help="seeds of the stages after the sweep")
    parser.add_argument("--variants", nargs="+", default=list(COMPONENTS), help="the components stage's variants",
                        choices=sorted(set(variant_options()) - {""}))
    parser.add_argument("--component-sizes", nargs="+", type=mqar_size, metavar="LENxPAIRS",
                        help="the components stage's MQAR sizes (default 256x16)")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results/recall")
    parser.add_argument("--quick", action="store_true", help="toy sizes that run in seconds")
    parser.add_argument("--report", action="store_true",
                        help="run nothing: write the summary, table and figure of the runs already in --out")
    args = parser.parse_args(argv)
    out, models = Path(args.out), tuple(args.models)
    budget, sizes = (QUICK, QUICK_SIZES) if args.quick else (BUDGET, SIZES)
    if args.component_sizes:
        sizes = {**sizes, "components": tuple(args.component_sizes)}
    out.mkdir(parents=True, exist_ok=True)
    if not args.report:
        print("== sweep ==", flush=True)
        best = sweep(out, swept_models(args.stages, models), args.jobs, budget, sizes)
        for stage in [s for s in args.stages if s != "sweep"]:
            print(f"== {stage} ==", flush=True)
            specs = stage_specs(stage, models, best, sizes, tuple(args.seeds), tuple(args.variants))
            runs_at_once(out, args.jobs, specs, budget)
    rows = summary_rows(out)
    if not rows:
        raise SystemExit(f"bench_recall: no finished run in {out / 'runs'}")
    write_json(out / "summary.json", rows)
    # every model's swept rate, this run's and earlier ones' (a sweep not run to its end has none yet)
    rates = json.loads((out / "rates.json").read_text())["best"] if (out / "rates.json").exists() else {}
    text = markdown(rows, rates, budget, sizes)
    for name, fig in curves(out).items():
        save_figure(fig, out / name, dpi=120)
        text += f"\n![{name}]({name})\n"
    (out / "recall.md").write_text(text)
    print(f"wrote {out / 'summary.json'}, {out / 'recall.md'}, {out / 'recall.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
