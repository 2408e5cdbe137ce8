"""Apex's handle-less amp API (:mod:`mpnb.core.amp.frontend`): ``amp.master_params`` in the
everyday recipes of PyTorch's AMP guide (clipping the unscaled grads of a fused optimizer's
masters, the overflow skip kept), and ``amp.load_state_dict``, all or nothing, refusing a
corrupt entry by its key."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from mpnb import amp
from mpnb.optimizers import FusedAdam, FusedSGD
from tests.core.amp._tiny import initialize as _init
from tests.core.amp._tiny import step as _step


def _mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)


@pytest.mark.parametrize("make", [FusedSGD, FusedAdam], ids=["FusedSGD", "FusedAdam"])
def test_clipping_master_params_of_a_fused_optimizer_clips_unscaled_grads(make):
    """Apex's recipe, clip_grad_norm_(amp.master_params(opt)) between scale_loss and step,
    must see the real gradients with a fused optimizer too (it used to see them x 65536)."""
    x, y = _data()
    ref = _mlp()
    nn.functional.mse_loss(ref(x), y).backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)

    m = _mlp()
    m, opt = amp.initialize(
        m,
        make(m.parameters(), lr=0.1),
        opt_level="O1",
        half_dtype=torch.float16,
        loss_scale=2.0**10,
        verbosity=0,
    )
    with amp.scale_loss(nn.functional.mse_loss(m(x), y), opt) as scaled:
        scaled.backward()
    norm = torch.nn.utils.clip_grad_norm_(amp.master_params(opt), 0.5)
    torch.testing.assert_close(norm, ref_norm, rtol=1e-2, atol=0)  # not 1024x larger
    for p, r in zip(m.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-2, atol=1e-4)  # clipped to 0.5
    before = [p.detach().clone() for p in m.parameters()]
    opt.step()
    assert not any(torch.equal(a, b) for a, b in zip(before, m.parameters(), strict=True))
    assert amp.current_handle().scalers[0].loss_scale() == 2.0**10
    assert opt._amp_stash.amp_state.host_syncs == 0  # the step read nothing on the host


def test_master_params_of_a_fused_optimizer_keeps_the_overflow_skip():
    """Unscaled early, an overflowing step is still skipped and the scale backs off."""
    x, y = _data()
    m = _mlp()
    m, opt = amp.initialize(
        m,
        FusedAdam(m.parameters(), lr=0.1),
        opt_level="O1",
        half_dtype=torch.float16,
        verbosity=0,
    )
    before = [p.detach().clone() for p in m.parameters()]
    with amp.scale_loss(nn.functional.mse_loss(m(x), y) * float("inf"), opt) as scaled:
        scaled.backward()
    torch.nn.utils.clip_grad_norm_(amp.master_params(opt), 1.0)
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, m.parameters(), strict=True))
    assert amp.current_handle().scalers[0].loss_scale() == 2.0**15


@pytest.mark.parametrize(
    "key, value",
    [
        ("loss_scale", 0.0),
        ("loss_scale", -4.0),
        ("loss_scale", math.inf),
        ("loss_scale", math.nan),
        ("loss_scale", None),
        ("loss_scale", [65536.0]),
        ("loss_scale", "65536"),
        ("unskipped", 2**40),
        ("unskipped", -1),
        ("unskipped", None),
        ("unskipped", "3"),
    ],
)
def test_load_state_dict_refuses_a_corrupt_entry_naming_the_key(key, value):
    m, opt = _init()
    _step(m, opt)
    before = amp.state_dict()
    bad = amp.state_dict()
    bad["loss_scaler0"][key] = value
    with pytest.raises(ValueError, match=f"loss_scaler0.*{key}"):
        amp.load_state_dict(bad)
    assert amp.state_dict() == before


def test_amp_load_state_dict_changes_nothing_when_one_scaler_is_bad():
    m, opt = _init(num_losses=2)
    _step(m, opt, scale_by=math.inf, loss_id=0)
    before = amp.state_dict()
    state = {
        "loss_scaler0": {"loss_scale": 8.0, "unskipped": 1},
        "loss_scaler1": {"loss_scale": -1.0, "unskipped": 0},
    }
    with pytest.raises(ValueError, match="loss_scaler1"):
        amp.load_state_dict(state)
    assert amp.state_dict() == before  # the first scaler was not overwritten
