"""Beyond the paper: train SheafStateLM on the synthetic sequences and score its learned topology.

::

    python benchmarks/bench_learned_topology.py [--steps 12000] [--n-train 1048576] [--topology-k 2]
                                                [--max-seconds 480] [--out benchmarks/results]

Writes ``learned_topology.json`` and ``learned_topology.png`` (the
per-destination AUCs by block, coverage and waste of each topology, edges
against n) into the project's recorded results (``benchmarks/results``
unless ``--out`` says otherwise) and prints the learned topology beside the
designed site; the same as ``sheafgnn simulate --learned --out
benchmarks/results``. The JSON's keys are defined in
:mod:`sheafgnn.experiments.learned_topology`; relations, coverage, waste and
hops in :mod:`sheafgnn.relations`; AUC per destination and candidate recall
in :mod:`sheafgnn.experiments.pool_scoring`.
"""

import sys

from sheafgnn.experiments.simulation import main_simulate

if __name__ == "__main__":
    sys.exit(main_simulate(["--learned", "--out", "benchmarks/results", *sys.argv[1:]]))  # a later --out wins
