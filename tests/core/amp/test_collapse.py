"""What a loss scaler says when steps keep overflowing (:mod:`mpnb.core.amp._collapse`):
the static-scale warning (the step is not skipped, as in Apex) and the collapse error, whose
advice fits the run (the real floor, bf16 offered to fp16 runs only, a ``min_loss_scale``
floor to lower)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from mpnb import amp
from mpnb.core.amp import LossScaleCollapseError, LossScaler, StaticScaleOverflowWarning
from mpnb.optimizers import FusedSGD
from tests.core.amp._tiny import initialize as _init
from tests.core.amp._tiny import net as _net
from tests.core.amp._tiny import step as _step


@pytest.mark.parametrize("opt_cls", [torch.optim.SGD, FusedSGD])
def test_a_static_scale_steps_through_inf_with_a_warning_for_every_optimizer_kind(opt_cls):
    """Apex's rule for a static scale (O3's default): the step is not skipped; amp warns."""
    m, opt = _init("O3", opt_cls)
    with pytest.warns(StaticScaleOverflowWarning, match="not skipped"):
        _step(m, opt, scale_by=math.inf)
    assert not torch.isfinite(m[0].weight).all()  # as with Apex, whatever the optimizer


def test_the_collapse_message_fits_the_run():
    m, opt = _init("O2", min_loss_scale=4.0, loss_scale="dynamic")
    amp.current_handle().scalers[0].max_skips_at_min = 3
    with pytest.raises(LossScaleCollapseError) as e:
        for _ in range(40):
            _step(m, opt, scale_by=math.nan)
    msg = str(e.value)
    assert "below 4 (min_loss_scale" in msg  # the real floor
    assert "bfloat16" not in msg  # it runs bf16 already
    assert "max_skips_at_min=None" in msg and "min_loss_scale=" in msg
    amp.LossScaleRule(max_skips_at_min=None)  # the advised argument exists


def test_the_collapse_message_suggests_bf16_only_to_fp16_runs():
    m = _net()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m, opt = amp.initialize(m, opt, opt_level="O1", half_dtype=torch.float16, verbosity=0)
    amp.current_handle().scalers[0].max_skips_at_min = 2
    with pytest.raises(LossScaleCollapseError, match="below 1 .*torch.bfloat16"):
        for _ in range(40):
            _step(m, opt, scale_by=math.nan)


def test_the_collapse_at_a_min_loss_scale_floor_says_to_lower_the_floor():
    """Gradients that are finite unscaled but overflow fp16 at the floor: the message used to
    say they are non-finite even unscaled; the floor itself is the cause, so say to lower it."""
    m = _net()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m, opt = amp.initialize(
            m,
            opt,
            opt_level="O2",
            half_dtype=torch.float16,
            verbosity=0,
            loss_scale=dict(min_loss_scale=2.0**16, max_skips_at_min=3),
        )
    x = torch.full((3, 4), 100.0)
    with pytest.raises(LossScaleCollapseError) as e:
        for _ in range(20):
            opt.zero_grad()
            loss = m(x).float().pow(2).mean()
            assert torch.isfinite(loss)  # finite unscaled
            with amp.scale_loss(loss, opt) as s:
                s.backward()
            opt.step()
    msg = str(e.value)
    assert "below 65536 (min_loss" in msg
    assert "floor itself" in msg and "Lower min_loss_scale" in msg
    assert "non-finite even unscaled" not in msg


def test_without_a_floor_the_collapse_message_is_unchanged():
    s = LossScaler("dynamic", max_skips_at_min=2)
    s.scale.fill_(1.0)  # at the floor: skipped steps count
    s.note_step(torch.ones(1), skip=True)
    s.watch()
    s.note_step(torch.ones(1), skip=True)
    with pytest.raises(LossScaleCollapseError, match="non-finite even unscaled"):
        s.watch()
