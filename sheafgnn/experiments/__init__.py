"""Experiments: drivers of the library, above it (they import ``sheafgnn``; the library never imports them).

::

    compare            sheaf vs dense, local and ssm at matched parameters   (sheafgnn compare)
    tasks              MQAR, selective copying, induction heads: generators
    task_runner        the three tasks for every model kind                  (sheafgnn tasks)
    task_report        its summary rows, Markdown and figures
    synthetic          the paper's synthetic language with its dependency graph G*, scored
    simulation         the paper's table, the scaling run, the hop sweep     (sheafgnn simulate)
    learned_topology   a trained model's topology scored against G*          (sheafgnn simulate --learned)
    pool_scoring       the candidate pools against G*: AUC per destination, candidate recall
    inspection         a topology on a text: statistics, exports, plots      (sheafgnn inspect)
    components         the parts an ablation switches (bench_ablation on text, bench_recall on MQAR)
    report             running a report command, writing reports, plots and fits

Relation graphs and their scoring are library code: :mod:`sheafgnn.relations`.
"""
