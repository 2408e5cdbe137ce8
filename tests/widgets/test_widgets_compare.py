"""Headless tests of CompareWidget: set the controls, click, assert on the DataFrame and figures."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("ipywidgets")
pytest.importorskip("plotly")

from mpnb.lab import workloads  # noqa: E402
from mpnb.widgets import CompareWidget, compare  # noqa: E402


def _tiny():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=g)
    y = (x[:, 0] > 0).long()
    return workloads.custom(
        lambda: torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2)
        ),
        (x, y),
        torch.nn.functional.cross_entropy,
        metric_fn=workloads.accuracy,
        metric_name="accuracy",
        lr=1e-2,
        batch_size=16,
        steps=6,
        name="tiny",
    )


@pytest.fixture(scope="module")
def finished():
    """One synchronous run, shared: O0 and O2 with a dynamic scaler set from the controls."""
    cw = CompareWidget(_tiny(), opt_levels=("O0",), steps=5, threaded=False, threads=1)
    cw.opt_levels.value = ("O0", "O2")
    cw.batch_sizes.value = "16"
    cw.scale_mode.value = "dynamic"
    cw.init_scale.value = 2.0**10
    cw.growth_interval.value = 1000
    cw.run_button.click()
    return cw


def test_run_fills_the_dataframe(finished):
    cw = finished
    assert cw.errors.last_error is None, cw.errors.last_error
    df = cw.df
    assert list(df["configuration"]) == ["O0 fp32 b16", "O2 bf16 b16"]
    assert (df["error"] == "").all() and (df["step_time_ms"] > 0).all()
    assert df.loc[1, "final_loss_scale"] == 2.0**10  # the widget's scaler settings were used
    hist = df.attrs["history"]
    assert set(hist["configuration"]) == set(df["configuration"])
    assert len(hist) == 2 * 5 and df.attrs["hardware"]["threads"] == 1  # the threads control
    assert cw.progress.value == cw.progress.max == 2 and cw.status.value.startswith("done")
    assert not cw.run_button.disabled and cw.stop_button.disabled


def test_figures_show_every_configuration(finished):
    cw, df, v = finished, finished.df, finished.views
    names = list(df["configuration"])
    assert list(v.speed.data[0].x) == names
    assert list(v.speed.data[0].y) == pytest.approx(list(df["step_time_ms"]))
    for tr in v.memory.data:  # stacked bars: one trace per role
        role = tr.name.replace(" ", "_")
        assert list(tr.y) == pytest.approx(list(df[f"mem_{role}_mib"].fillna(0.0)))
    assert list(v.accuracy.data[0].y) == pytest.approx(list(df["metric"]))
    curves = {tr.name: tr for tr in v.loss_curves.data}
    assert set(curves) == set(names) and list(curves[names[1]].x) == [0, 1, 2, 3, 4]
    scale = {tr.name: tr for tr in v.loss_scale.data}
    assert list(scale[names[1]].y) == [2.0**10] * 5
    for name in names:
        assert name in cw.table.value
    assert "bfloat16" in cw.hardware.value and "Measured on" in cw.hardware.value


def test_export_csv_and_html(finished, tmp_path):
    import pandas as pd

    finished.export_path.value = str(tmp_path / "out")
    finished.csv_button.click()
    finished.html_button.click()
    assert finished.errors.last_error is None, finished.errors.last_error
    back = pd.read_csv(tmp_path / "out.csv")
    assert list(back["configuration"]) == list(finished.df["configuration"])
    page = (tmp_path / "out.html").read_text()
    assert all(name in page for name in finished.df["configuration"])


def test_failing_configuration_is_shown_and_others_kept():
    cw = compare(
        _tiny(),
        opt_levels=("O0", "O3"),
        half_dtype="fp16",
        steps=4,
        threaded=False,
        loss_scale=2.0**24,
    )
    assert cw.half_dtype.value == "fp16" and "emulated" in cw.half_dtype.options[1][0]
    cw.run_button.click()
    df = cw.df
    assert df.loc[0, "error"] == "" and "NaN divergence" in df.loc[1, "error"]
    assert "O3 fp16 b32" in cw.config_errors.value and "failed" in cw.config_errors.value
    assert list(cw.views.speed.data[0].x) == ["O0 fp32 b32"]  # the failed row is not drawn


def test_threaded_run_disables_run_and_stop_ends_it():
    cw = compare(_tiny(), opt_levels=("O0", "O1", "O2", "O3"), steps=4)
    first = []

    def stop_after_first(change):
        if cw.df is not None and not first:
            first.append(len(cw.df))
            cw.stop_button.click()

    cw.observe(stop_after_first, names=["version"])
    cw.run_button.click()
    assert cw.run_button.disabled and not cw.stop_button.disabled
    assert cw.join(timeout=300), "the run did not finish in 300 s"
    assert first == [1] and len(cw.df) == 1
    assert cw.status.value.startswith("stopped after 1 of 4")
    assert not cw.run_button.disabled and cw.stop_button.disabled


def test_bad_controls_are_reported_in_the_widget():
    cw = compare(_tiny(), steps=4)
    cw.batch_sizes.value = "16, zero"
    cw.run_button.click()
    assert "batch sizes" in cw.errors.last_error and not cw.running
    cw.csv_button.click()  # nothing to export yet
    assert "press Run first" in cw.errors.last_error
