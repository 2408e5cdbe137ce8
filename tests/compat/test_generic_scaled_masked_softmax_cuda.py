"""mpnb.compat.generic_scaled_masked_softmax_cuda: Apex's generic masked softmax extension."""

from __future__ import annotations

import torch

from mpnb.compat import generic_scaled_masked_softmax_cuda as ext


def _reference(x, mask, scale):
    y = torch.softmax((x.float() * scale).masked_fill(mask, float("-inf")), dim=-1)
    return torch.nan_to_num(y, nan=0.0).to(x.dtype)  # a fully masked row: zeros


def test_forward_is_the_masked_softmax_with_zero_rows_where_all_is_masked():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 4, 37)
    mask = torch.rand(2, 1, 4, 37) < 0.3
    mask[0, 0, 1] = True  # one row with every position masked
    y = ext.forward(x, mask, 0.5)
    torch.testing.assert_close(y, _reference(x, mask, 0.5))
    assert torch.equal(y[0, :, 1], torch.zeros_like(y[0, :, 1]))


def test_scale_may_be_a_one_element_tensor_as_apex_passes_it():
    torch.manual_seed(1)
    x, mask = torch.randn(1, 2, 3, 8), torch.zeros(1, 1, 3, 8, dtype=torch.bool)
    assert torch.equal(ext.forward(x, mask, torch.tensor([2.0])[0]), ext.forward(x, mask, 2.0))


def test_backward_is_the_softmax_gradient_and_zero_on_masked_rows():
    torch.manual_seed(2)
    x = torch.randn(1, 2, 3, 16, requires_grad=True)
    mask = torch.rand(1, 1, 3, 16) < 0.25
    mask[0, 0, 2] = True
    dy = torch.randn(1, 2, 3, 16)
    y = ext.forward(x.detach(), mask, 0.7)
    dx = ext.backward(dy, y, 0.7)
    z = (x * 0.7).masked_fill(mask, float("-inf")).softmax(-1)
    (expect,) = torch.autograd.grad(z[:, :, :2], x, dy[:, :, :2])
    torch.testing.assert_close(dx[:, :, :2], expect[:, :, :2])
    assert torch.equal(dx[:, :, 2], torch.zeros_like(dx[:, :, 2]))
