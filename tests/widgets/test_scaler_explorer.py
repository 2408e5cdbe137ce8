"""Headless tests of ScalerExplorer: its numbers against casts and against mpnb's LossScaler."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("ipywidgets")
pytest.importorskip("plotly")

from mpnb.amp import LossScaler  # noqa: E402
from mpnb.widgets import ScalerExplorer  # noqa: E402


@pytest.fixture
def grads():
    g = torch.Generator().manual_seed(0)
    # log-uniform magnitudes over 2^-40 .. 2^2: part underflows fp16, part overflows at 2^20
    mag = torch.exp2(torch.rand(20000, generator=g) * 42 - 40)
    return mag * torch.sign(torch.randn(20000, generator=g))


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("log2_scale", [0, 12, 20, 40])
def test_fractions_match_a_real_cast(grads, dtype, log2_scale):
    ex = ScalerExplorer(grads, dtype=dtype)
    half = {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
    cast = (grads * 2.0**log2_scale).to(half)
    f = ex.fractions(2.0**log2_scale)
    assert f["underflow"] == pytest.approx((cast == 0).float().mean().item(), abs=1e-3)
    assert f["overflow"] == pytest.approx(torch.isinf(cast).float().mean().item(), abs=1e-3)


def test_model_without_grads_is_a_clear_error():
    with pytest.raises(ValueError, match="backward"):
        ScalerExplorer(torch.nn.Linear(2, 2))


def test_model_grads_are_read():
    m = torch.nn.Linear(8, 4)
    m(torch.randn(3, 8)).sum().backward()
    ex = ScalerExplorer(m)
    assert sum(ex.hist_fig.data[0].y) == sum(p.grad.numel() for p in m.parameters())


def test_slider_moves_the_scaled_histogram(grads):
    ex = ScalerExplorer(grads, init_scale=1.0)
    x0 = list(ex.hist_fig.data[1].x)
    ex.scale_slider.value = 2.0**10
    assert ex.scale == 2.0**10
    assert list(ex.hist_fig.data[1].x) == pytest.approx([x + 10 for x in x0])
    assert "2^10" in ex.hist_fig.data[1].name and "underflow" in ex.stats.value
    ex.dtype_toggle.value = "bf16"
    assert ex.dtype == "bf16" and "bf16" in ex.hist_fig.layout.title.text


@pytest.mark.parametrize("growth_interval", [1, 3])
def test_stepping_matches_mpnbs_loss_scaler(grads, growth_interval):
    """The widget's simulated steps reproduce LossScaler fed with the full scaled gradients."""
    ex = ScalerExplorer(grads, init_scale=2.0**24, growth_interval=growth_interval)
    ex.n_steps.value = 25
    ex.step_button.click()
    assert ex.errors.last_error is None
    scaler = LossScaler("dynamic", init_scale=2.0**24, scale_window=growth_interval)
    expected = []
    for _ in range(25):
        used = scaler.loss_scale()
        g = [(grads * used).half()]
        scaler.clear_overflow()
        scaler.unscale(g, [torch.empty_like(g[0], dtype=torch.float32)])
        expected.append((used, bool(scaler.found_inf.item())))
        scaler.update()
    assert [(h["scale"], h["skipped"]) for h in ex.history] == expected
    assert any(s for _, s in expected) and not all(s for _, s in expected)
    assert ex.scale == scaler.loss_scale() == ex.scale_slider.value
    # the timeline figure holds every step and marks exactly the skipped ones
    assert list(ex.timeline_fig.data[0].x) == list(range(1, 26))
    assert list(ex.timeline_fig.data[1].x) == [h["step"] for h in ex.history if h["skipped"]]


def test_overflow_button_backs_off_and_growth_resumes(grads):
    ex = ScalerExplorer(
        grads * 1e-9, init_scale=2.0**8, growth_factor=4.0, backoff_factor=0.25, growth_interval=2
    )
    ex.spike_button.click()
    assert ex.history[-1]["skipped"] and ex.scale == 2.0**6
    ex.step(2)
    assert ex.scale == 2.0**8 and not ex.history[-1]["skipped"]
    ex.reset_button.click()
    assert ex.history == [] and ex.scale == 2.0**8 and len(ex.timeline_fig.data[0].x) == 0


def test_callback_errors_are_shown_in_the_widget(grads):
    ex = ScalerExplorer(grads)
    ex._extremes = None  # break the state: the click must not raise into the kernel log
    ex.step_button.click()
    assert ex.errors.last_error and "TypeError" in ex.errors.last_error
    assert len(ex.errors.outputs) == 1


def test_format_range_matches_finfo():
    from mpnb.widgets.scaler_explorer import format_range

    sub, normal, top = format_range("fp16")
    assert (sub, normal) == (-24.0, -14.0) and top == pytest.approx(math.log2(65504))


def test_charts_are_whole_figures_with_a_step_placeholder():
    torch.manual_seed(0)
    m = torch.nn.Linear(8, 4)
    m(torch.randn(16, 8)).pow(2).mean().backward()
    ex = ScalerExplorer(m, dtype="fp16")
    (hist,) = ex.hist_view.outputs
    fig = hist["data"]["application/vnd.plotly.v1+json"]
    assert len(fig["layout"]["shapes"]) == 2  # the fp16 bands travel with the figure
    (tl,) = ex.timeline_view.outputs
    assert "press Step" in tl["data"]["text/html"] and not ex.timeline_view.rendered
    ex.step(3)
    (tl,) = ex.timeline_view.outputs
    assert tl["data"]["application/vnd.plotly.v1+json"]["data"][0]["x"] == [1, 2, 3]
    ex.reset()
    assert "press Step" in ex.timeline_view.outputs[0]["data"]["text/html"]


def test_bad_controls_are_refused_beside_them_not_clamped():
    m = torch.nn.Linear(8, 4)
    m(torch.randn(16, 8)).pow(2).mean().backward()
    ex = ScalerExplorer(m)
    for control, bad in ((ex.n_steps, 0), (ex.n_steps, -5), (ex.growth, 0.1), (ex.backoff, 2.0)):
        good = control.value
        control.value = bad
        assert control.value == bad and ex.step_button.disabled
        assert "refused, not clamped" in ex.control_error.value
        with pytest.raises(ValueError, match="beside the control"):
            ex.step(1)
        control.value = good
        assert not ex.step_button.disabled and ex.control_error.value == ""


# ---- the widgets validate through the rule amp applies, and step a real LossScaler -----------

# (growth_factor, backoff_factor, growth_interval): what core accepts and refuses, at the edges
RULE_INPUTS = [
    (2.0, 0.5, 4),
    (1.0, 0.5, 4),  # never grows: LossScaleRule accepts it (both widgets used to refuse it)
    (2.0, 1.0, 4),  # never backs off: accepted too (refused by both widgets before)
    (1.0, 1.0, 1),
    (8.0, 0.125, 2**31 - 1),
    (0.999, 0.5, 4),
    (-2.0, 0.5, 4),
    (math.inf, 0.5, 4),
    (math.nan, 0.5, 4),
    (2.0, 0.0, 4),
    (2.0, 1.0001, 4),
    (2.0, -0.5, 4),
    (2.0, math.nan, 4),
    (2.0, 0.5, 0),
    (2.0, 0.5, -3),
    (2.0, 0.5, 2**31),
]


@pytest.fixture(scope="module")
def explorer():
    g = torch.Generator().manual_seed(0)
    return ScalerExplorer(torch.randn(64, generator=g))


@pytest.fixture(scope="module")
def compare_widget():
    from mpnb.widgets import CompareWidget

    cw = CompareWidget("mlp", opt_levels=("O0",), steps=4, threaded=False)
    cw.scale_mode.value = "dynamic"
    return cw


def _core_accepts(growth, backoff, interval) -> bool:
    from mpnb.amp import LossScaleRule

    try:
        LossScaleRule(growth_factor=growth, backoff_factor=backoff, growth_interval=interval)
    except ValueError:
        return False
    return True


def _amp_accepts(growth, backoff, interval) -> bool:
    from mpnb import amp

    m = torch.nn.Linear(2, 2)
    rule = dict(growth_factor=growth, backoff_factor=backoff, growth_interval=interval)
    try:
        amp.initialize(m, opt_level="O0", loss_scale=rule, verbosity=0)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("growth, backoff, interval", RULE_INPUTS)
def test_both_widgets_accept_exactly_what_core_accepts(
    explorer, compare_widget, growth, backoff, interval
):
    from mpnb.amp import LossScaleRule

    core = _core_accepts(growth, backoff, interval)
    assert core == _amp_accepts(growth, backoff, interval)  # amp.initialize's own parse
    explorer.growth.value, explorer.backoff.value = growth, backoff
    explorer.interval.value = interval
    assert explorer.validate() == core, explorer.input_errors()
    assert explorer.step_button.disabled != core
    cw = compare_widget
    cw.growth_factor.value, cw.backoff_factor.value = growth, backoff
    cw.growth_interval.value = interval
    assert cw.validate() == core, cw.input_errors()
    assert cw.run_button.disabled != core
    if core:
        rule = LossScaleRule(
            init_scale=cw.init_scale.value,
            growth_factor=growth,
            backoff_factor=backoff,
            growth_interval=interval,
        )
        assert cw.loss_scale() == rule  # what mpnb.lab.compare and amp then use as it is
        assert explorer.step(2)  # steps its real scaler with that rule
        assert explorer.scaler.rule.growth_factor == growth
    else:
        # each refusal is the rule's own message, beside the control that holds the value
        boxes = ("growth_factor", "backoff_factor", "growth_interval")
        errs = cw.input_errors()
        assert errs and all(k in boxes for k in errs)
        with pytest.raises(ValueError, match="beside the control"):
            explorer.step(1)


def test_the_explorer_steps_a_real_loss_scaler_down_to_the_rules_floor(grads):
    """The explorer kept its own scale tensor: after enough overflows it backed off to 0 (and
    log2(0) broke the view); amp's LossScaler stops at the rule's floor."""
    from mpnb.amp import LossScaler, LossScaleRule

    ex = ScalerExplorer(grads, init_scale=2.0**4, backoff_factor=0.5, growth_interval=4)
    assert isinstance(ex.scaler, LossScaler)
    ex.step(200, force_inf=True)
    assert ex.errors.last_error is None
    assert ex.scale == LossScaleRule().floor == ex.history[-1]["next_scale"] > 0
    assert all(h["skipped"] for h in ex.history)


def test_the_explorer_scale_is_clamped_to_max_scale_as_amps_is(grads):
    """A scale set above max_scale is clamped by the rule, as LossScaler clamps it."""
    ex = ScalerExplorer(grads * 1e-12, init_scale=2.0**4, growth_interval=1, max_scale=2.0**6)
    ex.step(5)
    assert [h["next_scale"] for h in ex.history] == [2.0**5, 2.0**6, 2.0**6, 2.0**6, 2.0**6]
    ex.scale_slider.value = 2.0**30  # beyond max_scale: the scaler starts from its clamp
    (first,) = ex.step(1)
    assert first["scale"] == 2.0**6 and ex.scaler.max_loss_scale == 2.0**6


@pytest.mark.parametrize(
    "growth, backoff, interval", [(2.0, 0.5, 2), (3.0, 0.25, 1), (1.0, 1.0, 1), (2.0, 0.5, 3)]
)
def test_the_explorer_and_amps_scaler_agree_step_for_step(grads, growth, backoff, interval):
    """The same rule, the same overflow pattern: the explorer's scales are the ones amp's own
    LossScaler takes in training (backoff, growth after ``interval`` clean steps, the
    ``max_scale`` clamp), step for step."""
    from mpnb import amp

    pattern = [False, True, False, False, True, True, False, False, False, False, False]
    ex = ScalerExplorer(
        grads * 1e-12,  # far below overflow at any scale here: the pattern alone decides
        init_scale=2.0**10,
        growth_factor=growth,
        backoff_factor=backoff,
        growth_interval=interval,
        max_scale=2.0**12,
    )
    explored = [ex.step(1, force_inf=inf)[0] for inf in pattern]
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    model, opt = amp.initialize(model, opt, opt_level="O0", loss_scale=ex.rule(), verbosity=0)
    scaler = amp.current_handle().scalers[0]
    trained = []
    for inf in pattern:
        used = scaler.loss_scale()
        opt.zero_grad()
        loss = model(torch.ones(2, 3)).sum() * (float("inf") if inf else 1.0)
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        trained.append({"scale": used, "skipped": inf, "next_scale": scaler.loss_scale()})
    assert [{k: h[k] for k in ("scale", "skipped", "next_scale")} for h in explored] == trained
    assert len({h["scale"] for h in trained}) > 1 or growth == backoff == 1.0
