"""``mpnb::rms_norm_fwd`` / ``rms_norm_bwd`` (``mpnb/core/ops/rms_norm.py``): the forward is
``x * rsqrt(mean(x^2) + eps) * w`` with ``invvar = rsqrt(mean(x^2) + eps)`` per row, the
backward autograd's gradient of it, with and without a weight, on the kernel and on the
reference. (What both norm families share: ``test_norm.py``.)"""

from __future__ import annotations

import pytest
import torch

M = torch.ops.mpnb
EPS = 1e-5


def _rms(x, w):
    y = x * torch.rsqrt((x * x).mean(-1, keepdim=True) + EPS)
    return y if w is None else y * w


def _data(dtype, rows=13, cols=300, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, cols, generator=g, dtype=torch.float64) * 2 + 0.5).to(dtype)
    w = (torch.rand(cols, generator=g, dtype=torch.float64) + 0.5).to(dtype)
    return x, w


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("weighted", [True, False])
def test_forward_is_the_rms_formula(op_impl, dtype, weighted):
    x, w = _data(dtype)
    w = w if weighted else None
    y, invvar = M.rms_norm_fwd(x, [x.shape[1]], w, EPS, False)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
    xd = x.double()
    torch.testing.assert_close(y.double(), _rms(xd, None if w is None else w.double()), **tol)
    torch.testing.assert_close(invvar.double(), torch.rsqrt((xd * xd).mean(1) + EPS), **tol)
    assert y.dtype == dtype and invvar.shape == (x.shape[0],)


# memory_efficient recomputes the normalized input from the output and the weight: with a weight
@pytest.mark.parametrize(
    ("memory_efficient", "weighted"), [(False, True), (False, False), (True, True)]
)
def test_backward_is_autograds_gradient(op_impl, memory_efficient, weighted):
    """fp64: (dx, dw) equal autograd's through the formula; ``memory_efficient`` recomputes
    the normalized input from the output (``y / w``), which it saves instead."""
    x, w = _data(torch.float64, seed=1)
    w = w if weighted else None
    dy = torch.randn_like(x)
    y, invvar = M.rms_norm_fwd(x, [x.shape[1]], w, EPS, memory_efficient)
    saved = y if memory_efficient else x
    dx, dw = M.rms_norm_bwd(dy, saved, invvar, [x.shape[1]], w, memory_efficient)
    xs = x.clone().requires_grad_()
    ws = None if w is None else w.clone().requires_grad_()
    _rms(xs, ws).backward(dy)
    torch.testing.assert_close(dx, xs.grad, rtol=1e-9, atol=1e-10)
    if weighted:
        torch.testing.assert_close(dw, ws.grad, rtol=1e-9, atol=1e-10)
    else:
        assert dw.numel() == 0  # no weight, an empty gradient
