"""A norm's ``eps`` must be a finite number >= 0: a negative one (``FusedLayerNorm(eps=-1)``)
made ``var + eps`` negative for some rows and the output NaN. Every module refuses it when it
is built, every functional form and op when it is called, naming ``eps`` and the fix.
"""

from __future__ import annotations

import pytest
import torch

import mpnb.core.ops as ops
from mpnb import normalization as N

BAD = [-1.0, -1e-12, float("nan"), float("inf")]


@pytest.mark.parametrize("eps", BAD)
@pytest.mark.parametrize(
    "cls", [N.FusedLayerNorm, N.FusedRMSNorm, N.MixedFusedLayerNorm, N.MixedFusedRMSNorm]
)
def test_modules_refuse_a_bad_eps_when_built(cls, eps):
    with pytest.raises(ValueError, match=r"eps=.*must be a finite number >= 0.*1e-5"):
        cls(8, eps=eps)


def _calls(x, w, b, eps):
    return {
        "fused_layer_norm": lambda: N.fused_layer_norm(x, [8], eps),
        "fused_layer_norm_affine": lambda: N.fused_layer_norm_affine(x, w, b, [8], eps),
        "mixed_dtype_fused_layer_norm_affine": lambda: N.mixed_dtype_fused_layer_norm_affine(
            x, w, b, [8], eps
        ),
        "fused_rms_norm": lambda: N.fused_rms_norm(x, [8], eps),
        "fused_rms_norm_affine": lambda: N.fused_rms_norm_affine(x, w, [8], eps),
        "mixed_dtype_fused_rms_norm_affine": lambda: N.mixed_dtype_fused_rms_norm_affine(
            x, w, [8], eps
        ),
        "layer_norm_fwd": lambda: ops.layer_norm_fwd(x, [8], w, b, eps),
        "rms_norm_fwd": lambda: ops.rms_norm_fwd(x, [8], w, eps),
    }


@pytest.mark.parametrize("eps", BAD)
@pytest.mark.parametrize("name", list(_calls(None, None, None, 0.0)))
def test_functions_and_ops_refuse_a_bad_eps(op_impl, name, eps):
    x, w, b = torch.randn(3, 8), torch.ones(8), torch.zeros(8)
    with pytest.raises(ValueError, match=r"eps=.*must be a finite number >= 0.*1e-5"):
        _calls(x, w, b, eps)[name]()


def test_zero_eps_is_still_accepted():
    x = torch.randn(3, 8)
    y = N.FusedLayerNorm(8, eps=0.0)(x)
    torch.testing.assert_close(y, torch.nn.functional.layer_norm(x, [8], eps=0.0))
    assert torch.isfinite(N.FusedRMSNorm(8, eps=0)(x)).all()
