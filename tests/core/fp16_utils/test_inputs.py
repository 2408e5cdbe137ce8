"""FP16_Optimizer: refused scales, a checkpoint torch.load reads with its defaults, and the
same collapse error as amp."""

from __future__ import annotations

import io
import math

import pytest
import torch

from mpnb import fp16_utils as fu
from mpnb.core.amp import LossScaleCollapseError


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


@pytest.mark.parametrize("dynamic", [False, True])
def test_state_dict_loads_with_torch_load_defaults(dynamic):
    net, opt = _opt(dynamic_loss_scale=dynamic, static_loss_scale=64.0)
    opt.zero_grad()
    opt.backward(net(torch.randn(2, 4, dtype=torch.bfloat16)).float().sum())
    opt.step()
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf)  # weights_only=True
    net2, opt2 = _opt(dynamic_loss_scale=dynamic)
    opt2.load_state_dict(sd)
    assert opt2.loss_scale == opt.loss_scale
    assert type(opt2.loss_scaler) is type(opt.loss_scaler)
    assert torch.equal(net2[0].weight, net[0].weight)


def test_a_bad_checkpoint_changes_nothing():
    net, opt = _opt(dynamic_loss_scale=True)
    sd = opt.state_dict()
    sd["loss_scaler"]["cur_scale"] = math.nan
    scale = opt.loss_scale
    with pytest.raises(ValueError, match="cur_scale"):
        opt.load_state_dict(sd)
    assert opt.loss_scale == scale


def test_collapse_raises_the_same_clear_error_as_amp():
    net, opt = _opt(dynamic_loss_scale=True, dynamic_loss_args={"init_scale": 4.0})
    x = torch.randn(2, 4, dtype=torch.bfloat16)
    with pytest.raises(LossScaleCollapseError, match="at or below 1 .*max_skips_at_min"):
        for _ in range(200):
            opt.zero_grad()
            opt.backward(net(x).float().sum() * math.nan)
            opt.step()
    assert opt.loss_scale == 1.0
