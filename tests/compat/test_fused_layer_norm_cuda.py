"""mpnb.compat.fused_layer_norm_cuda: the ``fused_layer_norm_cuda`` extension's functions."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mpnb.compat import fused_layer_norm_cuda


@pytest.mark.parametrize("memory_efficient", [False, True])
def test_fused_layer_norm_cuda_forward_backward_match_torch(memory_efficient):
    torch.manual_seed(3)
    x = torch.randn(6, 5, 8, dtype=torch.float64, requires_grad=True)
    w = (torch.rand(5, 8, dtype=torch.float64) + 0.5).requires_grad_()
    b = torch.randn(5, 8, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(6, 5, 8, dtype=torch.float64)
    y_ref = F.layer_norm(x, (5, 8), w, b, 1e-5)
    y_ref.backward(dy)
    y, mean, invvar = fused_layer_norm_cuda.forward_affine(x, (5, 8), w, b, 1e-5)
    assert not y.requires_grad and mean.shape == (6,)  # an extension function: no autograd
    torch.testing.assert_close(y, y_ref.detach())
    saved = y if memory_efficient else x.detach()
    dx, dw, db = fused_layer_norm_cuda.backward_affine(
        dy, mean, invvar, saved, (5, 8), w, b, 1e-5, memory_efficient
    )
    for got, want in ((dx, x.grad), (dw, w.grad), (db, b.grad)):
        torch.testing.assert_close(got, want)
    # RMS norm, with and without a weight
    xr = x.detach().clone().requires_grad_()
    r_ref = F.rms_norm(xr, (5, 8), w.detach(), 1e-5)
    r_ref.backward(dy)
    r, inv = fused_layer_norm_cuda.rms_forward_affine(xr, (5, 8), w.detach(), 1e-5)
    torch.testing.assert_close(r, r_ref.detach())
    saved = r if memory_efficient else xr.detach()
    dxr, _ = fused_layer_norm_cuda.rms_backward_affine(
        dy, inv, saved, (5, 8), w.detach(), 1e-5, memory_efficient
    )
    torch.testing.assert_close(dxr, xr.grad)
    plain, inv0 = fused_layer_norm_cuda.rms_forward(x.detach(), 8, 1e-5)
    torch.testing.assert_close(plain, F.rms_norm(x.detach(), (8,), eps=1e-5))
    g0 = fused_layer_norm_cuda.rms_backward(dy, inv0, x.detach(), 8, 1e-5)
    assert g0.shape == x.shape
