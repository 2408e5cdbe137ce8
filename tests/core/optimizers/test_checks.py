"""What the fused optimizers say where torch is silent: each group is checked as it is added.

* a parameter listed twice in one group is updated twice per step (torch and Apex do it):
  one warning that says so and how to fix it; in two groups it is refused with the fix;
* ``eps=0`` gives ``0 / 0 = NaN`` for a parameter whose gradient is zero in every optimizer
  that divides by ``sqrt(v) + eps``: one warning; a negative ``eps`` (or lr...) is refused,
  in the constructor and in ``add_param_group`` alike;
* Apex's ``amp_C.multi_tensor_adam`` (and the other Adam/LAMB/NovoGrad kernels) with
  ``step=0`` and bias correction divide by ``1 - beta**0 = 0``: refused, nothing written.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from mpnb import amp_C
from mpnb import optimizers as O
from mpnb.core.optimizers._checks import DuplicateParameterWarning, ZeroEpsWarning

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
    with pytest.raises(ValueError, match="param group 1.*already in param group 0"):
        _make(cls, [{"params": [p, q]}, {"params": [q]}])
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
