"""mpnb's best row against torch.amp's, measured the way every speed figure is.

The peers (:attr:`~mpnb.core.precision_configs.PrecisionConfig.peer`) train in the same
round-robin as mpnb's configurations, so two rows' step times pair up round by round; the
ratio of mpnb's fastest row to the verdict's reference peer (eager ``torch-amp``,
:attr:`~mpnb.core.precision_configs.PrecisionConfig.verdict_reference`) is the median of those
per-round ratios with a 95% bootstrap interval (:func:`mpnb.lab._rows.relative_speed`), never a
quotient of two medians.
"""

from __future__ import annotations

import math

import pandas as pd

from mpnb.core.precision_configs import BASELINE, get_config
from mpnb.lab._rows import relative_speed

__all__ = ["versus_reference"]


def _pick(rows: pd.DataFrame, **same) -> pd.Series | None:
    """The fastest of ``rows`` (by the speed figure), preferring those whose columns equal
    ``same``; None when none has a figure."""
    rows = rows[rows["speedup_vs_O0"].notna()]
    for k, v in same.items():
        if (rows[k] == v).any():
            rows = rows[rows[k] == v]
    return rows.loc[rows["speedup_vs_O0"].idxmax()] if len(rows) else None


def versus_reference(df: pd.DataFrame, ok: pd.DataFrame) -> dict | None:
    """mpnb's fastest row against the peer the verdict holds it to (eager torch.amp, the
    configuration's ``verdict_reference``), same batch size (and half dtype where both ran it).

    Args:
        df: a :func:`mpnb.lab.compare` frame (its ``attrs["history"]``).
        ok: its rows the verdict reads (:func:`mpnb.lab.verdict.measured_rows`).

    The ratio comes from the two rows' per-round step times in ``df.attrs["history"]``
    (:func:`mpnb.lab._rows.relative_speed`), not from their medians: > 1 means mpnb's row was
    faster. ``text`` says "no measurable difference" when the 95% interval holds 1.

    Returns:
        ``dict(text=, mpnb=, reference=, ratio=, lo=, hi=, rounds=)``, or None when the frame
        lacks either row (or the history).

    Example::

        >>> versus_reference(df, measured_rows(df))["text"]
        "mpnb's best, O2 bf16 b16, runs at 1.02x torch-amp bf16 b16's speed ..."
    """
    hist = df.attrs.get("history")
    if hist is None or not len(ok) or "speedup_vs_O0" not in ok:
        return None
    cfgs = ok["opt_level"].map(get_config)
    peer = cfgs.map(lambda c: c.peer).astype(bool)
    ref_rows = ok[cfgs.map(lambda c: c.verdict_reference).astype(bool)]
    best = _pick(ok[~peer & (ok["opt_level"] != BASELINE)])
    if best is None or not len(ref_rows):
        return None
    same = dict(batch_size=best["batch_size"], half_dtype=best["half_dtype"])
    ref = _pick(ref_rows[ref_rows["batch_size"] == best["batch_size"]], **same)
    if ref is None:
        return None
    mine, theirs = str(best["configuration"]), str(ref["configuration"])
    speed = relative_speed(hist, mine, theirs)
    r, lo, hi = speed["ratio"], speed["lo"], speed["hi"]
    if not math.isfinite(r):
        text = (
            f"mpnb's best, {mine}, against {theirs}: too few rounds timed together for a ratio "
            f"({speed['rounds']}); run more steps."
        )
    elif lo <= 1.0 <= hi:
        text = (
            f"mpnb's best, {mine}, and {theirs}: no measurable difference on this model and "
            f"device ({r:.2f}x its speed, interval {lo:.2f}-{hi:.2f})."
        )
    else:
        text = (
            f"mpnb's best, {mine}, runs at {r:.2f}x {theirs}'s speed on this model and device "
            f"(interval {lo:.2f}-{hi:.2f}): {'faster' if r > 1 else 'slower'} than torch.amp."
        )
    return dict(text=text, mpnb=mine, reference=theirs, **speed)
