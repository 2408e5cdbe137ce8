"""The Triton RMS norm launchers (``mpnb/core/ops/triton/rms_norm.py``): what they return and
what they refuse; the numerics are the norm kernels' (test_norm.py, test_norm_configs.py)."""

from __future__ import annotations

import pytest
import torch

from .triton_cases import kernel


def test_forward_returns_the_output_and_the_fp32_inverse_rms(device):
    x = torch.randn(4, 6, device=device).half()
    y, invvar = kernel("rms_norm_fwd")(x, [6], None, 1e-5)
    assert y.dtype == torch.float16 and invvar.dtype == torch.float32 and invvar.shape == (4,)
    want = x.float().cpu().pow(2).mean(1).add(1e-5).rsqrt()
    torch.testing.assert_close(invvar.cpu(), want)


def test_refuses_a_weight_of_the_wrong_size(device):
    x = torch.ones(2, 3, 4, device=device)
    with pytest.raises(ValueError, match="weight has 3 elements"):
        kernel("rms_norm_fwd")(x, [4], torch.ones(3, device=device), 1e-5)
