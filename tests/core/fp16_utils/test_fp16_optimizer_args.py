"""``FP16_Optimizer``'s ``dynamic_loss_args`` are checked before the optimizer changes."""

from __future__ import annotations

import pytest
import torch

from mpnb.fp16_utils import FP16_Optimizer


def _sgd():
    p = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    return p, torch.optim.SGD([p], lr=0.1)


@pytest.mark.parametrize(
    "args,key",
    [
        ({"init_scal": 2.0**16}, "init_scal"),
        ({"init_scale": 2.0, "scale_windw": 10}, "scale_windw"),
    ],
)
def test_an_unknown_key_lists_the_valid_ones_and_changes_nothing(args, key):
    p, sgd = _sgd()
    with pytest.raises(TypeError, match=key) as e:
        FP16_Optimizer(sgd, dynamic_loss_scale=True, dynamic_loss_args=args)
    for valid in ("init_scale", "scale_factor", "scale_window", "max_skips_at_min"):
        assert valid in str(e.value)
    assert sgd.param_groups[0]["params"][0] is p  # no fp32 master was swapped in


def test_a_close_misspelling_is_named():
    with pytest.raises(TypeError, match="mean 'init_scale'"):
        FP16_Optimizer(_sgd()[1], dynamic_loss_scale=True, dynamic_loss_args={"init_scal": 2.0})


@pytest.mark.parametrize("args", [[2.0**16, 2.0], (2.0**16,), "init_scale", 65536.0])
def test_a_non_dict_names_the_dict_form(args):
    p, sgd = _sgd()
    with pytest.raises(TypeError, match=r"=\{'init_scale'"):
        FP16_Optimizer(sgd, dynamic_loss_scale=True, dynamic_loss_args=args)
    assert sgd.param_groups[0]["params"][0] is p


def test_a_bad_value_is_refused_before_the_optimizer_changes():
    p, sgd = _sgd()
    with pytest.raises(ValueError, match="scale_window"):
        FP16_Optimizer(sgd, dynamic_loss_scale=True, dynamic_loss_args={"scale_window": 0})
    assert sgd.param_groups[0]["params"][0] is p


def test_valid_args_still_reach_the_scaler():
    opt = FP16_Optimizer(
        _sgd()[1],
        dynamic_loss_scale=True,
        dynamic_loss_args={"init_scale": 2.0**10, "scale_window": 7},
        verbose=False,
    )
    assert opt.loss_scaler.cur_scale == 2.0**10 and opt.loss_scaler.scale_window == 7
