"""The loss scaler's rule: one rule, applied the same way on every path.

Every opt level x {torch.optim, fused seam} x {kernel, reference} x custom rules (growth,
backoff, interval, hysteresis, bounds) runs through ``amp.initialize`` + ``scale_loss`` +
``step`` with forced overflows; the scale histories are identical and equal a pure-Python
model of the rule. A loss scale that is not a positive finite number, or that float32 cannot
hold with a finite inverse, is refused where it enters, naming the argument and the range.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from mpnb import amp
from mpnb.core.amp import (
    EmulatedHalfWarning,
    LossScaler,
    LossScaleRule,
    parse_loss_scale,
)
from mpnb.optimizers import FusedAdam

RULES = {
    "lab-backoff": LossScaleRule(init_scale=2.0**10, backoff_factor=0.125, growth_interval=3),
    "hysteresis-bounds": LossScaleRule(
        init_scale=2.0**12,
        growth_factor=4.0,
        backoff_factor=0.3,
        growth_interval=2,
        hysteresis=2,
        min_loss_scale=300.0,
        max_loss_scale=2.0**14,
    ),
    "slow-growth-clamped": LossScaleRule(
        init_scale=2.0**10,
        growth_factor=1.5,
        growth_interval=1,
        hysteresis=3,
        max_loss_scale=2.0**11,
    ),
}
OVERFLOWS = {2, 3, 4, 8, 11, 12}
STEPS = 15
OPTIMIZERS = {
    "torch-sgd": lambda p: torch.optim.SGD(p, lr=0.01),
    "fused-adam": lambda p: FusedAdam(p, lr=1e-3),
}


def _f32(x: float) -> float:
    return torch.tensor(x, dtype=torch.float64).float().item()


def model_history(rule: LossScaleRule, overflows: set[int], steps: int) -> list[float]:
    """The rule in plain Python: the scale after each step."""
    scale, growth, hyst = rule.clamp(rule.init_scale), 0, rule.hysteresis
    out = []
    for i in range(steps):
        if i in overflows:
            hyst -= 1
            growth = 0
            if hyst <= 0:
                scale = _f32(scale * rule.backoff_factor)
        else:
            growth += 1
            if growth == rule.growth_interval:
                scale, growth = _f32(scale * rule.growth_factor), 0
            hyst = rule.hysteresis
        out.append(rule.clamp(scale))
        scale = out[-1]
    return out


def _run(level: str, make_opt, loss_scale) -> tuple[list[float], LossScaler]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Linear(16, 4)
    )
    opt = make_opt(model.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EmulatedHalfWarning)
        model, opt = amp.initialize(
            model, opt, opt_level=level, half_dtype="bf16", loss_scale=loss_scale, verbosity=0
        )
    scaler = amp.current_handle().scalers[0]
    g = torch.Generator().manual_seed(1)
    history = []
    for i in range(STEPS):
        opt.zero_grad()
        loss = model(torch.randn(8, 8, generator=g)).pow(2).mean()
        if i in OVERFLOWS:
            loss = loss * float("inf")
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        history.append(scaler.loss_scale())
    return history, scaler


@pytest.mark.parametrize("rule", list(RULES))
def test_every_path_applies_the_scalers_rule(op_impl, rule):
    expected = model_history(RULES[rule], OVERFLOWS, STEPS)
    assert len(set(expected)) >= 3  # the rule backs off, holds and grows in this run
    for level in ("O0", "O1", "O2", "O3"):
        for name, make in OPTIMIZERS.items():
            history, scaler = _run(level, make, RULES[rule])
            assert history == expected, (level, name)
            assert scaler.updates == STEPS, (level, name)  # one rule application per step


def test_a_dict_of_gradscaler_settings_is_the_same_rule(op_impl):
    settings = dict(init_scale=2.0**10, backoff_factor=0.125, growth_interval=3)
    expected = model_history(LossScaleRule(**settings), OVERFLOWS, STEPS)
    for level in ("O1", "O2"):
        assert _run(level, OPTIMIZERS["torch-sgd"], settings)[0] == expected


def test_the_rule_is_the_scalers_own():
    s = LossScaler("dynamic", init_scale=8.0, growth_factor=3.0, backoff_factor=0.25)
    assert s.rule == LossScaleRule(init_scale=8.0, growth_factor=3.0, backoff_factor=0.25)
    assert (s.growth_factor, s.backoff_factor, s.growth_interval) == (3.0, 0.25, 2000)
    s.growth_interval = 3  # attributes write through to the rule
    assert s.rule.growth_interval == 3 and s.scale_window == 3
    apex = LossScaler("dynamic", scale_factor=4.0, scale_window=7)  # Apex's names
    assert (apex.growth_factor, apex.backoff_factor, apex.growth_interval) == (4.0, 0.25, 7)
    with pytest.raises(ValueError, match="scale_window.*disagree"):
        LossScaler(growth_interval=5, scale_window=6)
    with pytest.raises(ValueError, match="backoff_factor"):
        LossScaler(backoff_factor=2.0)
    assert not LossScaler(128.0).dynamic


@pytest.mark.parametrize(
    "value, expected",
    [
        (None, None),
        ("dynamic", LossScaleRule()),
        (128, 128.0),
        ({"growth_interval": 7}, LossScaleRule(growth_interval=7)),
        (LossScaleRule(hysteresis=2), LossScaleRule(hysteresis=2)),
    ],
)
def test_parse_loss_scale(value, expected):
    assert parse_loss_scale(value) == expected


def test_initialize_documents_and_applies_the_rule_argument():
    assert "LossScaleRule" in amp.initialize.__doc__ and "loss_scale" in amp.initialize.__doc__
    m = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    amp.initialize(m, opt, opt_level="O1", loss_scale=dict(hysteresis=3), verbosity=0)
    h = amp.current_handle()
    assert h.scalers[0].rule == LossScaleRule(hysteresis=3)
    assert h.properties.loss_scale == "dynamic"  # Apex's view of the properties is unchanged


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 2))


@pytest.mark.parametrize(
    "kw, name",
    [
        (dict(loss_scale=math.inf), "loss_scale"),
        (dict(loss_scale=0), "loss_scale"),
        (dict(loss_scale=-2.0), "loss_scale"),
        (dict(loss_scale=math.nan), "loss_scale"),
        (dict(max_loss_scale=0.0), "max_loss_scale"),
        (dict(max_loss_scale=-1.0), "max_loss_scale"),
        (dict(max_loss_scale=math.inf), "max_loss_scale"),
        (dict(min_loss_scale=math.nan), "min_loss_scale"),
        (dict(min_loss_scale=2.0**20, max_loss_scale=2.0**10), "min_loss_scale"),
    ],
)
def test_initialize_refuses_a_bad_loss_scale_naming_the_argument(kw, name):
    m = _net()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=name):  # fp16: the dynamic scale is the default
        amp.initialize(m, opt, opt_level="O1", half_dtype=torch.float16, verbosity=0, **kw)


@pytest.mark.parametrize(
    "kw, says",
    [
        (dict(loss_scale=2**200), "loss_scale=1.60694e+60 cannot be stored in float32"),
        (dict(loss_scale=1e-45), "loss_scale=1e-45 has an infinite float32 inverse"),
        (dict(loss_scale=dict(min_loss_scale=1e-45)), "min_loss_scale=1e-45 has an infinite"),
        (dict(loss_scale=dict(max_loss_scale=1e39)), "max_loss_scale=1e+39 cannot be stored"),
        (dict(min_loss_scale=1e-45), "min_loss_scale=1e-45 has an infinite"),
    ],
)
def test_initialize_refuses_a_scale_float32_cannot_hold(kw, says):
    """2**200 raised torch's raw 'value cannot be converted' error; 1e-45 was accepted and
    its inverse (inf) turned the O2 master weights into NaN on the first step."""
    m = _net()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    before = [p.detach().clone() for p in m.parameters()]
    with pytest.raises(ValueError) as e:
        amp.initialize(m, opt, opt_level="O2", half_dtype=torch.float16, verbosity=0, **kw)
    msg = str(e.value)
    assert says in msg and "[1.18e-38, " in msg and "3.4e+38]" in msg and "'dynamic'" in msg
    assert all(p.dtype == torch.float32 for p in m.parameters())  # the model is untouched
    assert all(torch.equal(a, b) for a, b in zip(before, m.parameters(), strict=True))


@pytest.mark.parametrize("scale", [2**200, 1e-45, 1e39])
def test_the_scaler_itself_refuses_it(scale):
    with pytest.raises(ValueError, match="a loss scale must lie in"):
        LossScaler(scale)


def test_the_edges_of_the_range_work():
    for scale in (torch.finfo(torch.float32).tiny, 2.0**127):
        s = LossScaler(scale)
        assert torch.isfinite(s.scale).all() and torch.isfinite(s.inv_scale).all()
