"""The paper's synthetic dependency simulation: the table at n = 32,768 and the scaling run.

::

    python benchmarks/bench_simulate.py [--n 32768] [--max-log2 20] [--out benchmarks/results]

Writes ``simulate_table.json``, ``simulate_scaling.json`` and
``simulate_scaling.png`` and prints the table beside the paper's figures.
Definitions (relations, coverage, waste, hops): :mod:`sheafgnn.simulate`.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from sheafgnn import simulate as S
from sheafgnn.site import build_site


def hop_sweep(n: int, seed: int, hops: tuple[int, ...]) -> dict:
    """The default site's coverage, waste and relations at several hop counts H."""
    seq = S.generate(n, seed)
    data = build_site(seq.ids)
    out = {}
    for h in hops:
        row = S.score_site(seq, data, h)
        out[h] = {k: row[k] for k in ("coverage", "waste", "relations", "coverage_by_type")}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=32768, help="tokens for the table (default: 32768)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hops", type=int, default=3, help="hops H of the site's relations (default: 3)")
    parser.add_argument("--window", type=int, default=8, help="keys of the local window (default: 8)")
    parser.add_argument("--max-log2", type=int, default=20, help="scaling run up to n = 2^this (default: 20)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    table = S.run_table(args.n, args.seed, args.hops, args.window,
                        extra_sites={"sheaf (matched)": S.matched_site_config()})
    table["hop_sweep"] = hop_sweep(args.n, args.seed, (1, 2, 3, 4))
    table["paper"] = {"dense": {"coverage": 1.0, "waste": 0.9998, "edges": 536_000_000},
                      "local": {"coverage": 0.965, "waste": 0.75},
                      "sheaf": {"coverage": 1.0, "waste": 0.325, "edges": 100_000}}
    print(S.format_table(table))
    print("\n'sheaf' is the default SiteConfig; 'sheaf (matched)' keeps only local, sentence, instruction,"
          "\nmemory and retrieval patches. Edges: attention pairs for dense/local, message edges for the site.")
    print(f"\nsite at H hops:  {'H':>3}{'coverage':>10}{'waste':>10}{'relations':>14}")
    for h, row in table["hop_sweep"].items():
        print(f"{'':17}{h:>3}{100 * row['coverage']:>9.2f}%{100 * row['waste']:>9.2f}%{row['relations']:>14,}")
    (out / "simulate_table.json").write_text(json.dumps(table, indent=2))

    start = time.perf_counter()
    ns = tuple(2**k for k in range(10, args.max_log2 + 1))
    scaling = S.run_scaling(ns, args.seed, args.hops, args.window)
    scaling["total_seconds"] = time.perf_counter() - start
    (out / "simulate_scaling.json").write_text(json.dumps(scaling, indent=2))
    S.plot_scaling(scaling, out / "simulate_scaling.png")
    print(f"\nscaling, n = 2^10 .. 2^{args.max_log2} ({scaling['total_seconds']:.0f} s)")
    print(f"{'n':>9}{'G*':>11}{'dense':>17}{'local':>11}{'site edges':>12}{'site rel.':>12}{'site cov.':>10}")
    for i, n in enumerate(ns):
        rel = scaling["sheaf"]["relations"][i]
        cov = scaling["sheaf"]["coverage"][i]
        print(f"{n:>9}{scaling['deps'][i]:>11,}{scaling['dense']['edges'][i]:>17,}{scaling['local']['edges'][i]:>11,}"
              f"{scaling['sheaf']['edges'][i]:>12,}{rel if rel is not None else '-':>12,}"
              f"{100 * cov if cov is not None else float('nan'):>9.2f}%")
    slopes = {k: scaling[k]["slope"] for k in ("dense", "local", "sheaf")}
    print("fitted exponents (edges ~ n^a): " + ", ".join(f"{k} {v:.3f}" for k, v in slopes.items())
          + f", site relations {scaling['sheaf']['relations_slope']:.3f}")
    print(f"\nwrote {out / 'simulate_table.json'}, {out / 'simulate_scaling.json'}, {out / 'simulate_scaling.png'}")


if __name__ == "__main__":
    main()
