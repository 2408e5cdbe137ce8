"""Unit tests of the compare widget's control table: every row of ``CONTROLS`` becomes its
widget, in its column, with its message box and its validation; ``request_of`` reads the
widget's arguments into what the controls start from."""

from __future__ import annotations

from dataclasses import fields

import pytest

pytest.importorskip("ipywidgets")

import ipywidgets as w  # noqa: E402

from mpnb.core.amp import LossScaleRule  # noqa: E402
from mpnb.core.precision_configs import distributed_names  # noqa: E402
from mpnb.widgets import CompareWidget  # noqa: E402
from mpnb.widgets._compare_controls import (  # noqa: E402
    CONTROLS,
    LEVELS,
    Control,
    Request,
    request_of,
)


def _request(**kw):
    args = dict(
        workload="mlp",
        configs=("O0",),
        half_dtype="auto",
        batch_sizes=(16, 32),
        steps=4,
        optimizer="sgd",
        device="cpu",
        loss_scale=None,
        threads=1,
        size="small",
    )
    return request_of(**(args | kw))


@pytest.fixture(scope="module")
def cw():
    return CompareWidget("mlp", configs=("O0", "O2"), steps=4, threads=1, threaded=False)


def test_the_table_names_each_control_once_and_every_field_it_reads_exists():
    names = [c.name for c in CONTROLS]
    assert len(names) == len(set(names))
    request_fields = {f.name for f in fields(Request)}
    for c in CONTROLS:
        assert c.column in (0, 1, 2), c.name
        if c.value:
            assert c.name in request_fields, c.name  # its value starts as the request's field
        if isinstance(c.options, str):
            assert c.options in request_fields, c.name


def test_every_row_is_its_widget_with_its_description(cw):
    for c in CONTROLS:
        widget = getattr(cw, c.name)
        assert type(widget) is c.kind and widget.description == c.description, c.name
        if c.tooltip:
            assert widget.tooltip == c.tooltip


def test_the_columns_hold_the_rows_in_table_order_each_refusing_one_over_its_box(cw):
    columns = cw.controls.children[0].children
    assert len(columns) == 3
    for i, column in enumerate(columns):
        rows = [c for c in CONTROLS if c.column == i]
        assert len(column.children) == len(rows)
        for c, item in zip(rows, column.children, strict=True):
            if c.refuses:
                assert isinstance(item, w.VBox)
                assert item.children == (getattr(cw, c.name), cw.control_errors[c.name])
            else:
                assert item is getattr(cw, c.name), c.name
    assert set(cw.control_errors) == {c.name for c in CONTROLS if c.refuses}


def _another(widget):
    """A valid value of ``widget`` other than its own."""
    if isinstance(widget, w.SelectMultiple):
        return tuple(o for o in widget.options if o not in widget.value)[:1] or widget.options[:1]
    if isinstance(widget, (w.Dropdown, w.ToggleButtons)):
        values = [o[1] if isinstance(o, tuple) else o for o in widget.options]
        return next(v for v in values if v != widget.value)
    if isinstance(widget, w.Text):
        return "8"
    if isinstance(widget, w.FloatLogSlider):
        return widget.value * 2
    return widget.value + 1  # IntText, FloatText


@pytest.mark.parametrize("row", [c for c in CONTROLS if c.validates], ids=lambda c: c.name)
def test_a_change_of_a_validating_control_validates(row, monkeypatch):
    cw = CompareWidget("mlp", steps=4, threads=1, threaded=False, ranks=2)
    calls = []
    monkeypatch.setattr(cw, "validate", lambda: calls.append(1))
    widget = getattr(cw, row.name)
    widget.value = _another(widget)
    assert calls, row.name


@pytest.mark.parametrize("name", ["optimizer", "init_scale", "static_scale"])
def test_a_control_that_refuses_nothing_does_not_validate(name, monkeypatch):
    cw = CompareWidget("mlp", steps=4, threads=1, threaded=False)
    calls = []
    monkeypatch.setattr(cw, "validate", lambda: calls.append(1))
    widget = getattr(cw, name)
    widget.value = _another(widget)
    assert not calls


def test_a_row_builds_its_widget_from_the_request():
    r = _request(threads=3)
    built = Control("threads", w.IntText, "threads", 1, tooltip="tip").build(r)
    assert isinstance(built, w.IntText) and built.value == 3 and built.tooltip == "tip"
    by_field = Control("device", w.Dropdown, "device", 0, "devices").build(r)
    assert by_field.options == tuple(r.devices) and by_field.value == "cpu"
    levels = Control("opt_levels", w.SelectMultiple, "opt levels", 0, LEVELS, dict(rows=5))
    built = levels.build(r)
    assert built.options == tuple(LEVELS) and built.value == ("O0",) and built.rows == 5
    unset = Control("half_dtype", w.ToggleButtons, "half dtype", 0, value=False).build(r)
    assert unset.value is None and unset.description == "half dtype"


def test_the_request_reads_the_arguments_as_the_controls_show_them():
    r = _request()
    assert r.workloads[0] == "mlp" and len(r.workloads) == len(set(r.workloads))
    assert r.batch_sizes == "16, 32" and r.steps == 4 and r.threads == 1
    assert (r.ranks, r.strategy) == (1, "both")
    assert r.offered == r.policies == distributed_names(None)
    blank = _request(batch_sizes=None, steps=None, threads=None, ranks=None)
    assert (blank.batch_sizes, blank.steps, blank.threads, blank.ranks) == ("", 0, 0, 1)


@pytest.mark.parametrize(
    "loss_scale, mode, static",
    [
        (None, "default", 2.0**10),
        (128.0, "static", 128.0),
        (dict(init_scale=4.0), "dynamic", 2.0**10),
    ],
)
def test_the_loss_scale_argument_picks_the_mode_and_fills_its_fields(loss_scale, mode, static):
    r = _request(loss_scale=loss_scale)
    assert r.scale_mode == mode and r.static_scale == static
    rule = LossScaleRule.parse(loss_scale, owner="test") if mode == "dynamic" else LossScaleRule()
    assert (r.init_scale, r.growth_factor, r.backoff_factor, r.growth_interval) == (
        rule.init_scale,
        rule.growth_factor,
        rule.backoff_factor,
        rule.growth_interval,
    )


def test_a_strategy_limits_the_policies_and_a_wrong_one_is_refused():
    r = _request(ranks=2, strategy="ddp")
    assert r.offered == distributed_names("ddp") and r.policies == r.offered
    assert _request(ranks=2, strategy="ddp", policies=["ddp-fp32"]).policies == ("ddp-fp32",)
    with pytest.raises(ValueError, match="strategy 'zero'"):
        _request(strategy="zero")
    with pytest.raises(ValueError, match="not 'ddp' policies"):
        _request(ranks=2, strategy="ddp", policies=["fsdp2-fp32"])
    with pytest.raises(ValueError, match="loss_scale"):
        _request(loss_scale=dict(init=1.0))
