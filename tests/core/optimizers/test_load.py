"""A checkpoint's param groups: another optimizer class refused at the load, replaced
hyperparameters named once (kept, as torch.optim keeps them on a resume)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from mpnb import amp
from mpnb.core._saved_groups import CheckpointHyperparamsWarning, SavedGroups
from mpnb.optimizers import FusedAdagrad, FusedAdam


def _o2(opt_cls, **kw):
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = opt_cls(model.parameters(), **kw)
    return amp.initialize(model, opt, opt_level="O2", half_dtype=torch.bfloat16, verbosity=0)


def _step(model, opt):
    loss = model(torch.randn(3, 4).bfloat16()).float().sum()
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    opt.step()
    opt.zero_grad()


def _adam_checkpoint(**kw) -> dict:
    model, opt = _o2(torch.optim.Adam, lr=1e-3, **kw)
    _step(model, opt)
    return opt.state_dict()


def test_sgd_refuses_an_o2_adam_checkpoint_at_the_load():
    saved = _adam_checkpoint()
    model, opt = _o2(torch.optim.SGD, lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match="another optimizer class") as e:
        opt.load_state_dict(saved)
    assert "momentum" in str(e.value) and "betas" in str(e.value)
    assert opt.param_groups[0]["momentum"] == 0.9 and opt.param_groups[0]["lr"] == 0.1
    assert not opt.state  # nothing loaded
    _step(model, opt)  # still trains as built


def test_adam_refuses_an_sgd_checkpoint():
    model, sgd = _o2(torch.optim.SGD, lr=0.1, momentum=0.9)
    _step(model, sgd)
    _, adam = _o2(torch.optim.Adam, lr=1e-3)
    with pytest.raises(ValueError, match="another optimizer class"):
        adam.load_state_dict(sgd.state_dict())


def test_other_hyperparameters_are_kept_as_torch_does_and_named_once():
    saved = _adam_checkpoint(weight_decay=0.0)
    _, opt = _o2(torch.optim.Adam, lr=0.5, weight_decay=0.1)
    with pytest.warns(CheckpointHyperparamsWarning, match=r"lr 0\.5 -> 0\.001") as rec:
        opt.load_state_dict(saved)
    assert len(rec) == 1 and "weight_decay 0.1 -> 0.0" in str(rec[0].message)
    assert opt.param_groups[0]["lr"] == 1e-3  # the resume takes the checkpoint's, as torch


def test_a_same_run_resume_under_a_scheduler_does_not_warn():
    model, opt = _o2(torch.optim.Adam, lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for _ in range(3):
        _step(model, opt)
        sched.step()
    saved = opt.state_dict()
    _, again = _o2(torch.optim.Adam, lr=1e-2)
    torch.optim.lr_scheduler.StepLR(again, step_size=1, gamma=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CheckpointHyperparamsWarning)
        again.load_state_dict(saved)
    assert again.param_groups[0]["lr"] == pytest.approx(1e-2 / 8)


def test_a_torch_adam_checkpoint_loads_into_fused_adam_its_counterpart():
    saved = _adam_checkpoint()
    _, opt = _o2(FusedAdam, lr=1e-3)
    opt.load_state_dict(saved)


def test_counterparts_without_extra_hyperparameters_pass_the_class_check():
    p = [nn.Parameter(torch.randn(3))]
    SavedGroups(torch.optim.Adagrad(p), FusedAdagrad(p).state_dict()).check()
    SavedGroups(FusedAdam(p), torch.optim.Adam(p).state_dict()).check()
    with pytest.raises(ValueError, match=r"\['lr_decay'.*\['betas'"):
        SavedGroups(torch.optim.Adagrad(p), torch.optim.Adam(p).state_dict()).check()


def test_a_fused_optimizer_refuses_another_class_without_amp_and_names_replaced_values():
    from mpnb.optimizers import FusedSGD

    sgd = FusedSGD(nn.Linear(3, 3).parameters(), lr=0.1, momentum=0.9)
    adam = FusedAdam(nn.Linear(3, 3).parameters(), lr=1e-3)
    with pytest.raises(ValueError, match="momentum"):
        adam.load_state_dict(sgd.state_dict())
    other = FusedAdam(nn.Linear(3, 3).parameters(), lr=0.5)
    with pytest.warns(CheckpointHyperparamsWarning, match="lr"):
        other.load_state_dict(adam.state_dict())
    assert other.param_groups[0]["lr"] == 1e-3
