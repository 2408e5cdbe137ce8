"""``compare``'s rounds (``mpnb.lab.runner``): step k of every configuration before step k+1,
Stop and ``on_progress``, the load record around the rounds, and the emulation note before."""

from __future__ import annotations

import time

import torch
from torch import nn

import mpnb.lab
from mpnb.core.hardware import half_support
from mpnb.lab import workloads
from mpnb.lab.machine import fp8_support
from mpnb.lab.runner import emulation_note, load_record


def test_load_record_flags_competition():
    assert not load_record([0.1, 0.1, 0.1], [1.0, 0.5, 0.2], 1, 2)["competed"]
    busy = load_record([2.5, 2.0, 1.0], [3.4, 2.5, 1.2], 1, 2)
    assert busy["competed"] and "other processes competed" in busy["note"]


def _tiny():
    x = torch.randn(128, 8, generator=torch.Generator().manual_seed(0))
    return workloads.custom(
        lambda: torch.nn.Linear(8, 2),
        (x, (x[:, 0] > 0).long()),
        metric_fn=workloads.accuracy,
        batch_size=16,
        steps=10,
    )


def test_should_stop_keeps_measured_rows_and_progress_has_an_eta():
    events = []

    def on_progress(p):
        events.append(p)

    df = mpnb.lab.compare(
        _tiny(),
        opt_levels=("O0", "O2"),
        steps=10,
        progress=False,
        threads=1,
        on_progress=on_progress,
        should_stop=lambda: len(events) >= 13,
    )
    assert len(events) == 13 and df.attrs["stopped"]
    assert set(events[-1]) >= {"configuration", "step", "steps", "eta_s", "done", "total"}
    assert events[-1]["total"] == 20 and events[-1]["eta_s"] >= 0
    assert (df.status == "interrupted").all() and df.metric.isna().all()
    assert df.timed_steps.gt(0).all() and df.peak_mem_mib.notna().all()
    assert df.warnings.str.contains("interrupted at step 6 of 10|interrupted at step 7 of 10").all()


def test_emulation_note_names_fp8_on_a_cpu():
    w = mpnb.lab.workloads.get("mlp", "small")
    note = emulation_note(w, "auto", "cpu", ("O0", "fp8-delayed"))
    assert fp8_support("cpu") == "emulated" and "fp8" in note and "emulated" in note
    assert "bf16" not in note.split(" is emulated")[0]  # O0 + FP8 run no bf16
    pure = emulation_note(w, "auto", "cpu", ("O0", "bf16-pure"))
    if half_support("cpu")["bfloat16"] == "emulated":  # native on CPUs with avx512_bf16 or AMX
        assert "bf16" in pure
    else:
        assert "bf16" not in pure


class _Sleepy(nn.Module):
    """Sleeps 2 ms per forward in fp32 and 4 ms in half precision (O2 casts its weights)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 2)

    def forward(self, x):
        time.sleep(0.004 if self.lin.weight.dtype != torch.float32 else 0.002)
        return self.lin(x)


def test_configurations_run_round_robin_step_k_of_each_before_step_k_plus_1():
    x = torch.randn(64, 8)
    order = []
    seen = lambda p: order.append((p["step"], p["configuration"]))  # noqa: E731
    df = mpnb.lab.compare(
        _Sleepy,
        (x, (x[:, 0] > 0).long()),
        opt_levels=("O0", "O1", "O2"),
        steps=6,
        progress=False,
        threads=1,
        on_progress=seen,
    )
    assert (df.status == "ok").all(), df.error.tolist()
    steps = [s for s, _ in order]
    assert steps == sorted(steps) and len(order) == 3 * 6  # no configuration runs ahead
    for k in range(1, 7):
        assert sorted(c for s, c in order if s == k) == sorted(df.configuration)
    firsts = [next(c for s, c in order if s == k) for k in (1, 2, 3)]
    assert len(set(firsts)) == 3  # who goes first rotates from round to round
