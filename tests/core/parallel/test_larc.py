"""mpnb.core.parallel.larc: LARC checks its arguments where it is built, before any step runs,
and over torch.optim.SGD steps it is Apex's ``LARC.step`` loop (written out here in the structure
of Apex's code): the same weights after 30 steps, the group's weight decay restored after each."""

from __future__ import annotations

import math

import pytest
import torch

from mpnb.parallel import LARC
from tests.core.optimizers.test_base import _close, _mlp, _train_mlp


def _opt():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


@pytest.mark.parametrize("bad", [-1.0, 0.0, math.nan, math.inf, "0.02", True])
def test_trust_coefficient_must_be_positive_and_finite(bad):
    with pytest.raises(ValueError, match="trust_coefficient"):
        LARC(_opt()[1], trust_coefficient=bad)


@pytest.mark.parametrize("bad", [-1e-8, math.nan, math.inf])
def test_eps_must_be_finite_and_not_negative(bad):
    with pytest.raises(ValueError, match="eps"):
        LARC(_opt()[1], eps=bad)


def test_a_model_or_other_object_is_refused_with_the_fix():
    model, _ = _opt()
    for bad in (model, model.parameters(), None):
        with pytest.raises(TypeError, match="torch.optim.Optimizer"):
            LARC(bad)


def test_clip_must_be_a_bool():
    with pytest.raises(TypeError, match="clip"):
        LARC(_opt()[1], clip="no")


def test_defaults_and_eps_zero_still_train():
    for kw in ({}, {"eps": 0.0, "trust_coefficient": 1e-3, "clip": False}):
        model, opt = _opt()
        larc = LARC(opt, **kw)
        x, y = torch.randn(8, 4), torch.randn(8, 1)
        losses = []
        for _ in range(5):
            larc.zero_grad()
            loss = (model(x) - y).pow(2).mean()
            loss.backward()
            larc.step()
            losses.append(loss.item())
        assert losses[-1] < losses[0]


def test_larc_matches_apex_loop(kernels):
    a, b = _mlp(), _mlp()
    oa = LARC(torch.optim.SGD(a.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3))
    ob = torch.optim.SGD(b.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)

    class ApexLARC:  # Apex's LARC.step, verbatim in structure
        def zero_grad(self):
            ob.zero_grad()

        @torch.no_grad()
        def step(self):
            group = ob.param_groups[0]
            wd, group["weight_decay"] = group["weight_decay"], 0
            for p in group["params"]:
                pn, gn = torch.norm(p), torch.norm(p.grad)
                if pn != 0 and gn != 0:
                    lr = 0.02 * pn / (gn + pn * wd + 1e-8)
                    lr = min(lr / group["lr"], 1)
                    p.grad += wd * p
                    p.grad *= lr
            ob.step()
            group["weight_decay"] = wd

    _train_mlp(a, oa, steps=30)
    _train_mlp(b, ApexLARC(), steps=30)
    _close(a, b, rtol=1e-5)
    assert oa.param_groups[0]["weight_decay"] == 1e-3
