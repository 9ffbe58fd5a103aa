"""bench_train_memory's summary of a run: its peak, the rise after the warm-up and the trend of the step peaks
(no training: the records are made up); and where its training loop trims the heap (a few steps of short windows)."""

import pytest

from .conftest import load_benchmark

MIB = 1 << 20


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("bench_train_memory")


def records(peaks_mib, rss_mib, every=100):
    return [{"step": every * (i + 1), "rss_bytes": rss * MIB, "interval_peak_rss_bytes": None if peak is None
             else peak * MIB} for i, (peak, rss) in enumerate(zip(peaks_mib, rss_mib))]


def test_a_steady_rise_is_a_slope_and_scatter_is_not(bench):
    rising = bench.after_warmup(records([900, 905, 910, 915, 920], [800] * 5), warmup=100)
    assert rising["interval_peak_slope_bytes_per_1000_steps"] == pytest.approx(50 * MIB)
    assert rising["peak_rss_bytes"] == 920 * MIB  # the step peaks, above every record between steps
    scattered = bench.after_warmup(records([900, 960, 900, 960, 900], [800] * 5), warmup=100)
    assert scattered["interval_peak_slope_bytes_per_1000_steps"] == pytest.approx(0)
    assert scattered["rss_rise_after_warmup"] == 0  # the records between steps stay flat


def test_without_interval_peaks_the_records_give_the_peak(bench):
    result = bench.after_warmup(records([None, None, None], [800, 850, 840]), warmup=200)
    assert result["peak_rss_bytes"] == 850 * MIB and result["interval_peak_slope_bytes_per_1000_steps"] is None
    assert result["warmup_step"] == 200 and result["rss_rise_after_warmup_bytes"] == 0
    late = bench.after_warmup(records([900, 910], [800, 810]), warmup=300)
    assert late["warmup_step"] is None and late["interval_peak_slope_bytes_per_1000_steps"] is None


def test_the_heap_is_trimmed_every_trim_every_steps_before_the_record(bench, monkeypatch):
    trimmed_at = []
    steps_done = []
    monkeypatch.setattr(bench, "train_step", lambda *args, **kwargs: steps_done.append(len(steps_done) + 1))
    monkeypatch.setattr(bench, "release_free_memory", lambda: trimmed_at.append(len(steps_done)))
    run = bench.train_here("dense", steps=6, every=3, context=32, batch_size=1, trim_every=2)
    assert trimmed_at == [2, 4, 6]
    assert [r["step"] for r in run["rows"]] == [3, 6]
    bench.train_here("dense", steps=2, every=1, context=32, batch_size=1)
    assert trimmed_at == [2, 4, 6]  # trim_every 0: never
