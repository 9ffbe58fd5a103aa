"""The ``sheafgnn tasks`` report: summary rows (merged across runs), Markdown, figures.

Reads the dict :func:`sheafgnn.experiments.task_runner.run_tasks` builds (``tasks.json``): nothing here
trains or evaluates.
"""

from __future__ import annotations

import json
from pathlib import Path

from sheafgnn.experiments.report import pyplot, write_json
from sheafgnn.flat_keys import FLAT_KEYS
from sheafgnn.model import SheafStateConfig

SUMMARY_KEY = ("task", "seq_len", "train_len", "pairs", "vocab", "model", "hash_retrieval", "topology_rank",
               "topology_k", "content_blocks", "proposal_block", "pool_loss_weight", "block_scorer",
               "block_summary", "sink_threshold", "keep_cost", "map_kind", "warmup", "lr", "seed",
               "steps")  # one row per key


def _summary_key(row: dict) -> tuple:
    # rows written before a key existed lack it: None (block_scorer, block_summary, sink_threshold, keep_cost,
    # map_kind, seed)
    return tuple(str(row.get(k)) if isinstance(row.get(k), list) else row.get(k) for k in SUMMARY_KEY)


def _summary_order(row: dict) -> tuple:
    return tuple(str(v) for v in _summary_key(row))


def summary_rows(report: dict) -> list[dict]:
    """One row per task, test length and model: ``task, seq_len, train_len, pairs, vocab, model, hash_retrieval,
    topology_rank, topology_k, content_blocks, proposal_block, pool_loss_weight, block_scorer, block_summary,
    sink_threshold, keep_cost, warmup, lr, accuracy, steps, tokens, seconds`` (``pairs``: MQAR only;
    ``hash_retrieval``: whether the sheaf model's site had its hash retrieval rule, False for the models that
    read ids only; ``topology_rank`` ... ``keep_cost``: the sheaf model's topology and its training, None for
    the others; ``warmup``: the MQAR curriculum's [sequence, pairs, steps] trained first, None without;
    ``steps``, ``tokens`` and ``seconds`` count it in). A curriculum also gives the row of its final model on
    the warm-up task: ``seq_len`` and ``pairs`` the warm-up's, ``train_len`` the main task's.)"""
    cfg, rows = report["config"], []
    sheaf = SheafStateConfig.from_dict(cfg["sheaf"]).to_dict()
    topology = ("topology_rank", "topology_k", "content_blocks", "proposal_block", "pool_loss_weight",
                "block_scorer", "block_summary", "sink_threshold", "keep_cost", "map_kind")  # FLAT_KEYS' names
    for task, r in report["tasks"].items():
        for kind, m in r["models"].items():
            for length, accuracy in m["accuracy"].items():
                rows.append({"task": task, "seq_len": int(length), "train_len": r["train_len"],
                             "pairs": _pairs(cfg, task, int(length)), "vocab": r["vocab_size"],
                             "model": kind, "hash_retrieval": bool(cfg["hash_retrieval"]) and kind == "sheaf",
                             **{k: _field(sheaf, k) if kind == "sheaf" else None for k in topology}, "lr": cfg["lr"],
                             "seed": cfg["seed"], **_budget(cfg, task, r["train_len"], m), "accuracy": accuracy})
            if "final_accuracy" in m.get("warmup", {}):  # the curriculum's final model on its warm-up task
                short_len, short_pairs, _ = cfg["mqar_warmup"]
                rows.append({**rows[-1], "seq_len": short_len, "pairs": short_pairs,
                             "accuracy": m["warmup"]["final_accuracy"]})
    return sorted(rows, key=_summary_order)


def _field(sheaf: dict, key: str):
    """A summary row's field of the sheaf config (its nested dict), by its flat name (:data:`FLAT_KEYS`)."""
    group, name = FLAT_KEYS[key]
    return sheaf[group][name]


def _pairs(cfg: dict, task: str, length: int) -> int | None:
    """Key-value pairs per row of a recall task at a test ``length`` (MQAR keeps its training density)."""
    if task == "mqar":
        return length * cfg["mqar_pairs"] // cfg["mqar_seq_len"]
    return cfg["scatter_pairs"] if task == "scattered_recall" else None


def _budget(cfg: dict, task: str, train_len: int, m: dict) -> dict:
    """warmup, steps (trained: an early stop ends them before ``cfg["steps"]``), tokens and seconds of one model's
    training on one task, its curriculum included."""
    warmup = list(cfg.get("mqar_warmup") or ()) if task == "mqar" else []
    short_len, _, short_steps = warmup or (0, 0, 0)
    steps = m.get("steps", cfg["steps"])  # reports written before early stopping trained every step
    return {"warmup": warmup or None, "steps": steps + short_steps,
            "tokens": (steps * train_len + short_steps * short_len) * cfg["batch_size"],
            "seconds": m["train_s"] + m.get("warmup", {}).get("train_s", 0.0)}


def merge_summary(path: Path, rows: list[dict]) -> list[dict]:
    """Merge ``rows`` into the JSON list at ``path`` (a row replaces the one with the same key); returns it."""
    merged = {_summary_key(row): row for row in (json.loads(path.read_text()) if path.exists() else [])}
    merged.update({_summary_key(row): row for row in rows})
    ordered = sorted(merged.values(), key=_summary_order)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, ordered)
    return ordered

THRESHOLD = 0.99  # "solved"


def _columns(report: dict) -> list[tuple[str, str]]:
    cols = []
    for task, r in report["tasks"].items():
        for n in r["test_lens"]:
            cols.append((task, str(n)))
    return cols


def _label(task: str, n: str, report: dict) -> str:
    short = {"mqar": "MQAR", "scattered_recall": "scattered", "selective_copying": "sel. copy",
             "induction_heads": "induction"}[task]
    return f"{short} @{n}" if task == "induction_heads" or len(report["tasks"][task]["test_lens"]) > 1 else short


def shortfalls(report: dict) -> list[str]:
    """Lines naming every (task, length) where dense reaches the threshold and another model does not."""
    lines = []
    for task, n in _columns(report):
        models = report["tasks"][task]["models"]
        if "dense" not in models or models["dense"]["accuracy"][n] < THRESHOLD:
            continue
        for kind, r in models.items():
            if kind != "dense" and r["accuracy"][n] < THRESHOLD:
                lines.append(f"- {_label(task, n, report)}: {kind} {r['accuracy'][n]:.3f} vs dense "
                             f"{models['dense']['accuracy'][n]:.3f}")
    return lines


def markdown(report: dict) -> str:
    """The report as Markdown: accuracy table, parameters, shortfalls, setup."""
    cfg, cols = report["config"], _columns(report)
    models = list(cfg["models"])
    lines = ["# sheafgnn tasks\n",
             f"Accuracy on the scored positions of held-out rows; {cfg['steps']} steps of {cfg['batch_size']} rows "
             f"per task and model, seed {cfg['seed']}, {report['threads']} thread(s), "
             f"{report['elapsed_s'] / 60:.1f} min in all.\n",
             "| model | " + " | ".join(_label(t, n, report) for t, n in cols) + " |",
             "|---|" + "---:|" * len(cols)]
    for kind in models:
        lines.append(f"| {kind} | " + " | ".join(f"{report['tasks'][t]['models'][kind]['accuracy'][n]:.3f}"
                                                 for t, n in cols) + " |")
    lines += ["", "Parameters (d_model) and training time per task:", "",
              "| model | " + " | ".join(report["tasks"]) + " |", "|---|" + "---:|" * len(report["tasks"])]
    for kind in models:
        cells = [f"{r['models'][kind]['params']:,} ({r['models'][kind]['d_model']}), "
                 f"{r['models'][kind]['train_s']:.0f} s" for r in report["tasks"].values()]
        lines.append(f"| {kind} | " + " | ".join(cells) + " |")
    short = shortfalls(report)
    lines += ["", f"## Where a model falls short of {THRESHOLD} that dense reaches", ""]
    lines += short or ["- none (or dense reaches it nowhere)"]
    lines += ["", "## Setup", "",
              f"- MQAR: sequence {cfg['mqar_seq_len']}, {cfg['mqar_pairs']} pairs, vocabulary {cfg['mqar_vocab']}; "
              f"selective copying: sequence {cfg['copy_seq_len']}, {cfg['copy_tokens']} tokens, vocabulary "
              f"{cfg['copy_vocab']}; induction heads: vocabulary {cfg['induction_vocab']}, trained at "
              f"{cfg['induction_train_len']}, tested with {cfg['test_examples']} rows at the training length and "
              f"{cfg['induction_long_examples']} rows at each longer one.",
              f"- Models: sheaf d_model {cfg['d_model']}, {cfg['n_layers']} layer(s); "
              + ("every model at the same d_model." if cfg["equal_width"] else
                 "dense, local and ssm widths matched to the sheaf model's parameter count (within 10%).")
              + f" Local window {cfg['window']}, {cfg['n_heads']} heads.",
              f"- Sheaf sites: `{json.dumps(cfg['site'])}`, hash retrieval "
              f"{'on' if cfg['hash_retrieval'] else 'off'}, with one neutral byte per id (see "
              "`sheafgnn.experiments.task_runner`); the baselines read token ids only.",
              f"- Training: AdamW, lr {cfg['lr']:g}, warm-up {cfg['warmup_steps']} + cosine, "
              f"clip {cfg['grad_clip']:g}, fresh rows each step from one seed (the same rows for every model)."]
    mqar = report["tasks"].get("mqar", {}).get("models", {})
    if cfg.get("mqar_warmup") and mqar:
        length, pairs, steps = cfg["mqar_warmup"]
        lines.append(f"- MQAR curriculum: {steps} steps at sequence {length}, {pairs} pairs first (its own cosine "
                     "schedule); accuracy there after them / after the whole run: "
                     + ", ".join(f"{kind} {m['warmup']['accuracy']:.3f} / "
                                 + (f"{m['warmup']['final_accuracy']:.3f}" if "final_accuracy" in m["warmup"] else "-")
                                 for kind, m in mqar.items() if "warmup" in m) + ".")
    return "\n".join(lines) + "\n"


def _curve_label(kind: str, config: dict, several_runs: bool) -> str:
    """The model, whether the sheaf model had the hash rule, and, when several runs share a figure,
    the sheaf model's settings over the default and every model's learning rate."""
    notes = ["hash retrieval"] if kind == "sheaf" and config["hash_retrieval"] else []
    if several_runs:
        if kind == "sheaf":
            notes.extend(f"{group} {value}" for group, value in config["sheaf"].items())
        notes.append(f"lr {config['lr']:g}")
    return f"{kind} ({', '.join(notes)})" if notes else kind


def curve_figure(reports: list[dict]):
    """Accuracy against training steps, one panel per task, one line per model and run: the runs of
    ``reports`` (``tasks.json`` contents) drawn together, so that runs with and without the hash
    rule share a figure."""
    plt = pyplot()
    tasks = list(dict.fromkeys(task for report in reports for task in report["tasks"]))
    fig, axes = plt.subplots(1, len(tasks), figsize=(5 * len(tasks), 3.6), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        for report in (rep for rep in reports if task in rep["tasks"]):
            r = report["tasks"][task]
            for kind, m in r["models"].items():
                label = _curve_label(kind, report["config"], len(reports) > 1)
                ax.plot([p["step"] for p in m["curve"]], [p["accuracy"] for p in m["curve"]], "o-", ms=3,
                        label=label)
        ax.axhline(THRESHOLD, color="grey", ls=":", lw=1)
        train_len = reports[0]["tasks"][task]["train_len"] if task in reports[0]["tasks"] else ""
        ax.set(xlabel="training steps", ylabel=f"accuracy @{train_len}", title=task, ylim=(-0.02, 1.02))
        ax.legend(fontsize=7, loc="center right")  # the curves sit near 0 and near 1
    return fig


def figures(report: dict) -> dict:
    """The report's figures by file name: curves.png (accuracy against training steps, per task and
    model) and induction.png (accuracy against test length), when run."""
    plt = pyplot()
    tasks = report["tasks"]
    fig = curve_figure([report])
    out = {"curves.png": fig}
    if "induction_heads" not in tasks:
        return out
    task = tasks["induction_heads"]
    fig, ax = plt.subplots(figsize=(6, 4))
    for kind, r in task["models"].items():
        lens = [int(n) for n in r["accuracy"]]
        ax.plot(lens, list(r["accuracy"].values()), "o-", label=kind)
    ax.axhline(1 / (task["vocab_size"] - 1), color="grey", ls=":", lw=1, label="chance")
    ax.axvline(task["train_len"], color="grey", ls="--", lw=1, label="train length")
    ax.set_xscale("log", base=2)
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("test length")
    ax.set_ylabel("accuracy")
    ax.set_title("induction heads")
    ax.legend()
    out["induction.png"] = fig
    return out
