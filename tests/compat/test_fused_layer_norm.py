"""mpnb.compat.fused_layer_norm: apex.normalization.fused_layer_norm's Function names."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mpnb.compat import fused_layer_norm as fln


def test_function_names_apply_the_differentiable_ops():
    torch.manual_seed(4)
    x = torch.randn(4, 16, requires_grad=True)
    w, b = torch.rand(16, requires_grad=True), torch.randn(16, requires_grad=True)
    y = fln.FusedLayerNormAffineFunction.apply(x, w, b, (16,), 1e-5)
    y.sum().backward()
    x2, w2, b2 = (t.detach().clone().requires_grad_() for t in (x, w, b))
    F.layer_norm(x2, (16,), w2, b2, 1e-5).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w.grad, w2.grad, rtol=1e-5, atol=1e-5)
    r = fln.FusedRMSNormAffineFunction.apply(x.detach(), w.detach(), (16,), 1e-5)
    torch.testing.assert_close(r, F.rms_norm(x.detach(), (16,), w.detach(), 1e-5))
    half = x.detach().bfloat16()
    mixed = fln.FusedLayerNormAffineMixedDtypesFunction.apply(half, w, b, (16,), 1e-5)
    assert mixed.dtype == torch.bfloat16  # the input's dtype, as mpnb.normalization's
    plain = fln.FusedLayerNormFunction.apply(x.detach(), (16,), 1e-5)
    torch.testing.assert_close(plain, F.layer_norm(x.detach(), (16,), eps=1e-5))
    assert isinstance(fln.MixedFusedLayerNorm(16), torch.nn.Module)
