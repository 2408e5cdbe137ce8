"""``mpnb::layer_norm_fwd`` / ``layer_norm_bwd`` (``mpnb/core/ops/layer_norm.py``): the forward is
torch's layer norm with its statistics (the mean and ``rsqrt(var + eps)`` per row), the
backward is autograd's gradient of it, with and without the affine parameters, on the kernel
and on the reference; the kernel's bf16 stores round as torch's conversion, subnormal outputs
included. (What both norm families share: ``test_norm.py``.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.core.ops.conftest import same_bits

M = torch.ops.mpnb
EPS = 1e-5


def _data(dtype, rows=13, cols=300, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, cols, generator=g, dtype=torch.float64) * 2 + 0.5).to(dtype)
    w = (torch.rand(cols, generator=g, dtype=torch.float64) + 0.5).to(dtype)
    b = torch.randn(cols, generator=g, dtype=torch.float64).to(dtype)
    return x, w, b


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("affine", [True, False])
def test_forward_is_torchs_layer_norm_with_its_statistics(op_impl, dtype, affine):
    x, w, b = _data(dtype)
    w, b = (w, b) if affine else (None, None)
    y, mean, invvar = M.layer_norm_fwd(x, [x.shape[1]], w, b, EPS, False, False)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(y, F.layer_norm(x, [x.shape[1]], w, b, EPS), **tol)
    xd = x.double()
    torch.testing.assert_close(mean.double(), xd.mean(1), **tol)
    want = torch.rsqrt(xd.var(1, unbiased=False) + EPS)
    torch.testing.assert_close(invvar.double(), want, **tol)


# memory_efficient recomputes the normalized input from the output and the weight: with a weight
@pytest.mark.parametrize(
    ("memory_efficient", "affine"), [(False, True), (False, False), (True, True)]
)
def test_backward_is_autograds_gradient(op_impl, memory_efficient, affine):
    """fp64: (dx, dw, db) equal autograd's through ``F.layer_norm``; ``memory_efficient``
    recomputes the normalized input from the output, which it saves instead."""
    x, w, b = _data(torch.float64, seed=1)
    w, b = (w, b) if affine else (None, None)
    dy = torch.randn_like(x)
    y, mean, invvar = M.layer_norm_fwd(x, [x.shape[1]], w, b, EPS, memory_efficient, False)
    saved = y if memory_efficient else x
    dx, dw, db = M.layer_norm_bwd(dy, saved, mean, invvar, [x.shape[1]], w, b, memory_efficient)
    leaves = [t.clone().requires_grad_() for t in (x, w, b) if t is not None]
    xs = leaves[0]
    ws, bs = (leaves[1], leaves[2]) if affine else (None, None)
    F.layer_norm(xs, [x.shape[1]], ws, bs, EPS).backward(dy)
    torch.testing.assert_close(dx, xs.grad, rtol=1e-9, atol=1e-10)
    if affine:
        torch.testing.assert_close(dw, ws.grad, rtol=1e-9, atol=1e-10)
        torch.testing.assert_close(db, bs.grad, rtol=1e-9, atol=1e-10)


def test_bf16_outputs_with_subnormal_weights_round_as_torch(compiled):
    """The kernel's bf16 rows equal the fp32 formula rounded by ``Tensor.to``, subnormal
    outputs (from subnormal weights) included."""
    g = torch.Generator().manual_seed(1)
    rows, cols = 64, 1000  # a tail block per row
    x = torch.randn(rows, cols, generator=g).to(torch.bfloat16)
    w = torch.randn(cols, generator=g).to(torch.bfloat16)
    w[:50] = 1e-39  # subnormal weights: subnormal outputs
    y, mean, rstd = M.layer_norm_fwd(x, [cols], w, None, 1e-5, False)
    xf = x.float()
    want = ((xf - mean[:, None]) * rstd[:, None] * w.float()).to(torch.bfloat16)
    assert (want.float()[:, :50] != 0).any()
    same_bits(y, want)
