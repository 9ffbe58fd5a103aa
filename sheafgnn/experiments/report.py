"""What the experiment commands share: running a report command, writing a report, plotting, fitting.

::

    report_parser(prog, description, config_class, default_out)   --quick, --out, --no-progress, --config
    config_from_args(config_class, namespace, ...)    the --config file, then the flags -> a config
    run_report_command(parse, run, argv)              flags -> config -> run -> "wrote ..." (exit 0); bad input
                                                      raises (sheafgnn.cli.main prints it, exit 2)
    write_report(report, out, name, text, figures)    the figures, out/name.md, out/name.json
    write_json(path, obj)                             indented JSON
    pyplot()                                          matplotlib.pyplot on the Agg backend (files only)
    save_figure(fig, path)                            tight layout, write, close
    fit_exponent(ns, values)                          a of values ~ n^a (log-log least squares)
    power_law_label(label, a), label_loglog(ax, ...)  legend entries and labels of an edges-against-n panel
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from sheafgnn.config import ArgumentParser
from sheafgnn.optional import require


def report_parser(prog: str, description: str, config_class: type, default_out: str) -> argparse.ArgumentParser:
    """An argument parser with the flags every report command has: ``--quick``, ``--out``,
    ``--no-progress`` and ``--config`` (a file of ``config_class``, which the other flags override)."""
    parser = ArgumentParser(prog=prog, description=description)  # argparse errors: one line, exit 2
    parser.add_argument("--quick", action="store_true", help="toy sizes that run in seconds")
    parser.add_argument("--out", dest="out_dir", help=f"output folder (default: {default_out})")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument("--config", help=f"a {config_class.__name__} as YAML, TOML or JSON (flags override it)")
    return parser


def config_from_args(config_class: type, namespace: argparse.Namespace, preset: dict | None = None, **switches):
    """The config of a :func:`report_parser`'s parsed flags: the ``--config`` file's values, then
    ``preset``, then the config fields given as flags, then ``switches`` (the command's own flags as
    config values) and ``--no-progress``; from ``config_class.quick`` with ``--quick``."""
    args = vars(namespace)
    values = config_class.load(args["config"]).to_dict() if args["config"] else {}
    values.update(preset or {})
    values.update(config_class.given_values(namespace))
    values.update(switches)
    if args["no_progress"]:
        values["progress"] = False
    return config_class.quick(**values) if args["quick"] else config_class(**values)


def run_report_command(parse: Callable[[list[str] | None], Any], run: Callable[[Any], dict],
                       argv: list[str] | None) -> int:
    """Parse flags into a config, run it, list the files written (the report's ``files`` live in
    ``config.out_dir``). Bad input raises; ``sheafgnn.cli.main`` reports it in one line."""
    config = parse(argv)
    report = run(config)
    print(f"wrote {', '.join(str(Path(config.out_dir) / f) for f in report['files'])}")
    return 0


def write_json(path: Path, obj: Any) -> None:
    """``obj`` as indented JSON at ``path`` (values JSON cannot hold are written as ``str``)."""
    Path(path).write_text(json.dumps(obj, indent=2, default=str))


def write_report(report: dict, out: Path, name: str, text: str, figures: dict) -> list[str]:
    """Write the ``figures`` (file name -> matplotlib figure, closed once written) into ``out``, then
    ``out/name.md`` (``text``, then every figure as an image) and ``out/name.json`` (``report`` with
    its ``files``); return the file names, figures first."""
    for file, fig in figures.items():
        save_figure(fig, out / file, dpi=120)
    plots = list(figures)
    files = plots + [f"{name}.md", f"{name}.json"]
    (out / f"{name}.md").write_text(text + "".join(f"\n![{p}]({p})\n" for p in plots))
    write_json(out / f"{name}.json", {**report, "files": files})
    return files


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend (writes files, needs no display), imported on first use.

    Raises:
        MissingExtra: matplotlib is not installed (it is in the experiments extra).
    """
    require("matplotlib", "plotting").use("Agg")
    return require("matplotlib.pyplot", "plotting")


def save_figure(fig, path: Path, dpi: int | None = None) -> None:
    """Lay ``fig`` out tightly, write it to ``path`` and close it."""
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)


def fit_exponent(ns: list[int], values: list[float | None]) -> float | None:
    """Least-squares exponent a of values ~ n^a (log-log fit over the positive values); None below 2 points."""
    pts = [(math.log(x), math.log(y)) for x, y in zip(ns, values) if y and y > 0]
    if len(pts) < 2:
        return None
    lx, ly = np.array(pts).T
    return float(np.polyfit(lx, ly, 1)[0])


def power_law_label(label: str, exponent: float | None) -> str:
    """A legend entry ``label (∝ n^a)``, or ``label`` alone when there is no fitted exponent."""
    return f"{label} ($\\propto n^{{{exponent:.2f}}}$)" if exponent is not None else label


def label_loglog(ax, xlabel: str, ylabel: str, title: str, legend_size: int) -> None:
    """Axis labels, title, a grid on both decades and the legend of a log-log panel."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=legend_size)
