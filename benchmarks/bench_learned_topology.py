"""Beyond the paper: train SheafStateLM on the synthetic sequences and score its learned topology.

::

    python benchmarks/bench_learned_topology.py [--steps 4500] [--n-train 524288] [--gate-penalty 0.01]
                                                [--max-seconds 480] [--out benchmarks/results]

Writes ``simulate_learned.json`` and ``simulate_learned.png`` (gate
histograms by edge type, coverage and waste against the gate threshold,
edges against n) and prints the learned topology beside the designed site;
the same as ``sheafgnn simulate --learned``. Definitions (relations,
coverage, waste, hops): :mod:`sheafgnn.simulate`; the experiment:
:func:`sheafgnn.simulate.run_learned`.
"""

import sys

from sheafgnn.simulate import main_simulate

if __name__ == "__main__":
    sys.exit(main_simulate(["--learned", *sys.argv[1:]]))
