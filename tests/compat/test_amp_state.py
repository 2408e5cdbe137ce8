"""mpnb.compat.amp_state: Apex's ``amp._amp_state``, a read-only view onto the latest amp handle."""

from __future__ import annotations

import pytest
import torch

from mpnb import amp
from mpnb.compat import amp_state


def _initialized(**kw):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, verbosity=0, **kw)
    return model, opt


def test_amp_state_is_a_view_onto_the_latest_handle():
    model, opt = _initialized(opt_level="O2", loss_scale="dynamic", num_losses=2)
    handle = amp.current_handle()
    state = amp_state._amp_state
    assert state.handle is handle and state.opt_properties is handle.properties
    assert state.opt_properties.opt_level == "O2" and amp_state.opt_properties.opt_level == "O2"
    views = state.loss_scalers
    assert len(views) == 2 and views[0].dynamic is True
    assert views[0].loss_scale() == views[0]._loss_scale == handle.scalers[0].loss_scale()
    assert views[0]._scale_seq_len == handle.scalers[0].scale_window
    # a step that overflows halves the real scale: the view shows it (it is not a copy)
    before = views[0].loss_scale()
    x = torch.randn(2, 4).to(next(model.parameters()).dtype)
    loss = model(x).float().sum() * float("inf")
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    opt.step()  # skipped: the gradients are not finite
    assert views[0].loss_scale() == before / 2 == handle.scalers[0].loss_scale()


def test_amp_state_writes_are_refused_except_the_loss_scale_apex_recipes_set():
    _initialized(opt_level="O1")
    state, handle = amp_state._amp_state, amp.current_handle()
    with pytest.raises(AttributeError, match="read-only.*initialize"):
        state.loss_scalers = []
    with pytest.raises(AttributeError, match="read-only"):
        state.loss_scalers[0].dynamic = False
    # NVIDIA's BERT recipe: amp._amp_state.loss_scalers[0]._loss_scale = 2**20
    state.loss_scalers[0]._loss_scale = 2.0**20
    assert handle.scalers[0].loss_scale() == 2.0**20
    assert float(handle.scalers[0].inv_scale) == 2.0**-20  # through the scaler's own API


def test_amp_state_before_initialize_is_an_attribute_error(monkeypatch):
    def never():
        raise ValueError("amp.initialize has not been called yet")

    monkeypatch.setattr(amp_state, "current_handle", never)
    assert not hasattr(amp_state._amp_state, "loss_scalers")  # as Apex's object before init
    with pytest.raises(AttributeError, match="initialize"):
        amp_state.loss_scalers  # noqa: B018
