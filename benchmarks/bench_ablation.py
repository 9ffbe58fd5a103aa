"""What each part of the site and of the topology buys: validation bits per byte with it switched off.

Trains the sheaf model of ``sheafgnn compare`` (d_model 128, 2 layers, context
1024, batch 4 by default) on the same tokens, data order and seed in full and
with one part switched off at a time:

    no_<type>               a patch type of the site (its nodes and every edge touching them); types
                            with no nodes in the default sites (topic: no topic model) are listed, not run
    no_content_proposals    the content-addressed proposals (content_blocks 0)
    no_random_proposals     the random proposals (random_proposals 0)
    with_pool_loss          the auxiliary pool-read loss switched *on* (pool_loss_weight 1; the default is
                            off since this table measured it: there a positive change means it does not pay)
    full_seed<k>            the full model at other seeds: the noise a change is measured against

and reports per variant the validation bits per byte and its change against
the full model (positive: the part pays), training tokens/s, and the nodes and
edges per token of its sites (the bytes each token moves: built on the first
8,192 tokens of the validation text). The runs share the machine (``--jobs``
at a time, ``--threads`` each), so tokens/s compare between variants of one
run, not with other benchmarks.

Usage::

    python benchmarks/bench_ablation.py [--tokens 524288] [--lr 4e-3] [--seeds 1] [--jobs 2] [--threads 1]
        [--variants full no_topic ...] [--out benchmarks/results]      -> ablation.json, ablation.md, ablation.png
"""

from __future__ import annotations

import argparse
import math
import shutil
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import torch

from sheafgnn.data import corpus_ids
from sheafgnn.experiments.report import pyplot, write_report
from sheafgnn.site import SiteConfig, build_site
from sheafgnn.site.schema import PATCH_TYPES
from sheafgnn.train import TrainConfig, train

SWITCHABLE = tuple(p for p in PATCH_TYPES if p != "output")  # output is the readout: always on
FULL_SITE = {"patch_types": list(SWITCHABLE)}  # every rule, retrieval included (the default site leaves it out)
TOPOLOGY = {"no_content_proposals": {"content_blocks": 0}, "no_random_proposals": {"random_proposals": 0},
            "with_pool_loss": {"pool_loss_weight": 1.0}}


def active_patch_types(n: int = 8192) -> list[str]:
    """The switchable patch types with nodes in the site of every rule (:data:`FULL_SITE`) of the first ``n``
    validation tokens (``topic`` needs a fitted topic model, which training does not have by default)."""
    data = build_site(corpus_ids(n, split="validation"), SiteConfig.from_dict(FULL_SITE))
    return [p for p in SWITCHABLE if data[p].num_nodes]


def variants(d_model: int, extra_seeds: int, patch_types: list[str]) -> dict[str, dict]:
    """Name -> {model_config, site, seed} of every variant (one per patch type of ``patch_types``)."""
    model = {"d_model": d_model, "n_layers": 2}
    out = {"full": {"model_config": model, "site": FULL_SITE, "seed": 0}}
    for seed in range(1, extra_seeds + 1):
        out[f"full_seed{seed}"] = {"model_config": model, "site": FULL_SITE, "seed": seed}
    for patch_type in patch_types:
        site = {"patch_types": [p for p in SWITCHABLE if p != patch_type]}
        out[f"no_{patch_type}"] = {"model_config": model, "site": site, "seed": 0}
    for name, fields in TOPOLOGY.items():
        out[name] = {"model_config": {**model, **fields}, "site": FULL_SITE, "seed": 0}
    return out


def site_cost(site: dict, n: int = 8192) -> dict:
    """Nodes and edges per token of the site of the first ``n`` validation tokens."""
    data = build_site(corpus_ids(n, split="validation"), SiteConfig.from_dict(site))
    return {"nodes_per_token": sum(data[t].num_nodes for t in data.node_types) / n,
            "edges_per_token": sum(data[e].num_edges for e in data.edge_types) / n}


def run_variant(name: str, spec: dict, args: argparse.Namespace, work: Path) -> dict:
    """Train one variant; its validation bits per byte, tokens/s and site cost."""
    out_dir = work / name
    shutil.rmtree(out_dir, ignore_errors=True)  # our own scratch run directory
    steps = math.ceil(args.tokens / (args.batch_size * args.context))
    config = TrainConfig(model="sheaf", model_config=spec["model_config"], site=spec["site"], corpus="mixed",
                         context=args.context, batch_size=args.batch_size, tokens=args.tokens, lr=args.lr,
                         warmup_steps=min(50, steps), seed=spec["seed"], eval_every=steps,
                         eval_batches=args.eval_batches, checkpoint_every=steps, keep_checkpoints=1,
                         out_dir=str(out_dir), num_threads=args.threads, tensorboard=False, progress=False)
    result = train(config)
    row = {"variant": name, **spec, "val_bpb": result["val_bpb"], "params": result["params"],
           "tokens": result["tokens"], "train_tokens_per_s": result["tokens_per_s"],
           "train_s": result["elapsed_s"], **site_cost(spec["site"])}
    print(f"  {name:<22} {row['val_bpb']:.4f} bits/byte, {row['train_tokens_per_s']:,.0f} tok/s, "
          f"{row['edges_per_token']:.1f} edges/token", flush=True)
    return row


def markdown(report: dict) -> str:
    rows, cfg = report["rows"], report["settings"]
    lines = ["# sheafgnn ablation\n",
             f"The sheaf model (d_model {cfg['d_model']}, 2 layers), {cfg['tokens']:,} training tokens per "
             f"variant at lr {cfg['lr']:g}, context {cfg['context']}, batch {cfg['batch_size']}; {cfg['jobs']} runs "
             f"at a time, {cfg['threads']} "
             f"thread(s) each, {report['wall_s'] / 60:.1f} min in all. Change: the variant's validation bits per "
             "byte minus the full model's (positive: what was switched off pays for itself).\n",
             f"Seed noise (the full model at other seeds): {report['seed_spread']}. Patch types with no nodes in "
             "the sites of the first 8,192 validation tokens, so not ablated: "
             f"{', '.join(report['inactive_patch_types']) or 'none'}.\n",
             "| variant | val bits/byte | change | train tok/s | nodes / token | edges / token | params |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['variant']} | {r['val_bpb']:.4f} | {r['change_bpb']:+.4f} | {r['train_tokens_per_s']:,.0f} "
                     f"| {r['nodes_per_token']:.2f} | {r['edges_per_token']:.1f} | {r['params']:,} |")
    return "\n".join(lines) + "\n"


def figure(report: dict):
    rows = [r for r in report["rows"] if r["variant"] != "full"]
    fig, (a, b) = pyplot().subplots(1, 2, figsize=(12, 4.2))
    names = [r["variant"] for r in rows]
    a.barh(names, [r["change_bpb"] for r in rows], color=["tab:grey" if n.startswith("full") else "tab:blue"
                                                           for n in names])
    a.axvline(0, color="k", lw=0.8)
    a.set_xlabel("validation bits/byte change when switched off (positive: it pays)")
    b.scatter([r["edges_per_token"] for r in report["rows"]], [r["val_bpb"] for r in report["rows"]])
    for r in report["rows"]:
        b.annotate(r["variant"], (r["edges_per_token"], r["val_bpb"]), fontsize=7)
    b.set_xlabel("site edges per token")
    b.set_ylabel("validation bits/byte")
    return fig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=524_288, help="training tokens per variant")
    parser.add_argument("--lr", type=float, default=4e-3, help="peak lr (the sheaf model's best in the 8M compare)")
    parser.add_argument("--eval-batches", type=int, default=16)
    parser.add_argument("--d-model", type=int, default=128, help="the sheaf model's width (compare's: 128)")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seeds", type=int, default=1, help="extra seeds of the full model (the noise)")
    parser.add_argument("--variants", nargs="+", default=None, help="a subset (default: all; full always runs)")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    active = active_patch_types()
    specs = variants(args.d_model, args.seeds, active)
    if args.variants:
        unknown = sorted(set(args.variants) - set(specs))
        if unknown:
            raise SystemExit(f"unknown variants {unknown}; choose from {sorted(specs)}")
        specs = {name: spec for name, spec in specs.items() if name == "full" or name in args.variants}
    start, work = time.perf_counter(), Path(tempfile.mkdtemp(prefix="bench_ablation_"))
    try:
        with ProcessPoolExecutor(max_workers=args.jobs, mp_context=get_context("spawn")) as pool:
            futures = [pool.submit(run_variant, name, spec, args, work) for name, spec in specs.items()]
            rows = [f.result() for f in futures]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    full = rows[0]["val_bpb"]
    for row in rows:
        row["change_bpb"] = row["val_bpb"] - full
    seeds = [r["change_bpb"] for r in rows if r["variant"].startswith("full_seed")]
    report = {"benchmark": "ablation", "settings": vars(args), "rows": rows, "wall_s": time.perf_counter() - start,
              "torch": torch.__version__, "inactive_patch_types": [p for p in SWITCHABLE if p not in active],
              "seed_spread": (f"{min(seeds):+.4f} to {max(seeds):+.4f} bits/byte against seed 0" if seeds
                              else "not measured (--seeds 0)")}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    files = write_report(report, Path(args.out), "ablation", markdown(report), {"ablation.png": figure(report)})
    print(markdown(report))
    print(f"wrote {', '.join(files)} into {args.out}")


if __name__ == "__main__":
    main()
