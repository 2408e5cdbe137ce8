"""Fused optimizers: hyper-parameters checked as torch.optim does (and NaN/inf too), loads
that validate everything first, and Apex's attributes for code that subclasses them."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from mpnb import amp_C
from mpnb.multi_tensor_apply import multi_tensor_applier
from mpnb.optimizers import (
    FusedAdagrad,
    FusedAdam,
    FusedLAMB,
    FusedMixedPrecisionLamb,
    FusedNovoGrad,
    FusedSGD,
)

ALL = [FusedAdam, FusedAdagrad, FusedLAMB, FusedNovoGrad, FusedSGD, FusedMixedPrecisionLamb]
WITH_BETAS = [FusedAdam, FusedLAMB, FusedNovoGrad, FusedMixedPrecisionLamb]


def _params():
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(3, 4)), torch.nn.Parameter(torch.randn(4))]


def _kw(cls, **kw):
    return {"lr": 0.1, **kw} if cls is FusedSGD else kw


@pytest.mark.parametrize("cls", ALL)
@pytest.mark.parametrize("name", ["lr", "eps", "weight_decay"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -1e-3])
def test_bad_numbers_are_refused_naming_the_argument(cls, name, value):
    if cls is FusedSGD and name == "eps":
        name = "momentum"
    with pytest.raises(ValueError, match=f"{name if name != 'lr' else 'learning rate'}"):
        cls(_params(), **{**_kw(cls), name: value})


@pytest.mark.parametrize("cls", WITH_BETAS)
@pytest.mark.parametrize("betas", [(0.9,), (0.9, 1.0), (-0.1, 0.99), (math.nan, 0.9), 0.9])
def test_malformed_betas_are_refused(cls, betas):
    with pytest.raises(ValueError, match="betas"):
        cls(_params(), betas=betas)


def _trained(cls=FusedAdam):
    ps = _params()
    opt = cls(ps, lr=1e-2)
    for _ in range(2):
        for p in ps:
            p.grad = torch.ones_like(p)
        opt.step()
    return ps, opt


@pytest.mark.parametrize(
    "corrupt",
    [
        lambda sd: sd["state"][1].__setitem__("exp_avg", torch.zeros(7)),
        lambda sd: sd["state"][1].__setitem__("step", "two"),
        lambda sd: sd["param_groups"][0]["params"].append(5),
    ],
)
def test_a_bad_checkpoint_changes_nothing(corrupt):
    ps, opt = _trained()
    before = copy.deepcopy(opt.state_dict())
    other_ps, other = _trained()
    for p in other_ps:
        p.grad = torch.full_like(p, 3.0)
    other.step()
    bad = copy.deepcopy(other.state_dict())
    corrupt(bad)
    with pytest.raises(ValueError, match="load_state_dict.*[Nn]othing was loaded"):
        opt.load_state_dict(bad)
    after = opt.state_dict()
    for k, s in before["state"].items():
        for n, v in s.items():
            assert torch.equal(v, after["state"][k][n]), (k, n)


@pytest.mark.parametrize(
    "cls, names",
    [
        (FusedAdam, ["multi_tensor_adam"]),
        (FusedLAMB, ["multi_tensor_lamb", "multi_tensor_l2norm"]),
        (FusedSGD, ["multi_tensor_sgd"]),
        (FusedNovoGrad, ["multi_tensor_novograd", "multi_tensor_l2norm"]),
        (FusedAdagrad, ["multi_tensor_adagrad"]),
    ],
)
def test_apex_attributes_are_there(cls, names):
    opt = cls(_params(), **_kw(cls))
    for name in names:
        assert getattr(opt, name) is getattr(amp_C, name)
    assert opt._dummy_overflow_buf.numel() == 1 and opt._dummy_overflow_buf.item() == 0
    norm, _ = multi_tensor_applier(
        getattr(opt, "multi_tensor_l2norm", amp_C.multi_tensor_l2norm),
        opt._dummy_overflow_buf,
        [[torch.full((4,), 3.0)]],
        False,
    )
    assert norm.item() == 6.0


class FairseqStyleAdam(FusedAdam):
    """fairseq's FusedAdamV2 in miniature: Apex's attributes, its own step."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if not hasattr(self, "multi_tensor_adam"):
            raise Exception("Apex installation is outdated. Please install an updated version.")

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
            beta1, beta2 = group["betas"]
            g32, p32, m32, v32 = [], [], [], []
            for p in group["params"]:
                state = self.state[p]
                if len(state) == 0:
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float)
                g32.append(p.grad)
                p32.append(p.data)
                m32.append(state["exp_avg"])
                v32.append(state["exp_avg_sq"])
            multi_tensor_applier(
                self.multi_tensor_adam,
                self._dummy_overflow_buf,
                [g32, p32, m32, v32],
                group["lr"],
                beta1,
                beta2,
                group["eps"],
                group["step"],
                self.adam_w_mode,
                1 if group["bias_correction"] else 0,
                group["weight_decay"],
            )


def test_a_fairseq_style_subclass_trains_like_adamw():
    a, b = _params(), _params()
    ours = FairseqStyleAdam(a, lr=1e-2, weight_decay=0.1)
    ref = torch.optim.AdamW(b, lr=1e-2, weight_decay=0.1)
    g = torch.Generator().manual_seed(2)
    for _ in range(5):
        grads = [torch.randn(p.shape, generator=g) for p in a]
        for p, q, gr in zip(a, b, grads, strict=True):
            p.grad, q.grad = gr.clone(), gr.clone()
        ours.step()
        ref.step()
    for p, q in zip(a, b, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
