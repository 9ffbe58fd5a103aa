"""What the experiment commands share: running a report command, writing a report, plotting, fitting.

::

    run_report_command(prog, parse, run, argv)   flags -> config -> run -> "wrote ..." (exit 0) or
                                                 "prog: error: ..." on stderr (exit 1)
    write_report(report, out, name, text, plots) out/name.md (text, then the plots) and out/name.json
    write_json(path, obj)                        indented JSON
    pyplot()                                     matplotlib.pyplot on the Agg backend (files only)
    fit_exponent(ns, values)                     a of values ~ n^a (log-log least squares)
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np


def run_report_command(prog: str, parse: Callable[[list[str] | None], Any], run: Callable[[Any], dict],
                       argv: list[str] | None) -> int:
    """Parse flags into a config, run it, list the files written; a ``ValueError`` becomes
    ``prog: error: ...`` and exit status 1 (the report's ``files`` live in ``config.out_dir``)."""
    try:
        config = parse(argv)
        report = run(config)
    except ValueError as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 1
    print(f"wrote {', '.join(str(Path(config.out_dir) / f) for f in report['files'])}")
    return 0


def write_json(path: Path, obj: Any) -> None:
    """``obj`` as indented JSON at ``path`` (values JSON cannot hold are written as ``str``)."""
    Path(path).write_text(json.dumps(obj, indent=2, default=str))


def write_report(report: dict, out: Path, name: str, text: str, plots: list[str]) -> list[str]:
    """Write ``out/name.md`` (``text``, then every plot as an image) and ``out/name.json`` (``report``
    with its ``files``); return the file names, plots first."""
    files = plots + [f"{name}.md", f"{name}.json"]
    (out / f"{name}.md").write_text(text + "".join(f"\n![{p}]({p})\n" for p in plots))
    write_json(out / f"{name}.json", {**report, "files": files})
    return files


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend (writes files, needs no display), imported on first use."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def fit_exponent(ns: list[int], values: list[float | None]) -> float | None:
    """Least-squares exponent a of values ~ n^a (log-log fit over the positive values); None below 2 points."""
    pts = [(math.log(x), math.log(y)) for x, y in zip(ns, values) if y and y > 0]
    if len(pts) < 2:
        return None
    lx, ly = np.array(pts).T
    return float(np.polyfit(lx, ly, 1)[0])
