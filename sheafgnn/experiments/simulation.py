r"""The paper's synthetic dependency simulation: coverage and relational waste (``sheafgnn simulate``).

Synthetic byte sequences carry a *known*, sparse, typed dependency graph G*
(:mod:`sheafgnn.experiments.synthetic`). Three relational topologies are
scored against it (:mod:`sheafgnn.relations`): dense causal attention, a
local attention window, and the sheaf site that :func:`build_site` makes for
the same sequence.

::

    generate(n, seed) -> SyntheticSequence      ids (n,), G* = (src, dst, type) (D,)
        |                     \
        | build_site(ids)      dense / window: relations counted analytically
        v                       \
    site_graph(site) -> RelationGraph ----> relation_stats(graph, hops, G*)
                                              relations, coverage, waste
    run_table(n)  -> dict    the paper's table at one length
    run_scaling(ns) -> dict  edges against n, plot_scaling(result, path)
    hop_sweep(n, seed, hops) the site's coverage and waste at several H

    sheafgnn simulate [--n 32768] [--out runs/simulate]      simulate_table.json, simulate_scaling.json/.png
    sheafgnn simulate --learned [...]                        learned_topology.json/.png
                                                             (sheafgnn.experiments.learned_topology)
    sheafgnn simulate --routes-of DIR [--cut-chains]         learned_routes.json/.png of a saved model
                                                             (sheafgnn.experiments.learned_report)

**Edges**: the relations for dense and window attention (one attention score
per pair); for the site its physical message edges, the edges of its
relation graph. **Hops**: ``hops`` (H, default 3) is one block of the model;
one attention layer is one hop, so dense and window are scored at one hop
(their L-layer reach is not counted, as in the paper).

Results go to ``runs/simulate`` unless ``--out`` says otherwise; the
project's recorded results in ``benchmarks/results`` are written by
``benchmarks/bench_simulate.py``.
"""

from __future__ import annotations

import argparse
import inspect
import time
from dataclasses import asdict
from pathlib import Path

from sheafgnn.config import ArgumentParser, at_least
from sheafgnn.experiments.learned_report import main_learned, main_routes
from sheafgnn.experiments.learned_topology import run_learned
from sheafgnn.experiments.report import fit_exponent, label_loglog, power_law_label, pyplot, save_figure, write_json
from sheafgnn.experiments.synthetic import (
    PAPER,
    GeneratorConfig,
    generate,
    matched_site_config,
    score_dense,
    score_site,
    score_window,
)
from sheafgnn.relations import dense_relations, site_graph
from sheafgnn.site import PATCH_TYPES, SiteConfig, build_site


def designed_site() -> SiteConfig:
    """The site the paper's table scores: every rule of the design on, retrieval patches included (a
    language model's default site leaves them to the learned topology, :data:`~sheafgnn.site.DEFAULT_PATCH_TYPES`)."""
    return SiteConfig(patch_types=PATCH_TYPES)


def run_table(n: int = 32768, seed: int = 0, hops: int = 3, window: int = 8,
              config: GeneratorConfig | None = None, site_config: SiteConfig | None = None,
              extra_sites: dict[str, SiteConfig] | None = None) -> dict:
    """The paper's table at one length: coverage, waste and edges per topology.

    Args:
        n (int): tokens (default: :obj:`32768`).
        seed (int): sequence seed (default: :obj:`0`).
        hops (int): H for the site's relations (default: :obj:`3`, one block).
        window (int): keys of the local window (default: :obj:`8`).
        config (GeneratorConfig, optional): generator densities.
        site_config (SiteConfig, optional): the site's rules (default: every patch type, :func:`designed_site`).
        extra_sites (dict, optional): more site rows, name -> SiteConfig.

    Returns:
        dict with ``n``, ``deps`` (counts per type), ``topologies`` (name ->
        coverage, waste, relations, edges, ...) and ``seconds``.
    """
    start = time.perf_counter()
    seq = generate(n, seed, config)
    rows = {"dense": score_dense(seq), "local": score_window(seq, window)}
    sites = {"sheaf": site_config if site_config is not None else designed_site(), **(extra_sites or {})}
    for name, cfg in sites.items():
        rows[name] = score_site(seq, build_site(seq.ids, cfg), hops)
        rows[name]["site_config"] = {"patch_types": list(cfg.patch_types), "local_window": cfg.local_window}
    return {
        "n": n, "seed": seed, "hops": hops, "window": window,
        "generator": asdict(seq.config), "deps": seq.dep_counts(),
        "topologies": rows, "seconds": time.perf_counter() - start,
    }



def run_scaling(ns: tuple[int, ...] = tuple(2**k for k in range(10, 21)), seed: int = 0, hops: int = 3,
                window: int = 8, config: GeneratorConfig | None = None, site_config: SiteConfig | None = None,
                relations_up_to: int = 1 << 20) -> dict:
    """Edges against n per topology, and the site's relations and coverage.

    Dense and window edges are analytic; the site is built and counted at
    every n (its relations only up to ``relations_up_to``, the costly part).

    Returns:
        dict with ``ns`` and, per topology, a list per n of ``edges`` (plus
        ``relations``, ``coverage``, ``waste`` for the site), ``deps`` per n,
        and ``slope`` (fitted exponent of edges ~ n^a) per topology.
    """
    site_config = site_config if site_config is not None else designed_site()
    out = {"ns": list(ns), "seed": seed, "hops": hops, "window": window, "deps": [], "seconds": [],
           "dense": {"edges": []}, "local": {"edges": [], "coverage": []},
           "sheaf": {"edges": [], "relations": [], "coverage": [], "waste": []}}
    for n in ns:
        start = time.perf_counter()
        seq = generate(n, seed, config)
        out["deps"].append(int(seq.src.numel()))
        out["dense"]["edges"].append(dense_relations(n))
        window_row = score_window(seq, window)
        out["local"]["edges"].append(window_row["edges"])
        out["local"]["coverage"].append(window_row["coverage"])
        data = build_site(seq.ids, site_config)
        if n <= relations_up_to:
            row = score_site(seq, data, hops)
            out["sheaf"]["edges"].append(row["edges"])
            for key in ("relations", "coverage", "waste"):
                out["sheaf"][key].append(row[key])
        else:
            out["sheaf"]["edges"].append(site_graph(data).num_edges)
            for key in ("relations", "coverage", "waste"):
                out["sheaf"][key].append(None)
        out["seconds"].append(time.perf_counter() - start)
    for name in ("dense", "local", "sheaf"):
        out[name]["slope"] = fit_exponent(out["ns"], out[name]["edges"])
    out["sheaf"]["relations_slope"] = fit_exponent(out["ns"], out["sheaf"]["relations"])
    out["deps_slope"] = fit_exponent(out["ns"], out["deps"])
    return out



def plot_scaling(result: dict, path) -> None:
    """Log-log plot of edges against n per topology (and the site's relations, G*), PNG."""
    plt = pyplot()
    ns = result["ns"]
    fig, ax = plt.subplots(figsize=(6.4, 4.8), dpi=120)
    series = [
        ("dense attention", result["dense"]["edges"], "-", "tab:red"),
        (f"local window (w={result['window']})", result["local"]["edges"], "-", "tab:orange"),
        ("sheaf site: message edges", result["sheaf"]["edges"], "-", "tab:blue"),
        (f"sheaf site: relations (H={result['hops']})", result["sheaf"]["relations"], "--", "tab:blue"),
        ("true dependencies G*", result["deps"], ":", "black"),
    ]
    for label, values, style, color in series:
        pts = [(x, y) for x, y in zip(ns, values) if y]
        if pts:
            slope = fit_exponent(*map(list, zip(*pts)))
            ax.loglog(*zip(*pts), style, marker="o", ms=3, color=color,
                      label=power_law_label(label, slope))
    label_loglog(ax, "sequence length n (tokens)", "edges / relations", "Relations against context length", 8)
    save_figure(fig, path)



def _percent(value: float | None) -> str:
    return "" if value is None else f"{100 * value:g}%"


def _count(value: int | None) -> str:
    """536_000_000 -> '536M', 100_000 -> '100k'."""
    if value is None:
        return ""
    return f"{value / 1e6:g}M" if value >= 1_000_000 else f"{value / 1e3:g}k"


def format_table(result: dict) -> str:
    """The table as text, beside the paper's figures (:data:`~sheafgnn.experiments.synthetic.PAPER`)."""
    lines = [f"n = {result['n']}, G* = {result['deps']['total']} dependencies "
             f"({', '.join(f'{k} {v}' for k, v in result['deps'].items() if k != 'total')}), "
             f"H = {result['hops']} hops, window = {result['window']}, {result['seconds']:.1f} s",
             f"{'topology':<16}{'coverage':>10}{'waste':>10}{'relations':>14}{'edges':>14}"
             f"   | {'paper: cov.':>14}{'waste':>8}{'edges':>7}"]
    for name, row in result["topologies"].items():
        paper = PAPER.get(name, {})
        lines.append(f"{name:<16}{100 * row['coverage']:>9.2f}%{100 * row['waste']:>9.2f}%"
                     f"{row['relations']:>14,}{row['edges']:>14,}   | {_percent(paper.get('coverage')):>14}"
                     f"{_percent(paper.get('waste')):>8}{_count(paper.get('edges')):>7}")
    return "\n".join(lines)


def hop_sweep(n: int, seed: int, hops: tuple[int, ...]) -> dict:
    """The default site's coverage, waste and relations at several hop counts H."""
    seq = generate(n, seed)
    data = build_site(seq.ids)
    out = {}
    for h in hops:
        row = score_site(seq, data, h)
        out[h] = {k: row[k] for k in ("coverage", "waste", "relations", "coverage_by_type")}
    return out


def parse_simulate_args(argv: list[str] | None = None) -> argparse.Namespace:
    """``sheafgnn simulate`` flags."""
    parser = ArgumentParser(prog="sheafgnn simulate", description="the paper's synthetic dependency simulation")
    parser.add_argument("--n", type=at_least(8), default=32768, help="tokens for the table (default: 32768)")
    parser.add_argument("--seed", type=at_least(0), default=0)
    parser.add_argument("--hops", type=at_least(1), default=3, help="hops H of the site's relations (default: 3)")
    parser.add_argument("--window", type=at_least(1), default=8, help="keys of the local window (default: 8)")
    parser.add_argument("--max-log2", type=at_least(10), default=20,
                        help="scaling run up to n = 2^this (default: 20)")
    parser.add_argument("--out", default="runs/simulate", help="output folder (default: runs/simulate)")
    parser.add_argument("--learned", action="store_true",
                        help="instead: train SheafStateLM and score its learned topology (learned_topology.json)")
    learned = {name: p.default for name, p in inspect.signature(run_learned).parameters.items()}  # one set of defaults
    parser.add_argument("--steps", type=at_least(1), default=learned["steps"],
                        help=f"--learned: optimizer steps (default: {learned['steps']})")
    parser.add_argument("--n-train", type=at_least(8), default=learned["n_train"],
                        help=f"--learned: training tokens (default: {learned['n_train']})")
    parser.add_argument("--lr", type=float, default=learned["lr"],
                        help=f"--learned: peak learning rate (default: {learned['lr']})")
    parser.add_argument("--train-window", type=at_least(2), default=learned["window"],
                        help=f"--learned: tokens per window (default: {learned['window']})")
    parser.add_argument("--topology-k", type=at_least(1), default=learned["topology_k"],
                        help=f"--learned: gluing edges kept per destination (default: {learned['topology_k']})")
    parser.add_argument("--set", dest="model_set", action="append", default=[], metavar="KEY=VALUE",
                        help="--learned: a field of the model's SheafStateConfig, e.g. pool_loss_weight=0")
    parser.add_argument("--max-seconds", type=float, default=None, help="--learned: stop training after this long")
    parser.add_argument("--save-model", metavar="DIR", default=None,
                        help="--learned: keep the trained model in DIR (a checkpoint folder; "
                             "sheafgnn.experiments.learned_model.load_learned_model reads it)")
    parser.add_argument("--cut-chains", action="store_true",
                        help="--learned, --routes-of: train and evaluate with every chain restarted after each "
                             "section key, so that only the gluing can carry the key (learned_routes.cut_chains)")
    parser.add_argument("--routes-of", metavar="DIR", default=None,
                        help="instead: the route cuts of the model --learned --save-model DIR kept, with that "
                             "study's --n, --seed and --cut-chains (learned_routes.json)")
    parser.add_argument("--threads", type=at_least(0), default=1,
                        help="--learned, --routes-of: torch threads (default: 1, the model is tiny; 0: torch's "
                             "default)")
    return parser.parse_args(argv)


def main_simulate(argv: list[str] | None = None) -> int:
    """``sheafgnn simulate``: the table at n = 32,768 and the scaling run, JSON + PNG in ``--out``."""
    args = parse_simulate_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.learned:
        return main_learned(args, out)
    if args.routes_of is not None:
        return main_routes(args, out)
    _table_command(args, out)
    _scaling_command(args, out)
    print(f"\nwrote {out / 'simulate_table.json'}, {out / 'simulate_scaling.json'}, {out / 'simulate_scaling.png'}")
    return 0


def _table_command(args: argparse.Namespace, out: Path) -> None:
    """The table with the matched site and the hop sweep: printed, and ``simulate_table.json``."""
    table = run_table(args.n, args.seed, args.hops, args.window,
                      extra_sites={"sheaf (matched)": matched_site_config()})
    table["hop_sweep"] = hop_sweep(args.n, args.seed, (1, 2, 3, 4))
    table["paper"] = PAPER
    print(format_table(table))
    print("\n'sheaf' is the default SiteConfig; 'sheaf (matched)' keeps only local, sentence, instruction,"
          "\nmemory and retrieval patches. Edges: attention pairs for dense/local, message edges for the site.")
    print(f"\nsite at H hops:  {'H':>3}{'coverage':>10}{'waste':>10}{'relations':>14}")
    for h, row in table["hop_sweep"].items():
        print(f"{'':17}{h:>3}{100 * row['coverage']:>9.2f}%{100 * row['waste']:>9.2f}%{row['relations']:>14,}")
    write_json(out / "simulate_table.json", table)


def _scaling_command(args: argparse.Namespace, out: Path) -> None:
    """The scaling run up to 2^max_log2: printed, ``simulate_scaling.json`` and ``simulate_scaling.png``."""
    start = time.perf_counter()
    ns = tuple(2**k for k in range(10, args.max_log2 + 1))
    scaling = run_scaling(ns, args.seed, args.hops, args.window)
    scaling["total_seconds"] = time.perf_counter() - start
    write_json(out / "simulate_scaling.json", scaling)
    plot_scaling(scaling, out / "simulate_scaling.png")
    print(f"\nscaling, n = 2^10 .. 2^{args.max_log2} ({scaling['total_seconds']:.0f} s)")
    print(f"{'n':>9}{'G*':>11}{'dense':>17}{'local':>11}{'site edges':>12}{'site rel.':>12}{'site cov.':>10}")
    for i, n in enumerate(ns):
        rel = scaling["sheaf"]["relations"][i]
        cov = scaling["sheaf"]["coverage"][i]
        print(f"{n:>9}{scaling['deps'][i]:>11,}{scaling['dense']['edges'][i]:>17,}{scaling['local']['edges'][i]:>11,}"
              f"{scaling['sheaf']['edges'][i]:>12,}{f'{rel:,}' if rel is not None else '-':>12}"
              f"{100 * cov if cov is not None else float('nan'):>9.2f}%")
    slopes = {k: scaling[k]["slope"] for k in ("dense", "local", "sheaf")}
    print("fitted exponents (edges ~ n^a): " + ", ".join(f"{k} {v:.3f}" for k, v in slopes.items())
          + f", site relations {scaling['sheaf']['relations_slope']:.3f}")
