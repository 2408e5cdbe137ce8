"""One speed figure: the bar, its label, the table, the CLI table and the report agree.

The first test builds a comparison from step times where O2 is exactly twice as slow as O0
in every round (deterministic); the second runs a real round-robin comparison whose O2 model
sleeps twice as long per step, and checks only that every view shows the same figure.
"""

import math
import time

import pytest
import torch
from torch import nn

import mpnb.lab
from mpnb.lab import workloads
from mpnb.lab._rows import frames, speed_label
from mpnb.lab._train import RunResult
from mpnb.lab.cli import format_table
from mpnb.lab.config import expand
from mpnb.lab.html_report import figures, speed_bar
from mpnb.lab.machine import hardware_summary
from mpnb.lab.runner import load_record
from mpnb.lab.verdict import verdict


def _history(times_ms):
    return [
        dict(
            step=i,
            loss=1.0,
            loss_scale=1.0,
            step_time_ms=t,
            skipped=False,
            skip_reason="",
            phase="warmup" if i == 0 else "memory" if i == 1 else "timed",
            samples=16,
        )
        for i, t in enumerate(times_ms)
    ]


def _synthetic(o2_factor=2.0, noise=0.0):
    w = workloads.get("mlp", "small")
    cfgs = expand("mlp", ("O0", "O2"), "bf16", (16,), steps=40, device="cpu")
    base = [10.0 + (i % 7) for i in range(40)]  # a drifting machine: rounds differ
    o2 = [t * o2_factor * (1 + noise * ((-1) ** i)) for i, t in enumerate(base)]
    row = dict(peak_mem_mib=10.0, metric=0.9, flops_per_step=1e9, ops_per_step=100.0)
    mem = {f"mem_{r}_mib": 2.0 for r in ("params", "grads", "optimizer_state", "activations")}
    results = [
        RunResult(cfgs[0], row=dict(row, **mem), history=_history(base)),
        RunResult(cfgs[1], row=dict(row, peak_mem_mib=8.0, **mem), history=_history(o2)),
    ]
    for r in results:
        ms = [h["step_time_ms"] for h in r.history if h["phase"] == "timed"]
        r.row["step_time_ms"] = sorted(ms)[len(ms) // 2]
    hw = hardware_summary("cpu")
    df = frames(results, w, hw)
    df.attrs["load"] = load_record([0.1], [1.0], 1, 2)
    df.attrs["verdict"] = verdict(df)
    return df


def test_twice_as_slow_reads_the_same_everywhere(tmp_path):
    pytest.importorskip("ipywidgets")
    from mpnb.widgets._compare_views import ResultViews, table_html

    df = _synthetic(2.0)
    o2 = df.set_index("opt_level").loc["O2"]
    assert o2.speedup_vs_O0 == pytest.approx(0.5) and o2.rounds == 38
    assert o2.speedup_lo == pytest.approx(0.5) and o2.speedup_hi == pytest.approx(0.5)
    assert o2.speed_label == "2.00x slower than O0"
    # the bar (report and widget), its label, the two tables and the report page
    bar = figures(df)["speed"].data[0]
    assert list(bar.y) == pytest.approx([1.0, 0.5]) and list(bar.text)[1] == o2.speed_label
    views = ResultViews()
    views.update(df)
    wbar = views.speed.data[0]
    assert list(wbar.y) == list(bar.y) and list(wbar.text) == list(bar.text)
    assert o2.speed_label in table_html(df) and "0.50" in table_html(df)
    assert o2.speed_label in format_table(df)
    page = mpnb.lab.report(df, tmp_path / "r.html").read_text()
    assert o2.speed_label in page
    assert "faster" not in df.attrs["verdict"]["recommendation"]


def test_interval_across_one_says_no_measurable_difference():
    df = _synthetic(1.0, noise=0.2)
    o2 = df.set_index("opt_level").loc["O2"]
    assert o2.speedup_lo < 1.0 < o2.speedup_hi
    assert o2.speed_label == "no measurable difference"
    assert speed_bar(df)["text"][1] == "no measurable difference"
    assert speed_label(1.5, 1.4, 1.6) == "1.50x faster than O0"
    assert speed_label(float("nan"), math.nan, math.nan) == "no speed figure"


class _Sleepy(nn.Module):
    """Sleeps 2 ms per forward in fp32 and 4 ms in half precision (O2 casts its weights)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 2)

    def forward(self, x):
        time.sleep(0.004 if self.lin.weight.dtype != torch.float32 else 0.002)
        return self.lin(x)


def test_real_round_robin_run_shows_one_figure_in_every_view(tmp_path):
    pytest.importorskip("ipywidgets")
    from mpnb.widgets._compare_views import ResultViews

    x = torch.randn(64, 8)
    df = mpnb.lab.compare(
        _Sleepy,
        (x, (x[:, 0] > 0).long()),
        opt_levels=("O0", "O2"),
        steps=12,
        progress=False,
        threads=1,
    )
    assert (df.status == "ok").all(), df.error.tolist()
    views = ResultViews()
    views.update(df)
    assert list(views.speed.data[0].y) == pytest.approx(list(df.speedup_vs_O0))
    assert list(views.speed.data[0].text) == list(df.speed_label)
    page = mpnb.lab.report(df, tmp_path / "r.html").read_text()
    for label in df.speed_label:
        assert label in page and label in format_table(df)
    hist = df.attrs["history"]
    o0 = hist[hist.configuration == df.configuration[0]].set_index("step")
    o2 = hist[hist.configuration == df.configuration[1]].set_index("step")
    timed = o0.index[o0.phase == "timed"]
    ratios = sorted((o0.step_time_ms[timed] / o2.step_time_ms[timed]).tolist())
    assert df.speedup_vs_O0[1] == pytest.approx(
        ratios[len(ratios) // 2] if len(ratios) % 2 else sum(ratios[len(ratios) // 2 - 1 :][:2]) / 2
    )
