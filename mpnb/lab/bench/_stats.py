"""The statistics of a round-robin benchmark: pure functions on numbers (the tests pin them)."""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["quantile", "median", "iqr", "per_round_ratios", "ratio_summary"]


def quantile(xs: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``xs`` with linear interpolation (numpy's default method)."""
    if not xs:
        return math.nan
    s = sorted(xs)
    pos = (len(s) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def median(xs: Sequence[float]) -> float:
    """The median of ``xs`` (nan when empty)."""
    return quantile(xs, 0.5)


def iqr(xs: Sequence[float]) -> float:
    """The inter-quartile range ``q75 - q25`` of ``xs``."""
    return quantile(xs, 0.75) - quantile(xs, 0.25)


def per_round_ratios(num: Sequence[float], den: Sequence[float]) -> list[float]:
    """``num[i] / den[i]`` for each round ``i`` (the rounds must pair up)."""
    if len(num) != len(den):
        raise ValueError(f"rounds do not pair up: {len(num)} vs {len(den)} times.")
    return [a / b for a, b in zip(num, den, strict=True)]


def ratio_summary(num: Sequence[float], den: Sequence[float]) -> tuple[float, float]:
    """``(median, IQR)`` of the per-round ratios ``num / den``: the comparison we report."""
    r = per_round_ratios(num, den)
    return median(r), iqr(r)
