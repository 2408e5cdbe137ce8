"""A loss scale float32 cannot hold (with a finite inverse) is refused with the range and the
usual choice; the collapse error at a min_loss_scale floor says to lower the floor."""

from __future__ import annotations

import warnings

import pytest
import torch

from mpnb import amp
from mpnb.core.amp import LossScaleCollapseError, LossScaler


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 2))


@pytest.mark.parametrize(
    "kw, says",
    [
        (dict(loss_scale=2**200), "loss_scale=1.60694e+60 cannot be stored in float32"),
        (dict(loss_scale=1e-45), "loss_scale=1e-45 has an infinite float32 inverse"),
        (dict(loss_scale=dict(min_loss_scale=1e-45)), "min_loss_scale=1e-45 has an infinite"),
        (dict(loss_scale=dict(max_loss_scale=1e39)), "max_loss_scale=1e+39 cannot be stored"),
        (dict(min_loss_scale=1e-45), "min_loss_scale=1e-45 has an infinite"),
    ],
)
def test_initialize_refuses_a_scale_float32_cannot_hold(kw, says):
    """2**200 raised torch's raw 'value cannot be converted' error; 1e-45 was accepted and
    its inverse (inf) turned the O2 master weights into NaN on the first step."""
    m = _net()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    before = [p.detach().clone() for p in m.parameters()]
    with pytest.raises(ValueError) as e:
        amp.initialize(m, opt, opt_level="O2", half_dtype=torch.float16, verbosity=0, **kw)
    msg = str(e.value)
    assert says in msg and "must lie in [1.18e-38, 3.4e+38]" in msg and "'dynamic'" in msg
    assert all(p.dtype == torch.float32 for p in m.parameters())  # the model is untouched
    assert all(torch.equal(a, b) for a, b in zip(before, m.parameters(), strict=True))


@pytest.mark.parametrize("scale", [2**200, 1e-45, 1e39])
def test_the_scaler_itself_refuses_it(scale):
    with pytest.raises(ValueError, match="a loss scale must lie in"):
        LossScaler(scale)


def test_the_edges_of_the_range_work():
    for scale in (torch.finfo(torch.float32).tiny, 2.0**127):
        s = LossScaler(scale)
        assert torch.isfinite(s.scale).all() and torch.isfinite(s.inv_scale).all()


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
    assert "at or below 65536 (min_loss_scale" in msg
    assert "the floor itself may make them overflow" in msg and "Lower min_loss_scale" in msg
    assert "non-finite even unscaled" not in msg


def test_without_a_floor_the_collapse_message_is_unchanged():
    s = LossScaler("dynamic", max_skips_at_min=2)
    s.scale.fill_(1.0)  # at the floor: skipped steps count
    s.note_step(torch.ones(1), skip=True)
    s.watch()
    s.note_step(torch.ones(1), skip=True)
    with pytest.raises(LossScaleCollapseError, match="non-finite even unscaled"):
        s.watch()
