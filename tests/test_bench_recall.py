"""bench_recall's sweep: which rates it runs, which it keeps, and what rates.json holds (no training: each run's
report is made up from its model and rate)."""

import argparse
import json

import pytest

from .conftest import load_benchmark


@pytest.fixture
def bench(monkeypatch):
    module = load_benchmark("bench_recall")
    accuracy = {("sheaf", 3e-4): 0.2, ("sheaf", 1e-3): 0.6, ("sheaf", 3e-3): 0.9, ("sheaf", 1e-2): 0.1,
                ("dense_conv", 1e-3): 0.7, ("dense_conv", 3e-3): 0.8, ("dense_conv", 1e-2): 0.95,
                ("dense_conv", 3e-2): 0.97, ("dense_conv", 1e-1): 0.985,
                # passing runs (>= 0.99, the stop): the middle passing rate is the best, not the most accurate
                ("dense", 1e-3): 0.5, ("dense", 3e-3): 0.991, ("dense", 1e-2): 0.999,
                ("ssm", 3e-4): 0.3, ("ssm", 1e-3): 0.995, ("ssm", 3e-3): 0.999, ("ssm", 1e-2): 0.2}
    ran = []

    def fake_run(out, name, flags, budget):
        model, lr = flags[flags.index("--models") + 1], float(flags[flags.index("--lr") + 1])
        ran.append((model, lr))
        return {"tasks": {"mqar": {"train_len": 128, "models": {model: {"accuracy": {"128": accuracy[model, lr]},
                                                                       "steps": 3000}}}}}

    monkeypatch.setattr(module, "run", fake_run)
    return module, ran


def test_sweep_widens_at_an_edge_and_stops_inside(bench, tmp_path):
    module, ran = bench
    best = module.sweep(tmp_path, ("sheaf",), 1, module.QUICK, module.SIZES)
    assert best == {"sheaf": 3e-3}  # at the edge of (3e-4, 1e-3, 3e-3): widened to 1e-2, then inside
    assert sorted(set(lr for _, lr in ran)) == [3e-4, 1e-3, 3e-3, 1e-2]


def test_sweep_widens_at_most_widen_times(bench, tmp_path):
    module, ran = bench
    best = module.sweep(tmp_path, ("dense_conv",), 1, module.QUICK, module.SIZES)
    swept = json.loads((tmp_path / "rates.json").read_text())["swept"]["dense_conv"]
    assert swept == [1e-3, 3e-3, 1e-2, 3e-2, 1e-1]  # the half-decade grid, WIDEN rates past its end
    assert best == {"dense_conv": 1e-1}  # still at the edge, but the sweep may widen no further


def test_a_later_sweep_keeps_the_rates_of_models_swept_before(bench, tmp_path):
    module, _ = bench
    module.sweep(tmp_path, ("dense_conv",), 1, module.QUICK, module.SIZES)
    module.sweep(tmp_path, ("sheaf",), 1, module.QUICK, module.SIZES)
    rates = json.loads((tmp_path / "rates.json").read_text())
    assert rates["best"] == {"dense_conv": 1e-1, "sheaf": 3e-3}
    assert set(rates["swept"]) == {"dense_conv", "sheaf"}


def test_the_best_rate_is_the_lower_middle_of_two_that_pass(bench, tmp_path):
    module, ran = bench
    assert module.sweep(tmp_path, ("dense",), 1, module.QUICK, module.SIZES) == {"dense": 3e-3}  # not 1e-2's 0.999
    assert sorted(set(lr for _, lr in ran)) == [1e-3, 3e-3, 1e-2]  # inside: no widening


def test_the_best_rate_is_the_middle_of_those_that_pass():
    best_rate = load_benchmark("bench_recall").best_rate
    passing = {1e-4: (0.996, 2000), 3e-4: (0.998, 700), 1e-3: (1.0, 400)}
    assert best_rate(passing, 0.99) == 3e-4  # neither the lowest nor the fastest
    assert best_rate({**passing, 3e-3: (0.994, 300)}, 0.99) == 3e-4  # four: the lower middle
    assert best_rate({**passing, 3e-5: (0.5, 3000)}, 0.99) == 3e-4  # a failing rate does not count
    assert best_rate({1e-3: (0.4, 3000), 3e-3: (0.9, 3000), 1e-2: (0.9, 2500)}, 0.99) == 1e-2  # none: most accurate


def test_a_best_rate_at_the_lower_edge_widens_below(bench, tmp_path):
    module, ran = bench
    assert module.sweep(tmp_path, ("ssm",), 1, module.QUICK, module.SIZES) == {"ssm": 1e-3}
    assert sorted(set(lr for _, lr in ran)) == [3e-4, 1e-3, 3e-3, 1e-2]  # 3e-4 fails: 1e-3 now lies inside


def test_each_variant_is_read_back_from_the_options_its_run_trained_with():
    module = load_benchmark("bench_recall")
    options = module.variant_options()
    assert set(module.COMPONENTS) < set(options)
    for name, known in options.items():
        assert module.variant_of({**known, "lr": 1e-3}) == (name or "-")
    assert options["no_workspace"]["site"] == {**module.TASK_SITE, "patch_types": ["output"]}
    assert options["identity_maps"]["sheaf"] == {"gluing": {"map_kind": "identity"}}
    unknown = {"sheaf": {"topology": {"k": 4}}, "site": module.TASK_SITE}
    assert module.variant_of(unknown) == json.dumps(unknown)  # options of no variant are named by themselves


def test_components_stage_runs_the_sheaf_model_with_each_variant_at_its_rate():
    module = load_benchmark("bench_recall")
    specs = module.stage_specs("components", ("dense_conv",), {"sheaf": 3e-4}, module.SIZES, (0, 2),
                               ("no_workspace", "qk_norm"))
    assert [name for name, _ in specs] == ["mqar256_sheaf_no_workspace_lr0.0003_s0",
                                           "mqar256_sheaf_no_workspace_lr0.0003_s2",
                                           "mqar256_sheaf_qk_norm_lr0.0003_s0", "mqar256_sheaf_qk_norm_lr0.0003_s2"]
    flags = dict(specs[2][1][i:i + 2] for i in range(len(specs[2][1]) - 1) if specs[2][1][i].startswith("--"))
    assert flags["--models"] == "sheaf" and flags["--lr"] == "0.0003" and flags["--mqar-seq-len"] == "256"
    trained = {"sheaf": json.loads(flags["--sheaf"]), "site": json.loads(flags["--site"])}
    assert module.variant_of(trained) == "qk_norm"


def test_components_stage_runs_each_of_its_sizes():
    module = load_benchmark("bench_recall")
    sizes = {**module.SIZES, "components": (module.mqar_size("256x16"), module.mqar_size("512X32"))}
    specs = module.stage_specs("components", ("sheaf",), {"sheaf": 3e-4}, sizes, (1,), ("map_init",))
    assert [name for name, _ in specs] == ["mqar256_sheaf_map_init_lr0.0003_s1",
                                           "mqar512_sheaf_map_init_lr0.0003_s1"]
    assert "--mqar-test-lens" not in specs[1][1]  # only (256, 16) is tested at other lengths
    for bad in ("512", "512x", "512x300", "x32", "ax2"):
        with pytest.raises(argparse.ArgumentTypeError, match="LENxPAIRS|pairs"):
            module.mqar_size(bad)


def test_the_components_stage_alone_sweeps_only_the_sheaf_model():
    module = load_benchmark("bench_recall")
    assert module.swept_models(["components"], module.MODELS) == ("sheaf",)
    assert module.swept_models(["sizes", "components"], ("dense_conv",)) == ("sheaf", "dense_conv")
    assert module.swept_models(["sizes"], ("dense_conv",)) == ("dense_conv",)
    assert module.swept_models(list(module.STAGES), module.MODELS) == module.MODELS


def test_summary_rows_name_the_variant_of_each_run(tmp_path):
    module = load_benchmark("bench_recall")
    options = module.variant_options()
    for name, variant in (("mqar256_sheaf_lr0.0003_s0", ""),
                          ("mqar256_sheaf_no_workspace_lr0.0003_s0", "no_workspace")):
        report = tmp_path / "runs" / name / "tasks.json"
        report.parent.mkdir(parents=True)
        row = {"task": "mqar", "seq_len": 256, "model": "sheaf", "map_kind": "diag", "accuracy": 0.5}
        report.write_text(json.dumps({"config": options[variant], "summary": [row]}))
    rows = {r["run"]: r for r in module.summary_rows(tmp_path)}
    assert rows["mqar256_sheaf_lr0.0003_s0"]["variant"] == "-"
    assert rows["mqar256_sheaf_no_workspace_lr0.0003_s0"]["variant"] == "no_workspace"
