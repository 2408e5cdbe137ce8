"""``AmpHandle`` (:mod:`mpnb.core.amp.handle`): the state of one ``amp.initialize`` call and its
``scale_loss`` blocks."""

from __future__ import annotations

import pytest
import torch

from mpnb import amp
from mpnb.core.amp import AmpHandle
from tests.core.amp._tiny import initialize as _init
from tests.core.amp._tiny import step as _step


def test_a_python_float_loss_gets_a_clear_error():
    m, opt = _init("O1")
    with pytest.raises(TypeError, match="loss.item"):
        with amp.scale_loss(1.5, opt):
            pass
    _step(m, opt)  # nothing was left half-open


def test_the_block_yields_the_scaled_loss_and_leaves_unscaled_grads():
    m, opt = _init("O1", loss_scale=1024.0)
    x = torch.randn(3, 4)
    handle = amp.current_handle()
    assert isinstance(handle, AmpHandle)
    opt.zero_grad()
    loss = m(x).float().pow(2).mean()
    with handle.scale_loss(loss, opt) as scaled:
        torch.testing.assert_close(scaled.reshape(()), loss * 1024.0)
        scaled.backward()
        inside = m[0].weight.grad.clone()  # still scaled inside the block
    outside = m[0].weight.grad
    torch.testing.assert_close(outside * 1024.0, inside)


def test_delay_unscale_keeps_the_grads_scaled():
    m, opt = _init("O1", loss_scale=8.0)
    x = torch.randn(3, 4)
    grads = []
    for delay in (False, True):
        opt.zero_grad()
        with amp.scale_loss(m(x).float().sum(), opt, delay_unscale=delay) as s:
            s.backward()
        grads.append(m[0].weight.grad.clone())
    torch.testing.assert_close(grads[1], grads[0] * 8.0)


def test_a_loss_id_beyond_num_losses_is_refused():
    m, opt = _init("O1", num_losses=2)
    with pytest.raises(ValueError, match="loss_id=2"):
        with amp.scale_loss(m(torch.randn(3, 4)).sum(), opt, loss_id=2):
            pass
    _step(m, opt, loss_id=1)  # the valid ids still work


def test_an_optimizer_of_another_initialize_is_refused():
    _, first_opt = _init("O1")
    m, _ = _init("O1")
    with pytest.raises(ValueError, match="not passed"):
        amp.current_handle().state_of(first_opt)
    with pytest.raises(ValueError, match="not passed"):
        amp.current_handle().state_of(torch.optim.SGD(m.parameters(), lr=0.1))


def test_a_block_that_raises_drops_its_grads_and_the_next_step_runs():
    m, opt = _init("O2")
    before = [p.detach().clone() for p in m.parameters()]
    opt.zero_grad()
    with pytest.raises(RuntimeError, match="boom"):
        with amp.scale_loss(m(torch.randn(3, 4)).float().sum(), opt) as s:
            s.backward()
            raise RuntimeError("boom")
    assert all(p.grad is None or not p.grad.any() for p in m.parameters())
    _step(m, opt)
    assert not all(torch.equal(a, b) for a, b in zip(before, m.parameters(), strict=True))


@pytest.mark.parametrize(
    "state, key",
    [([1.0], "expected the dict"), ({"loss_scaler0": {}, "loss_scaler1": {}}, "num_losses")],
)
def test_load_state_dict_refuses_another_shape_and_changes_nothing(state, key):
    m, opt = _init("O2", num_losses=1)
    _step(m, opt)
    before = amp.current_handle().state_dict()
    with pytest.raises(ValueError, match=key):
        amp.current_handle().load_state_dict(state)
    assert amp.current_handle().state_dict() == before


def test_remove_hooks_ends_o1s_casts():
    m, opt = _init("O1")
    seen = []
    m[0].register_forward_hook(lambda mod, args, out: seen.append(out.dtype))
    assert m(torch.randn(3, 4)).dtype == torch.float32  # outputs cast back to fp32
    handle = amp.current_handle()
    handle.remove_hooks()
    m(torch.randn(3, 4))
    assert seen == [torch.bfloat16, torch.float32] and handle.hooks == []
