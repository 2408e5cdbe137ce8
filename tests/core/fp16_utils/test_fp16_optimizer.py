"""mpnb.fp16_utils: Apex's FP16_Optimizer, loss scalers and model/master helpers."""

from __future__ import annotations

import io
import math

import pytest
import torch

from mpnb import fp16_utils as fu
from mpnb.core.amp import LossScaleCollapseError

HALVES = [torch.bfloat16, torch.float16]


def _net(half):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6), torch.nn.Linear(6, 2))
    return fu.convert_network(net, half)


@pytest.mark.parametrize("half", HALVES)
def test_network_helpers(half):
    net = _net(half)
    assert net[0].weight.dtype == half and net[1].weight.dtype == torch.float32
    assert net[1].running_mean.dtype == torch.float32
    wrapped = fu.network_to_half(
        torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2)), half
    )
    assert wrapped(torch.randn(3, 2)).dtype == half
    assert wrapped[1][1].weight.dtype == torch.float32
    model_p, master_p = fu.prep_param_lists(net)
    assert all(m.dtype == torch.float32 for m in master_p) and len(model_p) == len(master_p)
    net(torch.randn(3, 4, dtype=half)).float().sum().backward()
    fu.model_grads_to_master_grads(model_p, master_p)
    for p, m in zip(model_p, master_p, strict=False):
        assert torch.equal(m.grad, p.grad.float())
    for m in master_p:
        m.data.add_(1.0)
    fu.master_params_to_model_params(model_p, master_p)
    assert torch.equal(model_p[0], master_p[0].to(half))
    _, flat = fu.prep_param_lists(torch.nn.Linear(3, 3).to(half), flat_master=True)
    assert flat[0].numel() == 12 and flat[0].dtype == torch.float32
    assert fu.to_python_float(torch.tensor([2.5])) == 2.5 and fu.to_python_float([3.0]) == 3.0


@pytest.mark.parametrize("half", HALVES)
@pytest.mark.parametrize("dynamic", [False, True])
def test_fp16_optimizer_trains_like_fp32(half, dynamic):
    net = _net(half)
    ref = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6), torch.nn.Linear(6, 2))
    ref.load_state_dict({k: v.float() for k, v in net.state_dict().items()})
    opt = fu.FP16_Optimizer(
        torch.optim.SGD(net.parameters(), lr=0.1),
        static_loss_scale=128.0,
        dynamic_loss_scale=dynamic,
        dynamic_loss_args={"init_scale": 2.0**10},
        verbose=False,
    )
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x = torch.randn(8, 4)
    for _ in range(3):
        opt.zero_grad()
        opt.backward(net(x.to(half)).float().pow(2).mean())
        opt.clip_master_grads(10.0)
        opt.step()
        ref_opt.zero_grad()
        ref(x).pow(2).mean().backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 10.0)
        ref_opt.step()
    master = opt.param_groups[0]["params"][0]
    assert master.dtype == torch.float32
    torch.testing.assert_close(master, ref[0].weight, rtol=0.05, atol=0.05)
    assert torch.equal(net[0].weight, master.to(half))


def test_fp16_optimizer_overflow_skips_and_state_dict_and_scheduler():
    net = _net(torch.bfloat16)
    opt = fu.FP16_Optimizer(
        torch.optim.Adam(net.parameters(), lr=0.1), dynamic_loss_scale=True, verbose=False
    )
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    x = torch.randn(4, 4, dtype=torch.bfloat16)
    opt.zero_grad()
    opt.backward(net(x).float().sum())
    opt.step()
    sched.step()
    assert opt.param_groups[0]["lr"] == 0.05
    before = [p.detach().clone() for g in opt.param_groups for p in g["params"]]
    scale = opt.loss_scale
    opt.zero_grad()
    opt.backward(net(x).float().sum() * float("inf"))
    assert opt.clip_master_grads(1.0) == -1
    opt.step()
    assert opt.loss_scale == scale / 2
    assert all(
        torch.equal(a, b)
        for a, b in zip(before, [p for g in opt.param_groups for p in g["params"]], strict=False)
    )
    sd = opt.state_dict()
    net2 = _net(torch.bfloat16)
    opt2 = fu.FP16_Optimizer(
        torch.optim.Adam(net2.parameters(), lr=0.1), dynamic_loss_scale=True, verbose=False
    )
    opt2.load_state_dict(sd)
    assert opt2.loss_scale == opt.loss_scale
    for a, b in zip(opt.fp32_from_fp16_groups[0], opt2.fp32_from_fp16_groups[0], strict=False):
        assert torch.equal(a, b)  # fp32 model params (batch norm) travel in model.state_dict
    assert torch.equal(net2[0].weight, net[0].weight)
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        fu.FP16_Optimizer(object())


def _opt(**kw):
    torch.manual_seed(0)
    net = fu.convert_network(torch.nn.Sequential(torch.nn.Linear(4, 3)), torch.bfloat16)
    return net, fu.FP16_Optimizer(torch.optim.SGD(net.parameters(), lr=0.1), verbose=False, **kw)


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
    with pytest.raises(LossScaleCollapseError, match="below 1 .*max_skips"):
        for _ in range(200):
            opt.zero_grad()
            opt.backward(net(x).float().sum() * math.nan)
            opt.step()
    assert opt.loss_scale == 1.0
