"""Fused-optimizer checkpoints moved between configurations, and corrupt ones.

* The rounding of bf16 updates (round-to-nearest, stochastic rounding, Kahan summation) is the
  one the optimizer was built with, whatever the checkpoint's; one warning says what changed
  and what became of the Kahan buffers and the stochastic rounding's seed.
* An amp O2 checkpoint loaded without amp: its fp32 masters become the fp32 weights (in either
  load order), or the load is refused, naming ``amp.initialize``, where they would be rounded.
* A corrupt checkpoint (a negative step, a NaN learning rate, a negative second moment) is
  refused naming the entry, before anything changes.
"""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch

from mpnb import amp
from mpnb.optimizers import FusedAdagrad, FusedAdam, FusedLAMB, FusedNovoGrad, FusedSGD

RTN, SR, KAHAN = {}, {"stochastic_rounding": True}, {"kahan_summation": True}
MODES = {"rtn": RTN, "sr": SR, "kahan": KAHAN}


def _model(dtype=torch.bfloat16):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2)).to(
        dtype
    )


def _train(model, opt, steps=2, start=0):
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


# ---- the rounding follows the constructor ----------------------------------------------------


@pytest.mark.parametrize("saved", MODES)
@pytest.mark.parametrize("built", MODES)
def test_the_rounding_is_the_constructors_and_a_change_is_said(saved, built):
    model = _model()
    a = FusedAdam(model.parameters(), lr=1e-2, **MODES[saved])
    _train(model, a)
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
    _train(model, b, 1, start=5)  # and it trains with its own rounding
    if built == "kahan":
        assert all("compensation" in b.state[p] for p in model.parameters())


def test_a_stochastic_rounding_resume_keeps_its_seed_and_a_new_sr_run_its_own():
    model = _model()
    a = FusedAdam(model.parameters(), stochastic_rounding=True)
    _train(model, a)
    b = FusedAdam(model.parameters(), stochastic_rounding=True)
    b.load_state_dict(a.state_dict())
    assert b.state_dict()["rounding"] == a.state_dict()["rounding"]
    plain = FusedAdam(model.parameters())
    _train(model, plain)
    c = FusedAdam(model.parameters(), stochastic_rounding=True)
    seed = c._rounding.seed
    with pytest.warns(UserWarning, match="own seed"):
        c.load_state_dict(plain.state_dict())
    assert c._rounding.seed == seed


def test_a_torch_checkpoint_into_a_kahan_optimizer_warns_and_trains():
    model = _model()
    t = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    _train(model, t)
    k = FusedAdam(model.parameters(), lr=1e-2, kahan_summation=True)
    with pytest.warns(UserWarning, match="round-to-nearest.*Kahan summation.*start from zero"):
        k.load_state_dict(t.state_dict())
    _train(model, k, 1)
    assert k.param_groups[0]["kahan_summation"] is True


# ---- an O2 checkpoint without amp ------------------------------------------------------------

SAVERS = {
    "fused_adam": lambda p: FusedAdam(p, lr=1e-2),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2),
}


def _o2_checkpoint(saver):
    model = _model(torch.float32)
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
    model = _model(torch.float32)
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
    _train(model, opt, 1)


def test_an_o2_checkpoint_into_half_params_without_masters_is_refused_naming_amp():
    ck, _ = _o2_checkpoint("fused_adam")
    model = _model(torch.bfloat16)
    opt = FusedAdam(model.parameters(), lr=1e-2)
    with pytest.raises(ValueError, match=r"keeps no masters.*amp.initialize.*Nothing was loaded"):
        opt.load_state_dict(ck["opt"])
    assert not opt.state
    kept = FusedAdam(model.parameters(), lr=1e-2, master_weights=True)
    kept.load_state_dict(ck["opt"])
    assert all(kept.state[p]["master_param"].dtype == torch.float32 for p in model.parameters())


# ---- corrupt checkpoints ---------------------------------------------------------------------

CLASSES = {
    "adam": lambda p: FusedAdam(p, lr=1e-2),
    "lamb": lambda p: FusedLAMB(p, lr=1e-2),
    "sgd": lambda p: FusedSGD(p, lr=1e-2, momentum=0.9),
    "adagrad": lambda p: FusedAdagrad(p, lr=1e-2),
    "novograd": lambda p: FusedNovoGrad(p, lr=1e-2),
}


def _set(sd, path, value):
    *keys, last = path
    d = sd
    for k in keys:
        d = d[k]
    d[last] = value(d[last]) if callable(value) else value


CORRUPT = [
    (("state", 0, "step"), torch.tensor(-5.0), r"state\[0\]\['step'\]=-5.0 is not a step count"),
    (("state", 0, "step"), 2.5, r"state\[0\]\['step'\]=2.5"),
    (("param_groups", 0, "lr"), float("nan"), r"param_groups\[0\]\['lr'\]=nan"),
    (("param_groups", 0, "eps"), -1e-8, r"param_groups\[0\]\['eps'\]"),
    (("param_groups", 0, "betas"), (0.9, 1.5), r"param_groups\[0\]\['betas'\]"),
    (("state", 1, "exp_avg_sq"), lambda t: -t - 1, r"state\[1\]\['exp_avg_sq'\] holds \d+ negat"),
    (("state", 1, "exp_avg"), lambda t: t * float("nan"), r"state\[1\]\['exp_avg'\] holds"),
]


@pytest.mark.parametrize("path, value, message", CORRUPT)
def test_a_corrupt_adam_checkpoint_is_refused_naming_the_entry(path, value, message):
    model = _model(torch.float32)
    opt = FusedAdam(model.parameters(), lr=1e-2)
    _train(model, opt)
    before = copy.deepcopy(opt.state_dict())
    bad = copy.deepcopy(opt.state_dict())
    _set(bad, path, value)
    with pytest.raises(ValueError, match=message + r".*corrupt.*Nothing was loaded"):
        opt.load_state_dict(bad)
    after = opt.state_dict()
    assert after["param_groups"] == before["param_groups"]
    for k, s in before["state"].items():
        assert all(
            torch.equal(torch.as_tensor(v), torch.as_tensor(after["state"][k][n]))
            for n, v in s.items()
        )
    _train(model, opt, 1)
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("name", CLASSES)
def test_every_fused_optimizer_refuses_a_nan_lr_at_construction_and_on_load(name):
    model = _model(torch.float32)
    with pytest.raises(ValueError, match="nan"):
        CLASSES[name](model.parameters()).__class__(model.parameters(), lr=float("nan"))
    opt = CLASSES[name](model.parameters())
    _train(model, opt)
    bad = copy.deepcopy(opt.state_dict())
    bad["param_groups"][0]["lr"] = float("nan")
    with pytest.raises(ValueError, match=r"\['lr'\]=nan.*Nothing was loaded"):
        opt.load_state_dict(bad)
    assert opt.param_groups[0]["lr"] == 1e-2
    key = {"adagrad": "sum", "sgd": None}.get(name, "exp_avg_sq")
    if key is not None:
        bad = copy.deepcopy(opt.state_dict())
        bad["state"][0][key] = -bad["state"][0][key] - 1
        with pytest.raises(ValueError, match=rf"\['{key}'\] holds \d+ negative"):
            opt.load_state_dict(bad)
