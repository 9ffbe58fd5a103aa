"""bench_ablation's report of kept rows (``--report``: no training), a variant with fewer seeds than the full model
compared on its own seeds."""

import json
import sys
from pathlib import Path

import pytest

from .conftest import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("bench_ablation")


def keep(out: Path, variant: str, seed: int, val_bpb: float) -> None:
    row = {"variant": variant, "seed": seed, "model": "sheaf", "model_config": {}, "site": {}, "val_bpb": val_bpb,
           "params": 1000, "tokens": 4096, "train_tokens_per_s": 100.0, "train_s": 60.0, "nodes_per_token": 2.0,
           "edges_per_token": 10.0}
    path = out / "ablation_runs" / f"{variant}_seed{seed}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(row))


def test_report_of_kept_rows_pairs_a_partial_variant_with_its_seeds(bench, tmp_path, monkeypatch):
    keep(tmp_path, "full", 0, 2.30)
    keep(tmp_path, "full", 1, 2.34)
    keep(tmp_path, "ssm", 0, 2.35)  # seed 1 not run yet
    monkeypatch.setattr(bench, "active_patch_types", lambda: ["workspace"])
    monkeypatch.setattr(sys, "argv", ["bench_ablation.py", "--report", "--variants", "ssm", "no_workspace",
                                      "--seeds", "0", "1", "--jobs", "1", "--out", str(tmp_path)])
    bench.main()
    report = json.loads((tmp_path / "ablation.json").read_text())
    rows = {r["variant"]: r for r in report["variants"]}
    assert set(rows) == {"full", "ssm"}  # no_workspace has no kept row
    assert rows["ssm"]["seeds"] == [0] and rows["ssm"]["change_bpb"] == pytest.approx(0.05)  # against seed 0's 2.30
    assert rows["ssm"]["change_per_seed"] == [pytest.approx(0.05)]
    assert report["seed_spread"] == pytest.approx(0.04)
    assert "| ssm | 2.3500 (seed 0 only) | 2.3500 | +0.0500 |" in (tmp_path / "ablation.md").read_text()


def test_report_without_the_full_model_says_so(bench, tmp_path, monkeypatch):
    keep(tmp_path, "ssm", 0, 2.35)
    monkeypatch.setattr(bench, "active_patch_types", lambda: [])
    monkeypatch.setattr(sys, "argv", ["bench_ablation.py", "--report", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="no kept row of the full model"):
        bench.main()


def test_report_leaves_out_the_seeds_the_full_model_lacks(bench, tmp_path, monkeypatch):
    keep(tmp_path, "full", 0, 2.30)  # seed 1 of the full model not run yet
    keep(tmp_path, "ssm", 0, 2.35)
    keep(tmp_path, "ssm", 1, 2.20)
    monkeypatch.setattr(bench, "active_patch_types", lambda: [])
    monkeypatch.setattr(sys, "argv", ["bench_ablation.py", "--report", "--variants", "ssm", "--out", str(tmp_path)])
    bench.main()
    ssm = next(r for r in json.loads((tmp_path / "ablation.json").read_text())["variants"] if r["variant"] == "ssm")
    assert ssm["seeds"] == [0] and ssm["change_bpb"] == pytest.approx(0.05)
    assert ssm["change_per_seed"] == [pytest.approx(0.05)]


def test_variants_switch_the_parts_as_the_recall_components_do(bench):
    from sheafgnn.experiments.components import component_changes

    specs = bench.variants(64, ["workspace"])
    for name, change in component_changes().items():
        assert specs[name]["model_config"] == {"d_model": 64, "n_layers": 2, **change}
    assert "workspace" not in specs["no_workspace"]["site"]["patch_types"]


def test_a_combined_variant_switches_every_part_it_names(bench):
    from sheafgnn.model import SheafStateConfig

    specs = bench.variants(64, ["workspace"])
    spec = bench.combined(specs, "no_workspace+random_proposals+qk_norm")
    assert spec["model_config"] == {"d_model": 64, "n_layers": 2, **specs["random_proposals"]["model_config"],
                                    "topology": {**specs["random_proposals"]["model_config"]["topology"],
                                                 **specs["qk_norm"]["model_config"]["topology"]}}
    assert set(SheafStateConfig().site.patch_types) - set(spec["site"]["patch_types"]) == {"workspace"}
    with pytest.raises(SystemExit, match="ssm"):
        bench.combined(specs, "no_workspace+ssm")
