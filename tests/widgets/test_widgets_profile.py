"""Headless tests of mpnb.widgets.profile: the figures and panes show what mpnb.lab measured."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("ipywidgets")
pytest.importorskip("plotly")

import mpnb.widgets  # noqa: E402


class Scale(torch.nn.Module):
    """Multiplies by a constant: past fp16's 65504 for ordinary activations."""

    def __init__(self, factor: float):
        super().__init__()
        self.factor = factor

    def forward(self, x):
        return x * self.factor


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.ReLU(), Scale(1e5), torch.nn.Linear(32, 4)
    )


@pytest.fixture(scope="module")
def pw():
    return mpnb.widgets.profile(
        _model(), torch.randn(8, 16), opt_levels=("O0", "O3"), half_dtype="fp16", steps=2, threads=1
    )


def test_phases_and_flops_figures_hold_the_lab_numbers(pw):
    res = pw.result
    assert set(res.phases["opt_level"]) == {"O0", "O3"}
    for tr in pw.phases_fig.data:  # one stacked trace per phase
        got = res.phases[res.phases["phase"] == tr.name]
        assert list(tr.x) == list(got["opt_level"])
        assert list(tr.y) == pytest.approx(list(got["time_ms"]))
    assert list(pw.flops_fig.data[0].y) == pytest.approx(list(res.flops["flop_per_s"] / 1e9))
    assert (res.flops["flops"] > 0).all()


def test_memory_breakdown_and_its_failed_level(pw):
    mem = pw.memory.set_index("opt_level")
    params = pw.memory_fig.data[0]
    assert params.name == "params" and list(params.x) == ["O0"]  # O3 diverged in fp16
    assert params.y[0] == pytest.approx(mem.loc["O0", "mem_params_mib"]) and params.y[0] > 0
    assert "memory (O3 fp16" in pw.failures.value and "NaN" in pw.failures.value


def test_overflow_tracer_names_the_layer(pw):
    assert pw.trace.module == "2"
    pane = pw.tabs.children[5].children[0].value
    assert "module <b>2</b>" in pane and "fp16" in pane


def test_threads_are_restored(pw):
    import torch as _t

    before = _t.get_num_threads()
    mpnb.widgets.profile(
        _model(),
        torch.randn(8, 16),
        opt_levels=("O0",),
        steps=2,
        memory=False,
        trace=False,
        threads=1 if before != 1 else 2,
    )
    assert _t.get_num_threads() == before


def test_failures_are_shown_not_raised():
    pw = mpnb.widgets.profile(
        _model(), (torch.randn(8, 16),), opt_levels=("O0",), steps=2, trace=False
    )
    assert "memory" in pw.failures.value and "single input tensor" in pw.failures.value
    assert "not run" in pw.tabs.children[5].value
