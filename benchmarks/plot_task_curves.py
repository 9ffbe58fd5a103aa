"""Accuracy against training steps of several ``sheafgnn tasks`` runs in one figure.

::

    python benchmarks/plot_task_curves.py RUN_DIR [RUN_DIR ...] --out FIGURE.png

Each RUN_DIR holds a ``tasks.json`` written by ``sheafgnn tasks`` with ``--eval-every``; the runs'
models share one panel per task (:func:`sheafgnn.experiments.task_report.curve_figure`), so that
the sheaf model with and without the hash retrieval rule and the baselines sit side by side.
"""

import argparse
import json
from pathlib import Path

from sheafgnn.experiments.report import save_figure
from sheafgnn.experiments.task_report import curve_figure


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="folders with a tasks.json")
    parser.add_argument("--out", type=Path, required=True, help="the figure to write (PNG)")
    args = parser.parse_args()
    reports = [json.loads((run / "tasks.json").read_text()) for run in args.runs]
    save_figure(curve_figure(reports), args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
