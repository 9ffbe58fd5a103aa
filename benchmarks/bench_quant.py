"""QuantVect: validation bits per byte and model bytes of low-bit maps and experts.

Trains the same small sheaf model (d_model 64, 2 layers, context 256 by
default) on the default corpus for the same number of tokens in each
variant, with quantisation-aware training (:mod:`sheafgnn.nn.quant`):

    fp32          no quantisation
    int8          maps int8, experts int8
    int4_maps     maps int4, experts int8
    ternary_maps  maps ternary, experts int8
    int4          maps int4, experts int4         (not in the default list)
    ternary       maps ternary, experts ternary   (not in the default list)

"maps" is the map learner's weights and the produced per-edge restriction
maps. Every quantised run is exported to packed safetensors, loaded back and
evaluated again (``packed``: must equal the training graph), and once more
with int8 activations and ``torch._int_mm`` (``int_mm``: an approximation,
measured). The fp32 run is also quantised after training, without QAT
(``ptq_*`` rows). Targets: int8 within 1% of fp32 bits per byte, int4 maps
within 3%. With ``--seeds 0 1 2`` the spread between seeds shows the noise
that a 1% target is measured against.

``--init RUN_DIR`` starts every variant from a trained model instead of from
scratch: the run directory of ``sheafgnn train`` (or of one model of
``sheafgnn compare``, ``out/train/sheaf``) gives the model, site, context,
batch and corpus (its ``config.yaml``; the size flags are then ignored, and
``train_config`` in the JSON says what ran) and the weights (its latest
checkpoint). Each variant then fine-tunes ``--steps`` steps from those weights
(QAT for the quantised ones, plain training for fp32, the same steps and data),
so that the deltas are measured on a model that has learned something; the
checkpoint's own bits per byte is reported as ``init_bpb``.

Cost: a step of 8 x 256 tokens took about 2.8 s on 2 shared, loaded CPU
cores (d_model 64, 2 layers), so the default (200 steps = 410k tokens per
variant, 4 variants, one seed) takes roughly 20-40 minutes there; ``--steps
50`` fits in a few minutes but is short of a converged comparison.

Usage::

    python benchmarks/bench_quant.py [--steps 200] [--seeds 0 1 2] [--variants fp32 int8 int4_maps int4]
        [--init RUN_DIR] [--threads 2] [--out benchmarks/results]      -> quant.json, quant.png
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.data import Subset
from torch_geometric.loader import DataLoader

from sheafgnn import checkpoint as ckpt
from sheafgnn.data import scored_batches
from sheafgnn.lm import build_model
from sheafgnn.nn.quant import apply_quant
from sheafgnn.quantized import export_quantized, load_quantized, model_bytes
from sheafgnn.site import ByteTokenizer
from sheafgnn.train import TrainConfig, build_datasets, evaluate, train

VARIANTS = {
    "fp32": {},
    "int8": {"maps": "int8", "experts": "int8"},
    "int4_maps": {"maps": "int4", "experts": "int8"},
    "int4": {"maps": "int4", "experts": "int4"},
    "ternary_maps": {"maps": "ternary", "experts": "int8"},
    "ternary": {"maps": "ternary", "experts": "ternary"},
}
DEFAULT_VARIANTS = ("fp32", "int8", "int4_maps", "ternary_maps")
PTQ = ("int8", "int4_maps")  # post-training quantisation of the fp32 run
TARGETS = {"int8": 1.0, "int4_maps": 3.0}  # max % above fp32 bits per byte


def train_config(args, variant: str, seed: int, out_dir: Path) -> TrainConfig:
    """The run of one variant: from the flags, or from the ``--init`` run's config (model, site, data)."""
    quant = VARIANTS[variant]
    if args.init:
        init = TrainConfig.load(Path(args.init) / "config.yaml")
        data = {"model_config": {**init.model_config, "quant": quant}, "site": init.site, "corpus": init.corpus,
                "context": init.context, "batch_size": init.batch_size}
    else:
        data = {"model_config": {"d_model": args.d_model, "n_layers": args.n_layers, "quant": quant},
                "corpus": args.corpus, "context": args.context, "batch_size": args.batch_size}
    return TrainConfig(model="sheaf", **data, steps=args.steps, lr=args.lr,
                       warmup_steps=min(100, max(1, args.steps // 10)), eval_every=args.steps,
                       eval_batches=args.eval_batches, checkpoint_every=args.steps, keep_checkpoints=1,
                       out_dir=str(out_dir), num_threads=args.threads, seed=seed, tensorboard=False,
                       progress=args.progress, device="cpu")


def init_checkpoint(run_dir: str) -> Path:
    """The latest checkpoint of the training run at ``run_dir``."""
    path = ckpt.latest_checkpoint(Path(run_dir) / "checkpoints")
    if path is None or not (Path(run_dir) / "config.yaml").exists():
        raise SystemExit(f"--init {run_dir}: not a training run directory (config.yaml and checkpoints/latest)")
    return path


def validation_batches(config: TrainConfig) -> list:
    """The (batch, target bytes) pairs that ``train`` evaluates on (the same windows)."""
    tokenizer, datasets = build_datasets(config)
    val = datasets["validation"]
    n_val = min(len(val), config.eval_batches * config.batch_size)
    loader = DataLoader(Subset(val, list(range(n_val))), batch_size=config.batch_size)
    return scored_batches(loader, tokenizer)


def timed_bpb(model, batches) -> tuple[float, float]:
    """(validation bits per byte, seconds) of ``model`` on ``batches``."""
    start = time.perf_counter()
    metrics = evaluate(model, batches, torch.device("cpu"), False, 1)
    return metrics["val_bpb"], time.perf_counter() - start


def trained_model(config: TrainConfig, checkpoint: str):
    model = build_model(config.model, config.model_config, ByteTokenizer.vocab_size, config.site)
    ckpt.load_checkpoint(checkpoint, model)
    return model.eval()


def run_one(args, variant: str, seed: int, work: Path, batches: list) -> list[dict]:
    out_dir = work / f"{variant}_seed{seed}"
    shutil.rmtree(out_dir, ignore_errors=True)  # our own scratch run directory
    config = train_config(args, variant, seed, out_dir)
    result = train(config, model=trained_model(config, init_checkpoint(args.init)).train() if args.init else None)
    model = trained_model(config, result["checkpoint"])
    row = {"variant": variant, "seed": seed, "quant": VARIANTS[variant], "qat": True, "steps": result["step"],
           "tokens": result["tokens"], "train_s": round(result["elapsed_s"], 1),
           "train_bpb": result["val_bpb"]}
    bpb, row["eval_s"] = timed_bpb(model, batches)
    row["val_bpb"] = bpb
    rows = [row]
    if variant == "fp32":
        row.update(model_bytes(model))
        for name in PTQ:  # the trained fp32 weights, quantised without training
            ptq = apply_quant(trained_model(config, result["checkpoint"]), VARIANTS[name])
            path = export_quantized(ptq, out_dir / f"ptq_{name}.safetensors")
            bpb, eval_s = timed_bpb(load_quantized(path), batches)
            rows.append({"variant": f"ptq_{name}", "seed": seed, "quant": VARIANTS[name], "qat": False,
                         "steps": result["step"], "tokens": result["tokens"], "val_bpb": bpb,
                         "packed_bpb": bpb, "eval_s": eval_s, **model_bytes(ptq, path)})
        return rows
    path = export_quantized(model, out_dir / "model.safetensors")
    row.update(model_bytes(model, path))
    row["packed_bpb"], row["packed_eval_s"] = timed_bpb(load_quantized(path), batches)
    row["int_mm_bpb"], row["int_mm_eval_s"] = timed_bpb(load_quantized(path, backend="int8"), batches)
    return rows


def summarise(runs: list[dict]) -> dict:
    fp32 = {r["seed"]: r["val_bpb"] for r in runs if r["variant"] == "fp32"}
    out = {}
    for variant in dict.fromkeys(r["variant"] for r in runs):
        rows = [r for r in runs if r["variant"] == variant]
        rel = [100 * (r["val_bpb"] / fp32[r["seed"]] - 1) for r in rows if r["seed"] in fp32]
        entry = {"val_bpb": statistics.fmean(r["val_bpb"] for r in rows),
                 "val_bpb_sd": statistics.stdev(r["val_bpb"] for r in rows) if len(rows) > 1 else None,
                 "rel_to_fp32_pct": statistics.fmean(rel) if rel else None,
                 "packed_bpb": rows[0].get("packed_bpb"), "int_mm_bpb": rows[0].get("int_mm_bpb"),
                 "fp32_bytes": rows[0]["fp32_bytes"], "packed_bytes": rows[0]["packed_bytes"],
                 "quantized_fp32_bytes": rows[0]["quantized_fp32_bytes"],
                 "quantized_packed_bytes": rows[0]["quantized_packed_bytes"], "seeds": len(rows)}
        if variant in TARGETS and rel:
            entry["target_pct"] = TARGETS[variant]
            entry["meets_target"] = entry["rel_to_fp32_pct"] <= TARGETS[variant]
        out[variant] = entry
    return out


def print_table(summary: dict) -> None:
    def fmt(x, spec):
        return "-" if x is None else format(x, spec)

    head = (f"{'variant':<14}{'val bpb':>9}{'vs fp32':>9}{'target':>8}{'packed':>9}{'int_mm':>9}"
            f"{'fp32 B':>10}{'packed B':>10}{'quant fp32 B':>14}{'quant packed B':>16}")
    print(head)
    print("-" * len(head))
    for variant, s in summary.items():
        target = "-" if "target_pct" not in s else f"{'ok' if s['meets_target'] else 'MISS'} {s['target_pct']:.0f}%"
        rel = "-" if s["rel_to_fp32_pct"] is None else f"{s['rel_to_fp32_pct']:+.2f}%"
        print(f"{variant:<14}{fmt(s['val_bpb'], '.4f'):>9}{rel:>9}"
              f"{target:>8}{fmt(s['packed_bpb'], '.4f'):>9}{fmt(s['int_mm_bpb'], '.4f'):>9}"
              f"{s['fp32_bytes']:>10,}{s['packed_bytes']:>10,}{s['quantized_fp32_bytes']:>14,}"
              f"{s['quantized_packed_bytes']:>16,}")


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(summary)
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.8))
    a.bar(names, [summary[n]["val_bpb"] for n in names], color="tab:blue")
    a.set_ylabel("validation bits per byte")
    lo = min(summary[n]["val_bpb"] for n in names)
    a.set_ylim(lo * 0.98, max(summary[n]["val_bpb"] for n in names) * 1.01)
    b.bar(names, [summary[n]["packed_bytes"] / 1024 for n in names], color="tab:orange", label="packed file tensors")
    b.bar(names, [summary[n]["quantized_packed_bytes"] / 1024 for n in names], color="tab:red",
          label="of which quantised layers")
    b.axhline(summary[names[0]]["fp32_bytes"] / 1024, color="k", ls="--", label="fp32")
    b.set_ylabel("KiB")
    b.legend(fontsize=8)
    for ax in (a, b):
        ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps per run (same for every variant)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--n-layers", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--eval-batches", type=int, default=10)
    parser.add_argument("--corpus", default="mixed")
    parser.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--work-dir", default=None, help="keep the training runs here (default: a temp dir)")
    parser.add_argument("--progress", action="store_true", help="show the training progress bars")
    parser.add_argument("--init", default=None, help="a training run directory: fine-tune every variant from its "
                        "latest checkpoint, with its model, site, context, batch and corpus (see above)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if "fp32" not in args.variants:
        args.variants.insert(0, "fp32")  # the reference

    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="bench_quant_"))
    work.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    runs, init_bpb = [], None
    try:
        reference = train_config(args, "fp32", 0, work / "_val")
        batches = validation_batches(reference)
        if args.init:
            init_bpb, _ = timed_bpb(trained_model(reference, init_checkpoint(args.init)), batches)
            print(f"--init {args.init}: val bpb {init_bpb:.4f} before fine-tuning", flush=True)
        for seed in args.seeds:
            for variant in args.variants:
                rows = run_one(args, variant, seed, work, batches)
                runs += rows
                r = rows[0]
                print(f"[{time.perf_counter() - start:7.1f}s] {variant} seed {seed}: val bpb {r['val_bpb']:.4f}"
                      + (f", packed {r['packed_bpb']:.4f}" if "packed_bpb" in r else ""), flush=True)
    finally:
        if args.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)

    summary = summarise(runs)
    print()
    print_table(summary)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {
        "benchmark": "quant", "settings": vars(args), "tokens_per_run": runs[0]["tokens"],
        "init_bpb": init_bpb, "train_config": reference.to_dict(),  # what ran (--init overrides the size flags)
        "platform": {"python": platform.python_version(), "torch": torch.__version__,
                     "machine": platform.machine(), "threads": args.threads},
        "wall_s": round(time.perf_counter() - start, 1), "summary": summary, "runs": runs,
        "note": "val_bpb: the trained (fake-quantised) model; packed_bpb: exported, loaded, weights dequantised "
                "per layer (must equal val_bpb); int_mm_bpb: int8 activations + torch._int_mm (approximate); "
                "ptq_*: the fp32 run quantised after training, no QAT.",
    }
    (out / "quant.json").write_text(json.dumps(result, indent=2))
    plot(summary, out / "quant.png")
    print(f"\nwrote {out / 'quant.json'} and {out / 'quant.png'} ({result['wall_s']:.0f}s)")
    if not all(math.isfinite(r["val_bpb"]) for r in runs):
        raise SystemExit("a run ended with a non-finite validation loss")


if __name__ == "__main__":
    main()
