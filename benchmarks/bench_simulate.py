"""The paper's synthetic dependency simulation: the table at n = 32,768 and the scaling run.

::

    python benchmarks/bench_simulate.py [--n 32768] [--max-log2 20] [--out benchmarks/results]

Writes ``simulate_table.json``, ``simulate_scaling.json`` and
``simulate_scaling.png`` and prints the table beside the paper's figures;
the same as ``sheafgnn simulate``. Definitions (relations, coverage, waste,
hops): :mod:`sheafgnn.simulate`.
"""

import sys

from sheafgnn.simulate import main_simulate

if __name__ == "__main__":
    sys.exit(main_simulate())
