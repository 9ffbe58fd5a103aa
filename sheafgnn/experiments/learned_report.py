"""The learned-topology study's report: the printed table, the figure, and ``sheafgnn simulate --learned``.

Reads the dict :func:`sheafgnn.experiments.learned_topology.run_learned` returns (``learned_topology.json``);
nothing here trains. :func:`saved_model_routes` measures the route cuts of a model the study saved
(``sheafgnn simulate --routes-of DIR``), so a new question about a trained model needs no new training.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

from sheafgnn.experiments.learned_model import load_learned_model
from sheafgnn.experiments.learned_routes import cut_chains, format_routes, plot_routes, route_losses, section_cuts
from sheafgnn.experiments.learned_topology import run_learned, sequence_site
from sheafgnn.experiments.report import label_loglog, power_law_label, pyplot, save_figure, write_json
from sheafgnn.experiments.synthetic import generate


def plot_learned(result: dict, path) -> None:
    """Three panels, PNG: the per-destination AUCs by block (trained and untrained); coverage and
    waste of each topology (designed, untrained, learned, weight thresholds, references, targets and
    the waste floor marked); edges against n (log-log)."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8), dpi=110)
    ax = axes[0]
    for name, auc, style in (("trained", result["auc_per_destination"], "-"),
                             ("untrained", result["untrained"]["auc_per_destination"], ":")):
        for b, row in enumerate(auc["per_block"]):
            hist = np.asarray(row["hist"], dtype=float)
            edges = np.linspace(0.0, 1.0, hist.size + 1)
            mean = "-" if row["mean"] is None else f"{row['mean']:.3f}"
            ax.step((edges[1:] + edges[:-1]) / 2, hist / max(hist.sum(), 1), where="mid", ls=style,
                    color=plt.get_cmap("tab10")(b), label=f"{name}, block {b}: mean {mean}")
    ax.axvline(result["targets"]["auc_per_destination"], color="grey", ls="--", lw=1, label="target")
    ax.set_xlabel("AUC of one destination's candidate scores")
    ax.set_ylabel("share of destinations")
    ax.set_title(f"AUC per destination ({result['auc_per_destination']['destinations']:,} block-destinations)")
    ax.legend(fontsize=6)

    ax = axes[1]
    rows = [("designed site", result["designed"]), ("untrained", result["untrained"]["kept"])]
    rows += [(f"learned {k}", v) for k, v in result["learned"].items()]
    rows += [(f"ref: {k}", v) for k, v in result["references"].items()]
    y = np.arange(len(rows))
    ax.barh(y - 0.2, [row["coverage"] for _, row in rows], 0.4, color="tab:blue", label="coverage")
    ax.barh(y + 0.2, [row["waste"] for _, row in rows], 0.4, color="tab:red", label="waste")
    targets = result["targets"]
    ax.axvline(targets["coverage"], color="tab:blue", ls="--", lw=1, label=f"target coverage {targets['coverage']:g}")
    ax.axvline(targets["waste"], color="tab:red", ls="--", lw=1, label=f"target waste {targets['waste']:g}")
    ax.axvline(result["waste_floor"], color="grey", ls="-.", lw=1, label=f"waste floor {result['waste_floor']:.3f}")
    ax.set_yticks(y, [name for name, _ in rows], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlim(0, 1.45)  # room for the legend on the right
    ax.set_xticks(np.linspace(0, 1, 6))
    ax.set_title(f"topologies against G* (H = {result['hops']}, n = {result['n_eval']:,})")
    ax.legend(fontsize=6, loc="center right")

    ax = axes[2]
    growth = result["growth"]
    series = [("designed edges", growth["designed"], "edges"), ("kept topology edges", growth["kept"], "edges"),
              ("kept gluing edges", growth["kept"], "kept_edges"), ("pool candidates", growth["pools"], "candidates")]
    for i, (label, part, key) in enumerate(series):
        ax.loglog(growth["ns"], [max(v, 1) for v in part[key]], "-o", ms=3, color=plt.get_cmap("tab10")(i),
                  label=power_law_label(label, part.get(f"{key}_slope")))
    label_loglog(ax, "sequence length n", "edges", "learned topology: edges against n", 6)
    save_figure(fig, path)


def format_learned(result: dict) -> str:
    """The learned topology beside the designed site, as text."""
    before, after, random = result["loss_before"], result["loss_after"], result["loss_random_scores"]
    train, auc, recall = result["train"], result["auc_per_destination"], result["candidate_recall"]
    pct = lambda v: "-" if v is None else f"{100 * v:.1f}%"
    pct2 = lambda v: "-" if v is None else f"{100 * v:.2f}%"
    num = lambda v: "-" if v is None else f"{v:.3f}"
    blocks = ", ".join(f"block {b} {num(row['mean'])} (anchor {num(row['by_type']['anchor'])}, entity "
                       f"{num(row['by_type']['entity'])}, {row['destinations']:,} of {row['eligible']:,}; among "
                       f"tokens only {num(row['by_source']['token']['mean'])} "
                       f"({row['by_source']['token']['destinations']:,}), among patches only "
                       f"{num(row['by_source']['patch']['mean'])} ({row['by_source']['patch']['destinations']:,}); "
                       f"source token in the pool {pct(row['source_in_pool'])})"
                       for b, row in enumerate(auc["per_block"]))
    lines = [f"learned topology: n_eval = {result['n_eval']:,}, G* = {result['deps']['total']:,}, "
             f"H = {result['hops']}, {result['parameters']:,} parameters, "
             f"k = {result['model_config']['topology']['k']}, "
             f"{train['steps']} steps x {result['batch']} x {result['window']} tokens ({train['seconds']:.0f} s)",
             f"eval next-token loss (nats): {before['loss']:.3f} before -> {after['loss']:.3f} after; long-range "
             f"targets {num(before['long_range'])} -> {num(after['long_range'])}; with random scores "
             f"{random['loss']:.3f} (delta {result['random_score_loss_delta']:+.3f}, "
             f"long-range {num(random['long_range'])})",
             f"AUC per destination: {num(auc['mean'])} over {auc['destinations']:,} block-destinations "
             f"(untrained {num(result['untrained']['auc_per_destination']['mean'])}); {blocks}",
             f"candidate recall (every candidate kept): {pct(recall['recall'])} of {recall['dependencies']:,} "
             f"long-range dependencies (anchor {pct(recall['by_type']['anchor'])}, "
             f"entity {pct(recall['by_type']['entity'])}; "
             f"per block {', '.join(pct(r) for r in recall['per_block'])}; content and random proposals alone "
             f"{pct(recall['proposals_only'])}; {recall['candidates']:,} candidates)",
             f"{'topology':<22}{'coverage':>10}{'waste':>10}{'relations':>12}{'edges':>11}{'kept glue':>11}"
             f"{'anchor cov.':>13}{'entity cov.':>13}"]
    rows = [("designed site", result["designed"]), ("untrained kept", result["untrained"]["kept"])]
    rows += [(f"learned {k}", v) for k, v in result["learned"].items()]
    rows += [(f"ref: {k}", v) for k, v in result["references"].items()]
    for name, row in rows:
        by = row["coverage_by_type"]
        lines.append(f"{name:<22}{100 * row['coverage']:>9.2f}%{100 * row['waste']:>9.2f}%{row['relations']:>12,}"
                     f"{row['edges']:>11,}{row['kept_edges']:>11,}{pct(by['anchor']):>13}{pct(by['entity']):>13}")
    lines.append(f"least waste of any selection at {100 * result['targets']['coverage']:.0f}% coverage: "
                 f"{100 * result['waste_floor']:.2f}% (the fixed edges and stream stay); the selection's own "
                 f"waste (beyond the fixed edges): {pct2(result['waste_of_selection'])}")
    growth = result["growth"]
    slopes = [(name, part, key) for name, part in (("designed", growth["designed"]), ("kept", growth["kept"]),
                                                   ("pools", growth["pools"]))
              for key in ("edges", "kept_edges", "candidates") if f"{key}_slope" in part]
    lines.append(f"~ n^a over n = {growth['ns'][0]:,} .. {growth['ns'][-1]:,}: "
                 + ", ".join(f"{name} {key} {num(part[f'{key}_slope'])}" for name, part, key in slopes))
    lines.append(format_routes(result["routes"]))
    return "\n".join(lines)


def main_learned(args: argparse.Namespace, out: Path) -> int:
    """``sheafgnn simulate --learned``: :func:`run_learned`, printed, JSON + PNG in ``out``."""
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    result = run_learned(n_train=args.n_train, n_eval=args.n, steps=args.steps, seed=args.seed, hops=args.hops,
                         window=args.train_window, lr=args.lr, topology_k=args.topology_k,
                         model_set=tuple(args.model_set),
                         max_seconds=args.max_seconds, verbose=True, save_model=args.save_model,
                         cut_chains_at_keys=args.cut_chains)
    print(format_learned(result))
    write_json(out / "learned_topology.json", result)
    plot_learned(result, out / "learned_topology.png")
    plot_routes(result["routes"], out / "learned_routes.png")
    print(f"\nwrote {out / 'learned_topology.json'}, {out / 'learned_topology.png'}, {out / 'learned_routes.png'} "
          f"({result['seconds']:.0f} s)")
    return 0


def saved_model_routes(ckpt_dir, n_eval: int = 32768, seed: int = 0, cut_chains_at_keys: bool = False) -> dict:
    """:func:`~sheafgnn.experiments.learned_routes.route_losses` of the model ``simulate --learned --save-model
    ckpt_dir`` wrote, on the study's evaluation sequence: pass the study's ``n_eval``, ``seed`` and
    ``cut_chains_at_keys`` (a model trained with its chains cut is measured from its cut site)."""
    model = load_learned_model(ckpt_dir)
    seq = generate(n_eval, seed)
    data = sequence_site(seq, model.config.site_config)
    site = cut_chains(data, section_cuts(seq)) if cut_chains_at_keys else None
    result = route_losses(model, data, seq, site=site)
    return {**result, "model": str(ckpt_dir), "n_eval": n_eval, "seed": seed, "cut_chains_at_keys": cut_chains_at_keys}


def main_routes(args: argparse.Namespace, out: Path) -> int:
    """``sheafgnn simulate --routes-of DIR``: :func:`saved_model_routes`, printed, learned_routes.json + .png."""
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    result = saved_model_routes(args.routes_of, args.n, args.seed, args.cut_chains)
    print(format_routes(result))
    write_json(out / "learned_routes.json", result)
    plot_routes(result, out / "learned_routes.png")
    print(f"\nwrote {out / 'learned_routes.json'}, {out / 'learned_routes.png'}")
    return 0
