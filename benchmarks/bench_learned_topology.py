"""Beyond the paper: train SheafStateLM on the synthetic sequences and score its learned topology.

::

    python benchmarks/bench_learned_topology.py [--steps 4500] [--n-train 524288] [--gate-penalty 0.01]
                                                [--max-seconds 480] [--out benchmarks/results]

Writes ``simulate_learned.json`` and ``simulate_learned.png`` (gate
histograms by edge type, coverage and waste against the gate threshold,
edges against n) into the project's recorded results (``benchmarks/results``
unless ``--out`` says otherwise) and prints the learned topology beside the
designed site; the same as ``sheafgnn simulate --learned --out
benchmarks/results``. Definitions (relations, coverage, waste, hops):
:mod:`sheafgnn.relations`; the experiment:
:func:`sheafgnn.experiments.learned_topology.run_learned`.
"""

import sys

from sheafgnn.experiments.simulation import main_simulate

if __name__ == "__main__":
    sys.exit(main_simulate(["--learned", "--out", "benchmarks/results", *sys.argv[1:]]))  # a later --out wins
