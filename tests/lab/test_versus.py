"""``mpnb.lab._versus``: the verdict's mpnb-vs-torch.amp sentence, read from paired rounds."""

from __future__ import annotations

import pandas as pd
import pytest

from mpnb.lab._versus import versus_reference


def _frame(t_mine, t_ref):
    """Two rows and O0 with the given per-round step times (timed phase)."""
    hist = [
        dict(configuration=c, step=k, step_time_ms=t, phase="timed")
        for c, ts in (("O0 fp32 b8", [10.0] * len(t_mine)), ("O2 bf16 b8", t_mine))
        for k, t in enumerate(ts)
    ] + [
        dict(configuration="torch-amp bf16 b8", step=k, step_time_ms=t, phase="timed")
        for k, t in enumerate(t_ref)
    ]
    rows = pd.DataFrame(
        dict(
            configuration=["O0 fp32 b8", "O2 bf16 b8", "torch-amp bf16 b8"],
            opt_level=["O0", "O2", "torch-amp"],
            half_dtype=["fp32", "bf16", "bf16"],
            batch_size=[8, 8, 8],
            speedup_vs_O0=[1.0, 1.2, 1.1],
        )
    )
    rows.attrs["history"] = pd.DataFrame(hist)
    return rows


def test_the_verdict_sentence_reads_the_paired_rounds():
    # the rounds drift together (a shared machine): the per-round ratio is 1.25 every round,
    # though the medians of the two rows alone would say 1.0
    drift = [8.0, 8.0, 8.0, 16.0, 16.0, 16.0, 16.0]
    faster = _frame(drift, [t * 1.25 for t in drift])
    v = versus_reference(faster, faster)
    assert v["ratio"] == pytest.approx(1.25) and v["lo"] == pytest.approx(1.25)
    assert v["text"] == (
        "mpnb's best, O2 bf16 b8, runs at 1.25x torch-amp bf16 b8's speed on this model and "
        "device (interval 1.25-1.25): faster than torch.amp."
    )
    same = _frame([10.0, 11.0, 9.0, 10.0, 10.5, 9.5], [10.0, 10.0, 10.0, 10.0, 10.0, 10.0])
    v = versus_reference(same, same)
    assert v["lo"] <= 1.0 <= v["hi"] and "no measurable difference" in v["text"]
    few = _frame([10.0, 10.0], [10.0, 10.0])
    assert "too few rounds" in versus_reference(few, few)["text"]
    alone = _frame([10.0] * 4, [10.0] * 4).iloc[:2]
    assert versus_reference(alone, alone) is None  # no torch-amp row: no sentence
