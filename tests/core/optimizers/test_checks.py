"""What the fused optimizers check before they change anything
(``mpnb/core/optimizers/_checks.py``): hyper-parameters, param groups and loads.

* hyper-parameters are checked as torch.optim does (and NaN/inf too), naming the argument;
  malformed betas are refused;
* a parameter listed twice in one group is updated twice per step (torch and Apex do it):
  one warning that says so and how to fix it; in two groups it is refused with the fix;
* ``eps=0`` gives ``0 / 0 = NaN`` for a parameter whose gradient is zero in every optimizer
  that divides by ``sqrt(v) + eps``: one warning; a negative ``eps`` (or lr...) is refused,
  in the constructor and in ``add_param_group`` alike;
* Apex's ``amp_C.multi_tensor_adam`` (and the other Adam/LAMB/NovoGrad kernels) with
  ``step=0`` and bias correction divide by ``1 - beta**0 = 0``: refused, nothing written;
* a bad or corrupt checkpoint (a negative step, a NaN learning rate, a negative second
  moment, a state of the wrong size) is refused naming the entry, before anything changes.
"""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch

from mpnb import amp_C
from mpnb import optimizers as O
from mpnb.core.optimizers._checks import DuplicateParameterWarning, ZeroEpsWarning
from mpnb.optimizers import (
    FusedAdagrad,
    FusedAdam,
    FusedLAMB,
    FusedMixedPrecisionLamb,
    FusedNovoGrad,
    FusedSGD,
)
from tests.core.optimizers.test_load import _small_model, _train_small

ALL = ["FusedAdam", "FusedSGD", "FusedAdagrad", "FusedLAMB", "FusedMixedPrecisionLamb"]
ALL += ["FusedNovoGrad"]
WITH_EPS = [c for c in ALL if c != "FusedSGD"]


def _make(cls, params, **kw):
    if cls == "FusedSGD":
        kw.setdefault("lr", 0.1)
    return getattr(O, cls)(params, **kw)


def _params(n=2):
    return [torch.nn.Parameter(torch.ones(4)) for _ in range(n)]


def _caught(fn, action="always"):
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter(action)
        fn()
    return rec


# ---- a parameter listed twice ----


@pytest.mark.parametrize("cls", ALL)
def test_a_parameter_twice_in_one_group_warns_once_with_the_fix(cls):
    p, q = _params()
    rec = _caught(lambda: _make(cls, [p, q, p]))
    assert len(rec) == 1, [str(r.message) for r in rec]  # ours, not torch's as well
    assert issubclass(rec[0].category, DuplicateParameterWarning)
    assert "twice" in str(rec[0].message) and "dict.fromkeys" in str(rec[0].message)
    assert rec[0].filename == __file__  # points at the caller's line
    rec = _caught(lambda: [_make(cls, [p, q, p]) for _ in range(3)], "default")
    assert len(rec) == 1  # a loop does not flood


@pytest.mark.parametrize("cls", ALL)
def test_a_parameter_in_two_groups_is_refused_with_the_fix(cls):
    p, q = _params()
    with pytest.raises(ValueError, match="already in param group") as e:
        _make(cls, [{"params": [p, q]}, {"params": [q]}])
    assert "group 1" in str(e.value) and "group 0" in str(e.value)  # which groups
    opt = _make(cls, [p])
    with pytest.raises(ValueError, match="already in param group 0"):
        opt.add_param_group({"params": [q, p]})
    assert len(opt.param_groups) == 1  # nothing was added


def test_a_generator_of_params_is_still_taken():
    p, q = _params()
    opt = O.FusedAdam(x for x in (p, q))
    assert opt.param_groups[0]["params"] == [p, q]


# ---- eps ----


@pytest.mark.parametrize("cls", WITH_EPS)
def test_eps_zero_warns_that_a_zero_grad_gives_nan(cls):
    rec = _caught(lambda: _make(cls, _params(), eps=0.0))
    msgs = [str(r.message) for r in rec if issubclass(r.category, ZeroEpsWarning)]
    assert len(msgs) == 1 and "NaN" in msgs[0] and "eps=" in msgs[0]
    opt = _make(cls, _params())
    rec = _caught(lambda: opt.add_param_group({"params": _params(1), "eps": 0}))
    assert [r for r in rec if issubclass(r.category, ZeroEpsWarning)]


@pytest.mark.parametrize("cls", WITH_EPS)
def test_a_positive_eps_does_not_warn(cls):
    rec = _caught(lambda: _make(cls, _params(), eps=1e-12))
    assert not [r for r in rec if issubclass(r.category, ZeroEpsWarning)]


@pytest.mark.parametrize("cls", WITH_EPS)
@pytest.mark.parametrize("key,bad", [("eps", -1.0), ("lr", -0.1), ("weight_decay", float("nan"))])
def test_a_bad_number_in_an_added_group_is_refused(cls, key, bad):
    opt = _make(cls, _params(1))
    with pytest.raises(ValueError, match=key):
        opt.add_param_group({"params": _params(1), key: bad})
    with pytest.raises(ValueError, match=key):
        _make(cls, [{"params": _params(1), key: bad}])
    assert len(opt.param_groups) == 1


def test_bad_betas_in_an_added_group_are_refused():
    opt = O.FusedAdam(_params(1))
    with pytest.raises(ValueError, match="betas"):
        opt.add_param_group({"params": _params(1), "betas": (0.9, 1.5)})


# ---- Apex's amp_C kernels at step 0 ----


def _adam_lists():
    g = [torch.ones(4)]
    return [g, [torch.ones(4)], [torch.zeros(4)], [torch.zeros(4)]]


def test_multi_tensor_adam_step_0_with_bias_correction_is_refused():
    lists = _adam_lists()
    flag = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="step=0"):
        amp_C.multi_tensor_adam(2048, flag, lists, 1e-3, 0.9, 0.999, 1e-8, 0, 1, 1, 0.0)
    assert torch.equal(lists[1][0], torch.ones(4))  # nothing was written
    amp_C.multi_tensor_adam(2048, flag, lists, 1e-3, 0.9, 0.999, 1e-8, 0, 1, 0, 0.0)
    amp_C.multi_tensor_adam(2048, flag, lists, 1e-3, 0.9, 0.999, 1e-8, 1, 1, 1, 0.0)
    assert torch.isfinite(lists[1][0]).all()


def test_the_capturable_adam_and_the_lamb_and_novograd_kernels_refuse_step_0_too():
    flag = torch.zeros(1, dtype=torch.int32)
    one = torch.ones(1)
    with pytest.raises(ValueError, match="step=0"):
        amp_C.multi_tensor_adam_capturable(
            2048, flag, _adam_lists(), one * 1e-3, 0.9, 0.999, 1e-8, one * 0, 1, 1, 0.0, one
        )
    with pytest.raises(ValueError, match="step=0"):
        amp_C.multi_tensor_lamb(
            2048, flag, _adam_lists(), 1e-3, 0.9, 0.999, 1e-6, 0, 1, 0.0, 1, 1, one, 1.0
        )
    with pytest.raises(ValueError, match="step=0"):
        amp_C.multi_tensor_novograd(
            2048, flag, _adam_lists()[:3], torch.zeros(1), 1e-3, 0.9, 0.999, 1e-8, 0, 1,
            0.0, 1, 0, 2,
        )  # fmt: skip


CLASSES = [FusedAdam, FusedAdagrad, FusedLAMB, FusedNovoGrad, FusedSGD, FusedMixedPrecisionLamb]


WITH_BETAS = [FusedAdam, FusedLAMB, FusedNovoGrad, FusedMixedPrecisionLamb]


def _randn_params():
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(3, 4)), torch.nn.Parameter(torch.randn(4))]


def _kw(cls, **kw):
    return {"lr": 0.1, **kw} if cls is FusedSGD else kw


@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize("name", ["lr", "eps", "weight_decay"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -1e-3])
def test_bad_numbers_are_refused_naming_the_argument(cls, name, value):
    if cls is FusedSGD and name == "eps":
        name = "momentum"
    with pytest.raises(ValueError, match=f"{name if name != 'lr' else 'learning rate'}"):
        cls(_randn_params(), **{**_kw(cls), name: value})


@pytest.mark.parametrize("cls", WITH_BETAS)
@pytest.mark.parametrize("betas", [(0.9,), (0.9, 1.0), (-0.1, 0.99), (math.nan, 0.9), 0.9])
def test_malformed_betas_are_refused(cls, betas):
    with pytest.raises(ValueError, match="betas"):
        cls(_randn_params(), betas=betas)


def _trained(cls=FusedAdam):
    ps = _randn_params()
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
    with pytest.raises(ValueError, match="[Nn]othing was loaded"):
        opt.load_state_dict(bad)
    after = opt.state_dict()
    for k, s in before["state"].items():
        for n, v in s.items():
            assert torch.equal(v, after["state"][k][n]), (k, n)


BY_NAME = {
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
    (("state", 0, "step"), torch.tensor(-5.0), r"\[0\]\['step'\]=-5.0"),
    (("state", 0, "step"), 2.5, r"\[0\]\['step'\]=2.5"),
    (("param_groups", 0, "lr"), float("nan"), r"param_groups\[0\]\['lr'\]=nan"),
    (("param_groups", 0, "eps"), -1e-8, r"param_groups\[0\]\['eps'\]"),
    (("param_groups", 0, "betas"), (0.9, 1.5), r"param_groups\[0\]\['betas'\]"),
    (("state", 1, "exp_avg_sq"), lambda t: -t - 1, r"\['exp_avg_sq'\] holds"),
    (("state", 1, "exp_avg"), lambda t: t * float("nan"), r"\['exp_avg'\] holds"),
]


@pytest.mark.parametrize("path, value, message", CORRUPT)
def test_a_corrupt_adam_checkpoint_is_refused_naming_the_entry(path, value, message):
    model = _small_model(torch.float32)
    opt = FusedAdam(model.parameters(), lr=1e-2)
    _train_small(model, opt)
    before = copy.deepcopy(opt.state_dict())
    bad = copy.deepcopy(opt.state_dict())
    _set(bad, path, value)
    with pytest.raises(ValueError, match=message):
        opt.load_state_dict(bad)
    after = opt.state_dict()
    assert after["param_groups"] == before["param_groups"]
    for k, s in before["state"].items():
        assert all(
            torch.equal(torch.as_tensor(v), torch.as_tensor(after["state"][k][n]))
            for n, v in s.items()
        )
    _train_small(model, opt, 1)
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("name", BY_NAME)
def test_every_fused_optimizer_refuses_a_nan_lr_at_construction_and_on_load(name):
    model = _small_model(torch.float32)
    with pytest.raises(ValueError, match="nan"):
        BY_NAME[name](model.parameters()).__class__(model.parameters(), lr=float("nan"))
    opt = BY_NAME[name](model.parameters())
    _train_small(model, opt)
    bad = copy.deepcopy(opt.state_dict())
    bad["param_groups"][0]["lr"] = float("nan")
    with pytest.raises(ValueError, match=r"\['lr'\]=nan"):
        opt.load_state_dict(bad)
    assert opt.param_groups[0]["lr"] == 1e-2
    key = {"adagrad": "sum", "sgd": None}.get(name, "exp_avg_sq")
    if key is not None:
        bad = copy.deepcopy(opt.state_dict())
        bad["state"][0][key] = -bad["state"][0][key] - 1
        with pytest.raises(ValueError, match=rf"\['{key}'\] holds \d+ negative"):
            opt.load_state_dict(bad)
