"""The paper's synthetic dependency simulation: the table at n = 32,768 and the scaling run.

::

    python benchmarks/bench_simulate.py [--n 32768] [--max-log2 20] [--out benchmarks/results]

Writes ``simulate_table.json``, ``simulate_scaling.json`` and
``simulate_scaling.png`` into the project's recorded results
(``benchmarks/results`` unless ``--out`` says otherwise) and prints the table
beside the paper's figures; the same as ``sheafgnn simulate --out
benchmarks/results``. Definitions (relations, coverage, waste, hops):
:mod:`sheafgnn.relations`; the experiment: :mod:`sheafgnn.experiments.simulation`.
"""

import sys

from sheafgnn.experiments.simulation import main_simulate

if __name__ == "__main__":
    sys.exit(main_simulate(["--out", "benchmarks/results", *sys.argv[1:]]))  # a later --out wins
