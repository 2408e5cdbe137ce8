"""The Triton layer norm launchers (``mpnb/core/ops/triton/layer_norm.py``): what they return
and what they refuse; the numerics are the norm kernels' (test_norm.py, test_norm_configs.py)."""

from __future__ import annotations

import pytest
import torch

from .triton_cases import kernel


def test_forward_returns_the_output_and_fp32_row_statistics(device):
    x = torch.randn(3, 5, 8, device=device).bfloat16()
    y, mean, invvar = kernel("layer_norm_fwd")(x, [8], None, None, 1e-5)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    assert mean.dtype == invvar.dtype == torch.float32 and mean.shape == (15,)
    torch.testing.assert_close(mean.cpu(), x.float().cpu().reshape(15, 8).mean(1))


def test_refuses_bad_shapes(device):
    x = torch.ones(2, 3, 4, device=device)
    with pytest.raises(ValueError, match="normalized_shape"):
        kernel("layer_norm_fwd")(x, [3], None, None, 1e-5)
    with pytest.raises(TypeError, match="float32 weights"):
        kernel("layer_norm_fwd")(x.half(), [4], torch.ones(4, device=device).double(), None, 1e-5)
