"""Apex's ``fp16_utils`` loss scalers (:mod:`mpnb.core.fp16_utils.loss_scaler`): a static
``LossScaler`` and the ``DynamicLossScaler`` (halve on overflow, not below 1; double every
``scale_window`` clean iterations), their refused arguments and ``from_args``."""

from __future__ import annotations

import math

import pytest
import torch

from mpnb import fp16_utils as fu
from mpnb.core.fp16_utils.loss_scaler import DynamicLossScaler, LossScaler


def _opt(**kw):
    torch.manual_seed(0)
    net = fu.convert_network(torch.nn.Sequential(torch.nn.Linear(4, 3)), torch.bfloat16)
    return net, fu.FP16_Optimizer(torch.optim.SGD(net.parameters(), lr=0.1), verbose=False, **kw)


@pytest.mark.parametrize("scale", [0, -1.0, math.inf, math.nan])
def test_a_static_scale_that_is_not_positive_and_finite_is_refused(scale):
    with pytest.raises(ValueError, match="positive finite"):
        _opt(static_loss_scale=scale)


@pytest.mark.parametrize("init_scale", [0.0, -(2.0**16)])
def test_a_non_positive_init_scale_is_refused(init_scale):
    with pytest.raises(ValueError, match="init_scale"):
        fu.DynamicLossScaler(init_scale=init_scale)
    with pytest.raises(ValueError, match="init_scale"):
        _opt(dynamic_loss_scale=True, dynamic_loss_args={"init_scale": init_scale})


def test_loss_scalers_apex_rules():
    s = fu.DynamicLossScaler(init_scale=8.0, scale_window=2)
    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.tensor([1.0, float("nan")])
    assert s.has_overflow([p])
    s.update_scale(True)
    assert s.loss_scale == 4.0
    s.update_scale(False)
    s.update_scale(False)
    assert s.loss_scale == 8.0
    for _ in range(10):
        s.update_scale(True)
    assert s.loss_scale == 1.0  # never below 1
    st = fu.LossScaler(16.0)
    assert not st.has_overflow([p]) and st.loss_scale == 16.0


def test_the_static_scaler_scales_the_backward_and_the_gradient_hook():
    w = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    s = LossScaler(8.0)
    s.backward((w * w).sum())
    assert torch.equal(w.grad, torch.tensor([16.0, 32.0]))  # 8 * 2w
    s.update_scale(True)  # a static scale never moves
    assert s.loss_scale == 8.0
    g = (torch.ones(2), torch.full((2,), 3.0))
    assert [x.tolist() for x in s.scale_gradient(None, g, None)] == [[8.0, 8.0], [24.0, 24.0]]


def test_a_clean_window_doubles_and_an_overflow_restarts_the_window():
    s = DynamicLossScaler(init_scale=16.0, scale_factor=2.0, scale_window=3)
    history = []
    for overflow in [False, False, True, False, False, False, False]:
        s.update_scale(overflow)
        history.append(s.loss_scale)
    # iteration 2 overflows and halves; the next growth comes scale_window clean iterations
    # after that overflow (Apex's rule, counted from the last overflow).
    assert history == [16.0, 16.0, 8.0, 8.0, 8.0, 16.0, 16.0]


def test_has_overflow_checks_every_dtype_and_ignores_params_without_grads():
    a = torch.nn.Parameter(torch.ones(3))
    b = torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
    c = torch.nn.Parameter(torch.ones(2))
    s = DynamicLossScaler()
    assert not s.has_overflow([a, b, c])  # no grads yet
    a.grad, b.grad = torch.ones(3), torch.ones(3, dtype=torch.bfloat16)
    assert not s.has_overflow([a, b, c])
    b.grad[1] = math.inf
    assert s.has_overflow([a, b, c])


@pytest.mark.parametrize(
    "kw, key",
    [
        (dict(scale_factor=1.0), "scale_factor"),
        (dict(scale_factor=math.inf), "scale_factor"),
        (dict(scale_window=0), "scale_window"),
        (dict(scale_window=True), "scale_window"),
        (dict(scale_window=2.5), "scale_window"),
    ],
)
def test_a_bad_factor_or_window_is_refused_naming_it(kw, key):
    with pytest.raises(ValueError, match=key):
        DynamicLossScaler(**kw)


def test_from_args_builds_the_scaler_or_names_the_valid_keys():
    assert DynamicLossScaler.from_args(None).cur_scale == 2.0**32  # Apex's default
    s = DynamicLossScaler.from_args({"init_scale": 2.0**16, "scale_window": 5})
    assert (s.cur_scale, s.scale_window) == (2.0**16, 5)
    with pytest.raises(TypeError, match="'init_scale'") as e:
        DynamicLossScaler.from_args({"init_scal": 1.0}, owner="MyOptimizer")
    assert str(e.value).startswith("MyOptimizer")
    with pytest.raises(TypeError, match="must be a dict"):
        DynamicLossScaler.from_args([2.0])
