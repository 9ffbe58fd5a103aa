"""What each part of the default sheaf model buys on text: validation bits per byte with it switched off.

Trains the default sheaf model (``SheafStateConfig()`` at ``--d-model``, 2 layers, context 1024, batch 4) and
variants with one part changed, each at every seed of ``--seeds``, on the same tokens and data order:

    ssm                     the gluing off (the ssm ablation at the same width): what the gluing buys
    ssm_matched             the gluing off at the full model's parameter count (a wider ssm, as ``sheafgnn
                            compare`` matches it): what the gluing buys against the same parameters
    ssm_headdim_8           the ssm at the same width with SSM head dimension 8 (4 times the heads): ``matched_options``
                            gives the matched ssm the largest divisor of 32 that divides expand * d_model (8 at its
                            d_model 260), so this separates what its heads buy from what its parameters buy
    no_<type>               a patch type of the default site (its nodes and every edge touching them); types
                            with no nodes in the default sites (topic: no topic model) are listed, not run
    no_content_proposals    the content-addressed proposals (topology.content_blocks 0)
    random_proposals        the random proposals switched the other way (topology.random_proposals: 4 or 0)
    qk_norm                 the RMSNorms of the topology's queries and keys switched the other way (topology.qk_norm)
    identity_maps           restriction maps fixed to the identity (gluing.map_kind identity)
    orthogonal_maps         orthogonal restriction maps in place of the default's (gluing.map_kind orthogonal)
    general_maps            general (dense stalk_dim x stalk_dim) restriction maps (gluing.map_kind general)
    map_init                where the learned maps start, switched the other way (gluing.map_init: at the
                            identity, the learner's last layer at zero and F = I + tanh(h); or at random)
    separate_patch_ssm      the patch chains with an SSM of their own (ssm.shared false)
    experts_per_type        one expert per node type (experts.shared false)
    headdim_8, headdim_16   the SSM's head dimension P (default 32): expand * d_model / P heads, each with its own
                            decay and step
    gluing_into_outputs     the earlier design: outputs keep their states and R reads them (gluing.mode outputs,
                            with the pool's and the broadcast's linears that it needs)
    pool_loss               the auxiliary pool-read loss switched the other way (topology.pool_loss_weight 1 or 0)
    projections             the D x D linears of the pool and the broadcast switched the other way
                            (gluing.projections)
    explore                 Gumbel-top-k in training (topology.explore 1; if the default explores, 0): the kept
                            candidates sampled from the softmax of their scores instead of the top k
    key_previous_init       the previous-token key projection starting the other way (topology.key_previous_init:
                            a copy of the query's weights, or its own draw)
    rezero_gate             the broadcast gate starting at 0 and learning at the weights' rate (gluing.gate_init 0,
                            gate_scale 1: ReZero); if the default is that, at 0.1 and 10 times the rate
    gate_init               the broadcast gate starting the other way (gluing.gate_init): at 0.1 if the default
                            starts it at 1 or more, else at 1 (`open_gate` while the default started it at 0.1)
    a+b+...                 the sheaf variants a, b, ... switched at once (only when named in ``--variants``):
                            whether changes that pay alone also pay together

and reports per variant the mean validation bits per byte over the seeds, its change against the full model's
mean (positive: the part pays), the seed spread of the full model (the noise a change is measured against),
parameters, training tokens/s, and the nodes and edges per token of its sites (built on the first 8,192 tokens
of the validation text). The runs share the machine (``--jobs`` at a time, ``--threads`` each), so tokens/s
compare between variants of one run, not with other benchmarks. Each finished run's row is kept in
``<out>/ablation_runs/<variant>_seed<N>.json``: a rerun skips it (resume after a kill; delete to retrain).
``--report`` trains nothing: it writes the report of the kept rows alone, each variant with the seeds that it
and the full model have (a table of a run still going, or stopped).

Usage::

    python benchmarks/bench_ablation.py [--tokens 1048576] [--lr 4e-3] [--seeds 0 1] [--jobs 2] [--threads 1]
        [--variants ssm no_local ...] [--out benchmarks/results] [--report]
        -> ablation.json, ablation.md, ablation.png
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import torch

from sheafgnn.data import corpus_ids
from sheafgnn.experiments.compare import BASELINE_SITE
from sheafgnn.experiments.components import component_changes, without_patch_type
from sheafgnn.experiments.report import pyplot, write_json, write_report
from sheafgnn.lm import matched_options
from sheafgnn.model import SheafStateConfig
from sheafgnn.site import ByteTokenizer, SiteConfig, build_site
from sheafgnn.site.schema import PATCH_TYPES
from sheafgnn.train import TrainConfig, train

SWITCHABLE = tuple(p for p in PATCH_TYPES if p != "output")  # output is the readout: always on


def active_patch_types(n: int = 8192) -> list[str]:
    """The patch types of the default site with nodes in the site of the first ``n`` validation tokens (``topic``
    needs a fitted topic model, which training does not have by default)."""
    data = build_site(corpus_ids(n, split="validation"), SiteConfig())
    return [p for p in SiteConfig().patch_types if p in SWITCHABLE and data[p].num_nodes]


def variants(d_model: int, patch_types: list[str]) -> dict[str, dict]:
    """Name -> {model, model_config, site} of every variant (one per patch type of ``patch_types``)."""
    model = {"d_model": d_model, "n_layers": 2}
    default = SheafStateConfig()
    matched = matched_options(("ssm",), model, ByteTokenizer.vocab_size, n_heads=4, window=256)[0]["ssm"]
    out = {"full": {"model": "sheaf", "model_config": model, "site": {}},
           "ssm": {"model": "ssm", "model_config": model, "site": dict(BASELINE_SITE)},
           "ssm_matched": {"model": "ssm", "model_config": matched, "site": dict(BASELINE_SITE)},
           "ssm_headdim_8": {"model": "ssm", "model_config": {**model, "ssm": {"headdim": 8}},
                             "site": dict(BASELINE_SITE)}}
    for patch_type in patch_types:
        site = without_patch_type(default.site.patch_types, patch_type)
        out[f"no_{patch_type}"] = {"model": "sheaf", "model_config": model, "site": site}
    for name, change in component_changes(default).items():
        out[name] = {"model": "sheaf", "model_config": {**model, **change}, "site": {}}
    return out


def combined(specs: dict[str, dict], name: str) -> dict:
    """The variant ``a+b+...``: every one of the sheaf variants ``a``, ``b``, ... switched at once (their
    model_config changes merged, the patch types that all of them keep), to see whether changes that each pay
    alone also pay together before one becomes the default."""
    parts = name.split("+")
    unknown = [part for part in parts if part not in specs or specs[part]["model"] != "sheaf" or part == "full"]
    if unknown:
        raise SystemExit(f"{name}: {unknown} are not sheaf variants to combine; choose from "
                         f"{sorted(n for n, spec in specs.items() if spec['model'] == 'sheaf' and n != 'full')}")
    default_types = list(SheafStateConfig().site.patch_types)
    model_config, patch_types = {}, default_types
    for part in parts:
        _merge(model_config, specs[part]["model_config"])
        kept = specs[part]["site"].get("patch_types", patch_types)
        patch_types = [t for t in patch_types if t in kept]  # a new list: default_types stays as it is
    site = {} if patch_types == default_types else {"patch_types": patch_types}
    return {"model": "sheaf", "model_config": model_config, "site": site}


def _merge(into: dict, change: dict) -> None:
    """``change`` written into ``into``, nested mappings merged key by key."""
    for key, value in change.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


def site_cost(site: dict, n: int = 8192) -> dict:
    """Nodes and edges per token of the site of the first ``n`` validation tokens."""
    data = build_site(corpus_ids(n, split="validation"), SiteConfig.from_dict(site))
    return {"nodes_per_token": sum(data[t].num_nodes for t in data.node_types) / n,
            "edges_per_token": sum(data[e].num_edges for e in data.edge_types) / n}


def kept_row(name: str, seed: int, out: str) -> Path:
    """Where the row of ``name`` at ``seed`` is kept."""
    return Path(out) / "ablation_runs" / f"{name}_seed{seed}.json"


def run_variant(name: str, spec: dict, seed: int, args: argparse.Namespace, work: Path) -> dict:
    """Train one variant at one seed (unless its row is kept from an earlier run); its validation bits per byte,
    tokens/s and site cost."""
    kept = kept_row(name, seed, args.out)
    if kept.exists():
        return json.loads(kept.read_text())
    out_dir = work / f"{name}_seed{seed}"
    shutil.rmtree(out_dir, ignore_errors=True)  # our own scratch run directory
    steps = math.ceil(args.tokens / (args.batch_size * args.context))
    config = TrainConfig(model=spec["model"], model_config=spec["model_config"], site=spec["site"], corpus="mixed",
                         context=args.context, batch_size=args.batch_size, tokens=args.tokens, lr=args.lr,
                         warmup_steps=min(50, steps), seed=seed, eval_every=steps,
                         eval_batches=args.eval_batches, checkpoint_every=steps, keep_checkpoints=1,
                         out_dir=str(out_dir), num_threads=args.threads, tensorboard=False, progress=False,
                         device="cpu")
    result = train(config)
    row = {"variant": name, "seed": seed, **spec, "val_bpb": result["val_bpb"], "params": result["params"],
           "tokens": result["tokens"], "train_tokens_per_s": result["tokens_per_s"],
           "train_s": result["elapsed_s"], **site_cost(spec["site"])}
    kept.parent.mkdir(parents=True, exist_ok=True)
    write_json(kept.with_suffix(".tmp"), row)
    kept.with_suffix(".tmp").replace(kept)  # whole or absent: a kill mid-write leaves no row to resume from
    print(f"  {name:<22} seed {seed}: {row['val_bpb']:.4f} bits/byte, {row['train_tokens_per_s']:,.0f} tok/s, "
          f"{row['edges_per_token']:.1f} edges/token", flush=True)
    return row


def markdown(report: dict) -> str:
    rows, cfg = report["variants"], report["settings"]
    seeds = ", ".join(map(str, cfg["seeds"]))
    lines = ["# sheafgnn ablation\n",
             f"The default sheaf model (d_model {cfg['d_model']}, 2 layers), {cfg['tokens']:,} training tokens per "
             f"variant and seed (seeds {seeds}) at lr {cfg['lr']:g}, context {cfg['context']}, batch "
             f"{cfg['batch_size']}; {cfg['jobs']} runs at a time, {cfg['threads']} thread(s) each, "
             f"{sum(r['train_s'] for r in report['runs']) / 60:.0f} min of training in all (kept runs included). "
             "Change: the variant's mean validation bits per byte minus the "
             "full model's over the same seeds (positive: what was switched off pays for itself).\n",
             f"Seed spread of the full model: {report['seed_spread']:.4f} bits/byte (largest minus smallest over the "
             "seeds). Patch types with no nodes in the default sites of the first 8,192 validation tokens, so not "
             f"ablated: {', '.join(report['inactive_patch_types']) or 'none'}.\n",
             "Change per seed: the variant minus the full model at the same seed (the same data order), the "
             "paired view of the change.\n",
             "| variant | val bits/byte per seed | mean | change | change per seed | beyond the spread | train tok/s "
             "| nodes / token | edges / token | params |", "|---|---|---:|---:|---|---|---:|---:|---:|---:|"]
    for r in rows:
        beyond = "yes" if abs(r["change_bpb"]) > report["seed_spread"] else "no"
        only = "" if r["seeds"] == cfg["seeds"] else f" (seed {', '.join(map(str, r['seeds']))} only)"
        lines.append(f"| {r['variant']} | {' / '.join(f'{v:.4f}' for v in r['val_bpb'])}{only} | {r['mean_bpb']:.4f} "
                     f"| {r['change_bpb']:+.4f} | {' / '.join(f'{c:+.4f}' for c in r['change_per_seed'])} "
                     f"| {'-' if r['variant'] == 'full' else beyond} "
                     f"| {r['train_tokens_per_s']:,.0f} | {r['nodes_per_token']:.2f} | {r['edges_per_token']:.1f} "
                     f"| {r['params']:,} |")
    return "\n".join(lines) + "\n"


def figure(report: dict):
    rows = [r for r in report["variants"] if r["variant"] != "full"]
    fig, (a, b) = pyplot().subplots(1, 2, figsize=(12, 4.2))
    names = [r["variant"] for r in rows]
    a.barh(names, [r["change_bpb"] for r in rows], color="tab:blue")
    for edge in (-report["seed_spread"], report["seed_spread"]):
        a.axvline(edge, color="tab:grey", lw=0.8, ls="--")
    a.axvline(0, color="k", lw=0.8)
    a.set_xlabel("validation bits/byte change when switched off (positive: it pays; dashed: seed spread)")
    b.scatter([r["edges_per_token"] for r in report["variants"]], [r["mean_bpb"] for r in report["variants"]])
    for r in report["variants"]:
        b.annotate(r["variant"], (r["edges_per_token"], r["mean_bpb"]), fontsize=7)
    b.set_xlabel("site edges per token")
    b.set_ylabel("validation bits/byte")
    return fig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=1_048_576, help="training tokens per variant and seed")
    parser.add_argument("--lr", type=float, default=4e-3, help="peak lr")
    parser.add_argument("--eval-batches", type=int, default=16)
    parser.add_argument("--d-model", type=int, default=SheafStateConfig().d_model, help="the sheaf model's width")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="seeds of every variant")
    parser.add_argument("--variants", nargs="+", default=None, help="a subset (default: all; full always runs); "
                        "a+b names the variants a and b switched at once")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--report", action="store_true", help="train nothing: the report of the kept rows")
    args = parser.parse_args()
    active = active_patch_types()
    specs = variants(args.d_model, active)
    specs |= {name: combined(specs, name) for name in args.variants or () if "+" in name}
    if args.variants:
        unknown = sorted(set(args.variants) - set(specs))
        if unknown:
            raise SystemExit(f"unknown variants {unknown}; choose from {sorted(specs)}")
        specs = {name: spec for name, spec in specs.items() if name == "full" or name in args.variants}
    start = time.perf_counter()
    if args.report:
        kept = [kept_row(name, seed, args.out) for name in specs for seed in args.seeds]
        rows = [json.loads(path.read_text()) for path in kept if path.exists()]
        full_seeds = {row["seed"] for row in rows if row["variant"] == "full"}
        if not full_seeds:
            raise SystemExit(f"no kept row of the full model in {Path(args.out) / 'ablation_runs'}")
        rows = [row for row in rows if row["seed"] in full_seeds]  # a change is measured at the full model's seed
    else:
        work = Path(tempfile.mkdtemp(prefix="bench_ablation_"))
        try:
            with ProcessPoolExecutor(max_workers=args.jobs, mp_context=get_context("spawn")) as pool:
                futures = [pool.submit(run_variant, name, spec, seed, args, work) for name, spec in specs.items()
                           for seed in args.seeds]
                rows = [f.result() for f in futures]
        finally:
            shutil.rmtree(work, ignore_errors=True)
    by_variant = {}
    for row in rows:
        by_variant.setdefault(row["variant"], []).append(row)
    summary = [{**runs[0], "val_bpb": [r["val_bpb"] for r in runs],
                "mean_bpb": statistics.mean(r["val_bpb"] for r in runs),
                "train_tokens_per_s": statistics.mean(r["train_tokens_per_s"] for r in runs)}
               for runs in by_variant.values()]
    full = summary[0]
    full_at = {r["seed"]: r["val_bpb"] for r in by_variant["full"]}
    for row in summary:
        row["seeds"] = [r["seed"] for r in by_variant[row["variant"]]]
        row["change_bpb"] = row["mean_bpb"] - statistics.mean(full_at[seed] for seed in row["seeds"])  # same seeds
        row["change_per_seed"] = [r["val_bpb"] - full_at[r["seed"]]  # the paired view: the same data order
                                  for r in by_variant[row["variant"]]]
    report = {"benchmark": "ablation", "settings": vars(args), "runs": rows, "variants": summary,
              "wall_s": time.perf_counter() - start, "torch": torch.__version__,
              "inactive_patch_types": [p for p in SiteConfig().patch_types if p in SWITCHABLE and p not in active],
              "seed_spread": max(full["val_bpb"]) - min(full["val_bpb"])}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    files = write_report(report, Path(args.out), "ablation", markdown(report), {"ablation.png": figure(report)})
    print(markdown(report))
    print(f"wrote {', '.join(files)} into {args.out}")


if __name__ == "__main__":
    main()
