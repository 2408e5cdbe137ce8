"""The statistics of round-robin timing, shared by ``mpnb compare`` and ``mpnb bench``.

Pure functions on numbers (the tests pin them), plus the two pieces of run context both
measurements record: :func:`torch_threads` (the thread count for a run, restored after) and
:func:`loadavg` (how busy the shared machine was). Nothing here imports torch at module level,
so ``mpnb bench --list`` stays fast.

Example::

    >>> ratio_summary([2.0, 2.2, 1.9], [1.0, 1.0, 1.0])
    (2.0, 0.15000000000000002)
    >>> median_ci([0.9, 1.1, 1.0, 1.05, 0.95])[0] <= 1.0
    True
"""

from __future__ import annotations

import contextlib
import math
import os
import random
from collections.abc import Iterator, Sequence

__all__ = [
    "quantile",
    "median",
    "iqr",
    "per_round_ratios",
    "ratio_summary",
    "median_ci",
    "torch_threads",
    "loadavg",
]


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


def median_ci(
    xs: Sequence[float], level: float = 0.95, resamples: int = 2000, seed: int = 0
) -> tuple[float, float]:
    """A percentile-bootstrap confidence interval ``(lo, hi)`` for the median of ``xs``.

    Deterministic (seeded), so the same measurements always give the same interval. With
    fewer than 3 values there is no interval: ``(nan, nan)``.

    Args:
        xs: the samples (for example the per-round ratios of a comparison).
        level: the coverage, 0.95 for a 95% interval.
        resamples: bootstrap resamples.
        seed: the resampling seed.

    Example::

        >>> lo, hi = median_ci([1.9, 2.0, 2.1, 2.0, 1.95, 2.05])
        >>> lo <= 2.0 <= hi
        True
    """
    n = len(xs)
    if n < 3:
        return math.nan, math.nan
    rng = random.Random(seed)
    s = list(xs)
    meds = sorted(median(rng.choices(s, k=n)) for _ in range(resamples))
    alpha = (1.0 - level) / 2
    return quantile(meds, alpha), quantile(meds, 1.0 - alpha)


@contextlib.contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """Run the body with ``torch.set_num_threads(n)``; the previous count is restored after.

    ``None`` leaves the count as it is. Restored also when the body raises.

    Args:
        n: a positive thread count, or None.

    Example::

        >>> with torch_threads(1):
        ...     torch.get_num_threads()
        1
    """
    # this module imports no torch at module level (see its docstring)
    import torch

    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
        raise ValueError(f"threads={n!r}: need a positive int, or None to keep torch's count.")
    before = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def loadavg() -> list[float] | None:
    """The 1/5/15-minute load averages (how busy the shared machine is), or None."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):  # not on Windows
        return None
