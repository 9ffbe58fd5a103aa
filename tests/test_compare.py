"""sheafgnn compare: parameter matching, peak memory, caps, ratios, the report, a toy run end to end."""

from __future__ import annotations

import json
import math

import pytest
import torch

from sheafgnn.experiments import compare
from sheafgnn.experiments.compare import (
    DEFAULT_MODELS,
    LR_WIDEN,
    CompareConfig,
    compare_model,
    compare_options,
    kept_models,
    lr_sweep_one,
    main_compare,
    next_rate,
    parse_compare_args,
    run_compare,
    speed_ratios,
    sweep_one,
)
from sheafgnn.experiments.compare_report import at_equal_seconds, markdown
from sheafgnn.experiments.recurrence import bucket_names
from sheafgnn.lm import MODEL_KINDS, matched_options
from sheafgnn.memory import PeakMemory, heap_stats, release_free_memory, resident_bytes, take_peak_resident_bytes

from .conftest import word_corpus


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    return word_corpus(tmp_path_factory.mktemp("corpus") / "corpus.txt", 200)


def test_matched_options_within_ten_percent():
    options, counts = matched_options(MODEL_KINDS, {"d_model": 64, "n_layers": 2}, 512, n_heads=2, window=32)
    assert set(options) == set(MODEL_KINDS) and counts["sheaf"] == counts["target"]
    for kind in MODEL_KINDS:
        assert abs(counts[kind] - counts["target"]) / counts["target"] <= 0.1, (kind, counts)
    assert options["local"]["window"] == 32 and "window" not in options["dense"]
    assert options["ssm"]["d_model"] > options["sheaf"]["d_model"]  # no gluing: wider for the same count
    with pytest.raises(ValueError, match="ssm width"):
        matched_options(("ssm",), {"d_model": 64, "n_layers": 2}, 512, n_heads=2, window=32, tolerance=1e-6)


def test_compare_model_is_the_seeded_model_that_compare_trains():
    config = CompareConfig.quick(models=("sheaf", "dense"), seed=3)
    options, counts = compare_options(config)
    assert options["sheaf"]["d_model"] == config.d_model and abs(counts["dense"] / counts["target"] - 1) <= 0.1
    sheaf, site = compare_model(config, "sheaf", options["sheaf"])
    again, _ = compare_model(config, "sheaf", options["sheaf"])
    assert all(torch.equal(a, b) for a, b in zip(sheaf.parameters(), again.parameters()))  # seeded by config.seed
    other, _ = compare_model(CompareConfig.quick(models=("sheaf", "dense"), seed=4), "sheaf", options["sheaf"])
    assert not all(torch.equal(a, b) for a, b in zip(sheaf.parameters(), other.parameters()))
    assert site.local_window == 8  # the config's site rules; a baseline reads tokens only
    assert compare_model(config, "dense", options["dense"])[1].patch_types == ()


def test_peak_memory_sees_an_allocation():
    with PeakMemory() as mem:
        x = torch.ones(50 * (1 << 20) // 4)  # 50 MiB, touched
        del x
    assert mem.peak_bytes > 0
    if mem.method.startswith("VmHWM"):
        assert 40 << 20 <= mem.extra_bytes <= 200 << 20
    with PeakMemory() as small:
        torch.ones(16)
    if small.method.startswith("VmHWM"):
        assert small.extra_bytes < 40 << 20  # the reset forgot the 50 MiB above


def test_heap_stats_and_resident_set_see_an_allocation():
    rss, heap = resident_bytes(), heap_stats()
    if heap is None or rss is None:
        pytest.skip("not glibc >= 2.33 on Linux")
    x = torch.ones(8 << 20)  # 32 MiB, from the heap or its own mmap (keep_freed_memory decides): counted
    grown, now = heap_stats(), resident_bytes()
    assert (grown["in_use_bytes"] + grown["mmap_bytes"]) - (heap["in_use_bytes"] + heap["mmap_bytes"]) >= 30 << 20
    assert now > 0 and rss > 0  # not its growth: freed pages the heap still holds may serve the tensor
    assert grown["heap_bytes"] >= grown["in_use_bytes"] and grown["free_bytes"] >= 0
    del x


def test_take_peak_resident_bytes_reads_each_interval_once():
    if take_peak_resident_bytes() is None:  # the first interval starts here
        pytest.skip("no /proc/self/clear_refs")
    x = torch.ones(16 << 20)  # 64 MiB, touched
    del x
    release_free_memory()  # the resident set falls back: only the interval's peak still holds the 64 MiB
    with_tensor = take_peak_resident_bytes()
    without = take_peak_resident_bytes()  # an interval with nothing allocated: about the resident set now
    assert with_tensor - without >= 48 << 20
    assert abs(without - resident_bytes()) < 16 << 20


def _point(n, fb, mem, skipped=False):
    if skipped:
        return {"n": n, "skipped": True, "reason": "over a cap at n=8192"}
    return {"n": n, "skipped": False, "build_s": 0.1, "fwd_bwd_s": fb, "total_s": fb + 0.1,
            "peak_rss_bytes": mem + (300 << 20), "peak_extra_bytes": mem, "memory_method": "test"}


def test_speed_ratios_and_dense_lower_bound():
    sweep = {"sheaf": [_point(8192, 1.0, 100), _point(16384, 2.0, 200), _point(32768, 4.0, 400)],
             "dense": [_point(8192, 30.0, 1000), _point(16384, 100.0, 1600, skipped=True),
                       _point(32768, 0, 0, skipped=True)]}
    ratios = speed_ratios(sweep)
    assert ratios["16384"]["time_ratio"] is None and ratios["16384"]["time_ratio_at_least"] == pytest.approx(15.0)
    sweep["dense"][1] = _point(16384, 20.0, 1600)
    ratios = speed_ratios(sweep)
    assert ratios["16384"]["time_ratio"] == pytest.approx(10.0)
    assert ratios["16384"]["memory_ratio"] == pytest.approx(200 / 1600)
    assert ratios["32768"]["time_ratio"] is None and ratios["16384"]["dense_model"] == "dense"
    assert speed_ratios({"sheaf": sweep["sheaf"]}) == {}
    conv = {**sweep, "dense_conv": [_point(16384, 40.0, 1600)]}  # the field's baseline wins where it ran
    assert speed_ratios(conv)["16384"]["time_ratio"] == pytest.approx(20.0)
    assert speed_ratios(conv)["16384"]["dense_model"] == "dense_conv"


def test_sweep_stops_after_the_cap(corpus, tmp_path):
    config = CompareConfig.quick(corpus=corpus, out_dir=str(tmp_path), sweep=(32, 64, 128), time_cap_s=1e-9,
                                 isolate=False)
    points = sweep_one(config, "dense", {"d_model": 16, "n_layers": 1, "n_heads": 2})
    assert [p["skipped"] for p in points] == [False, True, True]
    assert points[0]["over_cap"] == ["time"] and points[0]["fwd_bwd_s"] > 0
    assert points[1]["reason"] == "over a cap at n=32"


def test_parse_args():
    config = parse_compare_args(["--quick", "--tokens", "512", "--models", "sheaf", "dense", "--sweep", "256", "64",
                                 "--site", '{"local_window": 4}', "--in-process", "--out", "x"])
    assert config.tokens == 512 and config.models == ("sheaf", "dense") and config.sweep == (64, 256)
    assert config.site == {"local_window": 4} and not config.isolate and config.out_dir == "x"
    assert config.context == 64  # from the quick preset
    # a tuple field whose default is empty still parses to its annotated element type
    assert parse_compare_args(["--lr-sweep", "2e-3", "1e-3", "--jobs", "2"]).lr_sweep == (1e-3, 2e-3)
    default = parse_compare_args([])
    assert default.sweep == (1024, 2048, 4096, 8192, 16384, 32768) and default.isolate
    with pytest.raises(ValueError, match="models must be"):
        CompareConfig(models=("gpt",))
    with pytest.raises(ValueError, match="models must be"):
        main_compare(["--models", "gpt"])  # sheafgnn.cli.main reports it in one line (test_cli)


def test_run_compare_quick(corpus, tmp_path):
    config = CompareConfig.quick(corpus=corpus, out_dir=str(tmp_path), isolate=False, sweep=(32, 64), tokens=128,
                                 num_threads=1)
    report = run_compare(config)
    assert set(report["training"]) == set(DEFAULT_MODELS) and set(report["sweep"]) == set(DEFAULT_MODELS)
    assert DEFAULT_MODELS == ("sheaf", "dense_conv", "local_conv", "ssm")  # the conv baselines by default
    for kind, r in report["training"].items():
        assert r["tokens"] == config.tokens and r["val_bpb"] > 0 and r["train_tokens_per_s"] > 0, kind
        assert r["infer_tokens_per_s"] > 0 and r["train_peak_rss_bytes"] > 0
        assert r["train_windows_loss"] > 0 and r["validation_windows_loss"] > 0
        assert abs(r["params"] - report["params"]["target"]) <= 0.1 * report["params"]["target"]
        assert [p["n"] for p in report["sweep"][kind]] == [32, 64]
        assert r["by_distance"]["all"]["tokens"] == sum(r["by_distance"][b]["tokens"] for b in bucket_names())
    for name in ("compare.json", "compare.md", "training.png", "curves.png", "sweep.png"):
        assert (tmp_path / name).stat().st_size > 0
    saved = json.loads((tmp_path / "compare.json").read_text())
    assert saved["caps"] == {"time_cap_s": 30.0, "memory_cap_gb": 8.0}
    text = (tmp_path / "compare.md").read_text()
    assert "| sheaf |" in text and "Caps, the same for every model" in text and "VmHWM" in text
    assert "by the distance to the previous occurrence" in text and "## At equal tokens and at equal seconds" in text
    assert markdown(report).startswith("# sheafgnn compare")


def test_at_equal_seconds_reads_each_curve_at_the_first_finish():
    fast = {"curve": [{"tokens": 100, "elapsed_s": 10.0, "val_bpb": 3.0}, {"tokens": 200, "elapsed_s": 20.0,
                                                                          "val_bpb": 2.0}]}
    slow = {"curve": [{"tokens": 100, "elapsed_s": 15.0, "val_bpb": 2.8}, {"tokens": 200, "elapsed_s": 30.0,
                                                                          "val_bpb": 1.6}]}
    late = {"curve": [{"tokens": 200, "elapsed_s": 45.0, "val_bpb": 1.5}]}  # one validation, after the first finish
    seconds, at = at_equal_seconds({"fast": fast, "slow": slow, "late": late})
    assert seconds == 20.0
    assert at["fast"] == {"tokens": 200, "val_bpb": 2.0}  # the first to finish: its last validation
    assert at["slow"]["tokens"] == pytest.approx(100 + 100 / 3) and at["slow"]["val_bpb"] == pytest.approx(2.4)
    assert at["late"] is None


def test_lr_sweep_trains_each_model_at_its_best_lr(corpus, tmp_path):
    config = CompareConfig.quick(corpus=corpus, out_dir=str(tmp_path), isolate=False, sweep=(32,), tokens=256,
                                 models=("sheaf", "dense"), lr_sweep=(3e-2, 1e-4, 3e-3), sweep_tokens=128,
                                 eval_points=2, num_threads=1)
    report = run_compare(config)
    for kind, rows in report["lr_sweep"].items():
        rates = [row["lr"] for row in rows]  # the configured ones, and any beyond an edge where the best lay
        assert {1e-4, 3e-3, 3e-2} <= set(rates) and rates == sorted(rates) and len(rates) <= 3 + LR_WIDEN
        assert next_rate(rows, 3) is None and all(row["tokens"] == 128 for row in rows)
        assert report["training"][kind]["lr"] == min(rows, key=lambda row: row["val_bpb"])["lr"]
        curve = report["training"][kind]["curve"]  # two validations, the last one the final val_bpb
        assert [p["tokens"] for p in curve] == [128, 256]
        assert curve[-1]["val_bpb"] == pytest.approx(report["training"][kind]["val_bpb"], rel=1e-5)  # csv digits
    assert "## Learning-rate sweep" in (tmp_path / "compare.md").read_text()
    with pytest.raises(ValueError, match="lr_sweep"):
        CompareConfig(lr_sweep=(0.0,))


def test_next_rate_widens_at_an_edge_only():
    def rows(*pairs):
        return [{"lr": lr, "val_bpb": bpb} for lr, bpb in pairs]

    assert next_rate(rows((2e-3, 2.6), (4e-3, 2.5), (8e-3, 2.7)), 3) is None  # the best inside
    assert next_rate(rows((2e-3, 2.5), (4e-3, 2.6), (8e-3, 2.7)), 3) == 1e-3  # at the low edge: one step lower
    assert next_rate(rows((1e-3, 2.9), (3e-3, 2.7)), 2) == 9e-3  # at the high edge, the sweep's own step
    assert next_rate(rows((1e-3, 2.5), (2e-3, 2.5)), 2) is None  # a tie says nothing about a direction
    assert next_rate(rows((1e-3, 2.5)), 1) is None  # one rate: no step to take
    widened = rows(*[(lr, lr) for lr in (1e-4, 1e-3, 1e-2, 1e-1)])
    assert next_rate(widened, 4 - LR_WIDEN) is None and next_rate(widened, 4) == 1e-5  # LR_WIDEN added already


def test_lr_sweep_widens_until_the_best_lies_inside(monkeypatch):
    trained = []

    def fit(config, kind, options, lr, tokens, run):  # validation best at lr 2.5e-4, below the configured rates
        trained.append(lr)
        return None, {"tokens": tokens, "val_bpb": 3.0 + abs(math.log(lr / 2.5e-4)), "elapsed_s": 1.0}, None

    monkeypatch.setattr(compare, "_fit", fit)
    rows = lr_sweep_one(CompareConfig(lr_sweep=(1e-3, 2e-3, 4e-3), tokens=64), "dense", {})
    assert trained == [1e-3, 2e-3, 4e-3, 5e-4, 2.5e-4]  # widened twice (LR_WIDEN), lowest first
    assert [row["lr"] for row in rows] == [2.5e-4, 5e-4, 1e-3, 2e-3, 4e-3]
    assert min(rows, key=lambda row: row["val_bpb"])["lr"] == 2.5e-4 and next_rate(rows, 3) is None


def test_a_second_run_keeps_the_models_trained_with_the_same_settings(corpus, tmp_path):
    config = CompareConfig.quick(corpus=corpus, out_dir=str(tmp_path), isolate=False, sweep=(32,), tokens=128,
                                 models=("ssm",), num_threads=1)
    first = run_compare(config)
    assert first["reused"] == []
    more = run_compare(CompareConfig.quick(**{**config.to_dict(), "models": ("ssm", "dense"), "jobs": 1}))
    assert more["reused"] == ["ssm"] and list(more["training"]) == ["ssm", "dense"]
    assert more["training"]["ssm"] == json.loads(json.dumps(first["training"]["ssm"]))  # kept, not retrained
    assert set(more["sweep"]) == {"ssm", "dense"}  # the context sweep measures every model again
    assert "Kept from an earlier run of the same settings" in (tmp_path / "compare.md").read_text()
    options = {"ssm": first["training"]["ssm"]["options"]}
    other = CompareConfig.quick(**{**config.to_dict(), "seed": 1})
    assert kept_models(other, options) == {}  # another seed trains anew
    assert list(kept_models(config, options)) == ["ssm"]
    saved = json.loads((tmp_path / "compare.json").read_text())  # a run made when a default was other
    saved["training"]["ssm"]["model_config"]["num_topics"] += 1
    (tmp_path / "compare.json").write_text(json.dumps(saved))
    assert kept_models(config, options) == {}  # the same options, another model: trained anew
    (tmp_path / "compare.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="not a compare report"):
        kept_models(config, {})


@pytest.mark.slow
def test_models_train_at_once_in_their_own_processes(corpus, tmp_path):
    config = CompareConfig.quick(corpus=corpus, out_dir=str(tmp_path), sweep=(32,), tokens=128,
                                 models=("sheaf", "dense"), jobs=2, num_threads=1)
    report = run_compare(config)
    assert list(report["training"]) == ["sheaf", "dense"] and report["lr_sweep"] == {}
    for kind, r in report["training"].items():
        assert r["tokens"] == 128 and r["val_bpb"] > 0 and r["train_peak_rss_bytes"] > 0, kind
    assert "2 models training at once" in (tmp_path / "compare.md").read_text()
    with pytest.raises(ValueError, match="jobs > 1 needs isolate"):
        CompareConfig(jobs=2, isolate=False)
