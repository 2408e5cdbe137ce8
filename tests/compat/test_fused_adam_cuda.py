"""mpnb.compat.fused_adam_cuda: the ``fused_adam_cuda`` extension of ``--deprecated_fused_adam``
Apex builds, against its kernel written out in Python floats."""

from __future__ import annotations

import math

import pytest
import torch

from mpnb.compat import fused_adam_cuda


def _apex_kernel(p, m, v, g, lr, b1, b2, eps, scale, step, mode, bc, decay):
    """Apex's fused_adam_cuda kernel, element by element in Python floats."""
    size = lr * math.sqrt(1 - b2**step) / (1 - b1**step) if bc else lr
    out = []
    for pi, mi, vi, gi in zip(p, m, v, g, strict=True):
        gi = gi / scale
        mi = b1 * mi + (1 - b1) * gi
        vi = b2 * vi + (1 - b2) * gi * gi
        denom = math.sqrt(vi + eps) if mode == 0 else math.sqrt(vi) + eps
        out.append((pi - size * (mi / denom + decay * pi), mi, vi))
    return [list(col) for col in zip(*out, strict=True)]


@pytest.mark.parametrize("mode", [0, 1])
@pytest.mark.parametrize("bias_correction", [0, 1])
def test_fused_adam_cuda_adam_matches_apexs_kernel(mode, bias_correction):
    torch.manual_seed(1)
    p, m, v = torch.randn(7), torch.randn(7) * 0.1, torch.rand(7) * 0.01
    want = [p.tolist(), m.tolist(), v.tolist()]
    copy = torch.empty(7, dtype=torch.float16)
    for step in (1, 2, 3):
        g = (torch.randn(7) * 128).half()
        args = (1e-2, 0.9, 0.999, 1e-6, 128.0, step, mode, bias_correction, 0.01)
        want = _apex_kernel(*want, g.float().tolist(), *args)
        fused_adam_cuda.adam(p, copy, m, v, g, *args)
    for got, w in zip((p, m, v), want, strict=True):
        torch.testing.assert_close(got, torch.tensor(w), rtol=2e-6, atol=1e-7)
    assert torch.equal(copy, p.half())  # the fp16 model copy gets the new values


def test_fused_adam_cuda_approaches_torch_adam_as_eps_vanishes():
    """Without eps and decay, Apex's old kernel is Adam: compare with torch.optim.Adam."""
    torch.manual_seed(2)
    p = torch.randn(10)
    q = p.clone().requires_grad_()
    ref = torch.optim.Adam([q], lr=1e-3, eps=1e-30)
    m, v = torch.zeros(10), torch.zeros(10)
    for step in range(1, 4):
        g = torch.randn(10)
        q.grad = g.clone()
        ref.step()
        fused_adam_cuda.adam(
            p, torch.empty(0), m, v, g, 1e-3, 0.9, 0.999, 1e-30, 1.0, step, 1, 1, 0
        )
    torch.testing.assert_close(p, q.detach(), rtol=1e-6, atol=1e-7)


def test_fused_adam_cuda_adam_mt_honours_the_noop_flag_and_checks_its_lists():
    p, m, v, g = torch.ones(3), torch.zeros(3), torch.zeros(3), torch.ones(3)
    args = (1e-2, 0.9, 0.999, 1e-8, 1.0, 1, 1, 1, 0.0)
    fused_adam_cuda.adam_mt(2048, torch.ones(1, dtype=torch.int32), [[p], [m], [v], [g]], *args)
    assert torch.equal(p, torch.ones(3))  # skipped
    fused_adam_cuda.adam_mt(2048, torch.zeros(1, dtype=torch.int32), [[p], [m], [v], [g]], *args)
    assert (p < 1).all()
    with pytest.raises(ValueError, match="4 or 5 tensor lists"):
        fused_adam_cuda.adam_mt(2048, torch.zeros(1), [[p], [m]], *args)
    with pytest.raises(ValueError, match="moments and gradient"):
        fused_adam_cuda.adam(p, torch.empty(0), m, v, torch.ones(4), *args)
