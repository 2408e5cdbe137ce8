"""``mpnb.lab.stats``: quantiles, per-round ratios and their summary, the median's interval,
and ``torch_threads``, the one set of statistics the lab and the bench share."""

from __future__ import annotations

import math

import pytest
import torch

from mpnb.lab import stats
from mpnb.lab.stats import iqr, median, per_round_ratios, quantile, ratio_summary


def test_median_ci_is_deterministic_and_brackets_the_median():
    xs = [1.0, 1.1, 0.9, 1.05, 0.95, 1.2, 0.8]
    lo, hi = stats.median_ci(xs)
    assert (lo, hi) == stats.median_ci(xs) and lo <= stats.median(xs) <= hi
    assert stats.median_ci([2.0] * 10) == (2.0, 2.0)
    assert all(math.isnan(v) for v in stats.median_ci([1.0, 2.0]))


def test_torch_threads_restores_also_on_error():
    before = torch.get_num_threads()
    with pytest.raises(RuntimeError), stats.torch_threads(1):
        assert torch.get_num_threads() == 1
        raise RuntimeError("body failed")
    assert torch.get_num_threads() == before
    with pytest.raises(ValueError, match="positive int"), stats.torch_threads(0):
        pass


def test_bench_uses_the_lab_statistics():
    from mpnb.lab import bench
    from mpnb.lab.bench import _harness, _suite

    assert bench.median is stats.median and _harness.ratio_summary is stats.ratio_summary
    assert _suite.torch_threads is stats.torch_threads


def test_quantile_matches_numpy_linear():
    xs = [7.0, 1.0, 3.0, 5.0]
    assert quantile(xs, 0.0) == 1.0 and quantile(xs, 1.0) == 7.0
    assert quantile(xs, 0.25) == pytest.approx(2.5)
    assert quantile(xs, 0.75) == pytest.approx(5.5)
    assert median([3.0, 1.0, 2.0]) == 2.0
    assert median([4.0, 1.0, 2.0, 3.0]) == 2.5
    assert iqr([1.0, 2.0, 3.0, 4.0, 5.0]) == pytest.approx(2.0)
    assert math.isnan(median([]))


def test_median_of_ratios_is_not_ratio_of_medians():
    # Round 3 is slow for both sides (machine drift): per-round ratios ignore it.
    base = [2.0, 2.0, 20.0, 2.0, 2.0]
    cand = [1.0, 1.0, 10.0, 1.0, 1.0]
    assert per_round_ratios(base, cand) == [2.0, 2.0, 2.0, 2.0, 2.0]
    assert ratio_summary(base, cand) == (2.0, 0.0)
    # Drift that hits the two sides in different rounds: medians of each side mislead.
    base = [1.0, 3.0, 3.0, 1.0, 3.0]
    cand = [0.5, 1.5, 1.5, 2.0, 2.0]
    med, spread = ratio_summary(base, cand)
    assert med == 2.0 and median(base) / median(cand) == pytest.approx(2.0)
    assert spread == pytest.approx(2.0 - 1.5)


def test_ratio_rounds_must_pair():
    with pytest.raises(ValueError, match="pair up"):
        per_round_ratios([1.0, 2.0], [1.0])
