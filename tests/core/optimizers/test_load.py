"""What a fused optimizer keeps of a checkpoint (``mpnb/core/optimizers/_load.py``).

* A checkpoint's param groups: another optimizer class refused at the load, replaced
  hyperparameters named once (kept, as torch.optim keeps them on a resume).
* The rounding of bf16 updates (round-to-nearest, stochastic rounding, Kahan summation) is the
  one the optimizer was built with, whatever the checkpoint's; one warning says what changed
  and what became of the Kahan buffers and the stochastic rounding's seed.
* An amp O2 checkpoint loaded without amp: its fp32 masters become the fp32 weights (in either
  load order), or the load is refused, naming ``amp.initialize``, where they would be rounded.
"""

from __future__ import annotations

import io
import warnings

import pytest
import torch
from torch import nn

from mpnb import amp
from mpnb.core._saved_groups import CheckpointHyperparamsWarning, SavedGroups
from mpnb.optimizers import (
    FusedAdagrad,
    FusedAdam,
    FusedSGD,
)


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

    sgd = FusedSGD(nn.Linear(3, 3).parameters(), lr=0.1, momentum=0.9)
    adam = FusedAdam(nn.Linear(3, 3).parameters(), lr=1e-3)
    with pytest.raises(ValueError, match="momentum"):
        adam.load_state_dict(sgd.state_dict())
    other = FusedAdam(nn.Linear(3, 3).parameters(), lr=0.5)
    with pytest.warns(CheckpointHyperparamsWarning, match="lr"):
        other.load_state_dict(adam.state_dict())
    assert other.param_groups[0]["lr"] == 1e-3


RTN, SR, KAHAN = {}, {"stochastic_rounding": True}, {"kahan_summation": True}


MODES = {"rtn": RTN, "sr": SR, "kahan": KAHAN}


def _small_model(dtype=torch.bfloat16):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2)).to(
        dtype
    )


def _train_small(model, opt, steps=2, start=0):
    for i in range(start, start + steps):
        x = torch.randn(8, 6, generator=torch.Generator().manual_seed(i))
        opt.zero_grad()
        model(x.to(model[0].weight.dtype)).float().square().mean().backward()
        opt.step()


def _roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf)


def _bits(model):
    return [p.detach().view(torch.int16).clone() for p in model.parameters()]


@pytest.mark.parametrize("saved", MODES)
@pytest.mark.parametrize("built", MODES)
def test_the_rounding_is_the_constructors_and_a_change_is_said(saved, built):
    model = _small_model()
    a = FusedAdam(model.parameters(), lr=1e-2, **MODES[saved])
    _train_small(model, a)
    ck = _roundtrip(a.state_dict())
    b = FusedAdam(model.parameters(), lr=1e-2, **MODES[built])
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        b.load_state_dict(ck)
    group = b.param_groups[0]
    assert group["stochastic_rounding"] is (built == "sr")
    assert group["kahan_summation"] is (built == "kahan")
    comp = [("compensation" in b.state[p]) for p in model.parameters()]
    said = [str(w.message) for w in rec if "load_state_dict" in str(w.message)]
    if saved == built:
        assert not said
        assert all(comp) if built == "kahan" else not any(comp)  # carried as it was
        return
    assert len(said) == 1 and "keeps" in said[0] and "as constructed" in said[0]
    assert not any(comp)  # dropped (not Kahan now), or not made yet (Kahan: zeros at the step)
    if saved == "kahan":
        assert "compensation buffers (4 params) were dropped" in said[0]
    if built == "kahan":
        assert "start from zero" in said[0]
    _train_small(model, b, 1, start=5)  # and it trains with its own rounding
    if built == "kahan":
        assert all("compensation" in b.state[p] for p in model.parameters())


def test_a_stochastic_rounding_resume_keeps_its_seed_and_a_new_sr_run_its_own():
    model = _small_model()
    a = FusedAdam(model.parameters(), stochastic_rounding=True)
    _train_small(model, a)
    b = FusedAdam(model.parameters(), stochastic_rounding=True)
    b.load_state_dict(a.state_dict())
    assert b.state_dict()["rounding"] == a.state_dict()["rounding"]
    plain = FusedAdam(model.parameters())
    _train_small(model, plain)
    c = FusedAdam(model.parameters(), stochastic_rounding=True)
    seed = c._rounding.seed
    with pytest.warns(UserWarning, match="own seed"):
        c.load_state_dict(plain.state_dict())
    assert c._rounding.seed == seed


def test_a_torch_checkpoint_into_a_kahan_optimizer_warns_and_trains():
    model = _small_model()
    t = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    _train_small(model, t)
    k = FusedAdam(model.parameters(), lr=1e-2, kahan_summation=True)
    with pytest.warns(UserWarning, match="start from zero"):
        k.load_state_dict(t.state_dict())
    _train_small(model, k, 1)
    assert k.param_groups[0]["kahan_summation"] is True


SAVERS = {
    "fused_adam": lambda p: FusedAdam(p, lr=1e-2),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2),
}


def _o2_checkpoint(saver):
    model = _small_model(torch.float32)
    opt = SAVERS[saver](model.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt = amp.initialize(
            model, opt, opt_level="O2", half_dtype=torch.bfloat16, verbosity=0
        )
    for i in range(3):
        opt.zero_grad()
        x = torch.randn(8, 6, generator=torch.Generator().manual_seed(i))
        with amp.scale_loss(model(x).float().square().mean(), opt) as s:
            s.backward()
        opt.step()
    masters = [m.detach().clone() for m in opt._amp_stash.all_fp32_from_fp16_params]
    assert len(masters) == 4
    assert not all(torch.equal(m, m.bfloat16().float()) for m in masters)
    return _roundtrip({"model": model.state_dict(), "opt": opt.state_dict()}), masters


@pytest.mark.parametrize("saver", SAVERS)
@pytest.mark.parametrize("model_first", [True, False])
def test_an_o2_checkpoint_into_an_fp32_model_without_amp_keeps_the_masters(saver, model_first):
    ck, masters = _o2_checkpoint(saver)
    model = _small_model(torch.float32)
    opt = FusedAdam(model.parameters(), lr=1e-2)
    if model_first:
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
    else:  # the model's bf16 weights, loaded last, round the fp32 params: the step restores
        opt.load_state_dict(ck["opt"])
        model.load_state_dict(ck["model"])
        opt.zero_grad()
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        saved = [p.detach().clone() for p in model.parameters()]
        assert all(torch.equal(s, s.bfloat16().float()) for s in saved)
        opt.param_groups[0]["lr"] = 0.0  # a step that changes nothing but the restore
        opt.step()
    for m, p in zip(masters, model.parameters(), strict=True):
        assert torch.equal(m, p.detach())
    assert all("master_param" not in s for s in opt.state.values())
    _train_small(model, opt, 1)


def test_an_o2_checkpoint_into_half_params_without_masters_is_refused_naming_amp():
    ck, _ = _o2_checkpoint("fused_adam")
    model = _small_model(torch.bfloat16)
    opt = FusedAdam(model.parameters(), lr=1e-2)
    with pytest.raises(ValueError, match="keeps no masters"):
        opt.load_state_dict(ck["opt"])
    assert not opt.state
    kept = FusedAdam(model.parameters(), lr=1e-2, master_weights=True)
    kept.load_state_dict(ck["opt"])
    assert all(kept.state[p]["master_param"].dtype == torch.float32 for p in model.parameters())
