"""``mpnb::fused_adagrad_`` (``mpnb/core/ops/adagrad.py``) against ``torch.optim.Adagrad``:
within 2 ulp of its fused op (which contracts some products into fmas), the step counts
exact; on the reference, ``adagrad_w_mode`` decays the weight apart from the sum's step and
``lr_decay`` shrinks the step as ``lr / (1 + (step - 1) * lr_decay)``."""

from __future__ import annotations

import pytest
import torch

import mpnb.core.ops as ops
from tests.core.ops.test_optim import _torch_run


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_fp32_adagrad_within_two_ulp_of_torch_fused_adagrad(kernels, weight_decay):
    """torch.optim.Adagrad(fused=True) contracts some products into fmas that the kernel keeps
    apart: after ten steps sums and weights agree to 2 ulp, the step counts exactly."""
    n = 1003
    h, st = torch.zeros(n), torch.tensor(0.0)

    def ours(w, g, k):
        ops.fused_adagrad_(
            [w],
            [g],
            [h],
            [],
            [st],
            lr=1e-2,
            eps=1e-10,
            weight_decay=weight_decay,
            lr_decay=0.01,
        )

    def make(p):
        return torch.optim.Adagrad(
            [p], lr=1e-2, weight_decay=weight_decay, lr_decay=0.01, fused=True
        )

    opt, p, w = _torch_run(make, ours, n, steps=10)
    s = opt.state[opt.param_groups[0]["params"][0]]
    assert torch.equal(st, s["step"])
    ulp2 = 2 * torch.finfo(torch.float32).eps
    torch.testing.assert_close(h, s["sum"], rtol=ulp2, atol=0.0)
    torch.testing.assert_close(w, p, rtol=ulp2, atol=1e-8)


def _one_step(w0, g, h0, step0, **kw):
    """One ``fused_adagrad_`` step on copies; returns (weight, sum, step)."""
    w, h, st = w0.clone(), h0.clone(), torch.tensor(step0)
    ops.fused_adagrad_([w], [g], [h], [], [st], lr=0.1, eps=1e-10, **kw)
    return w, h, st


@pytest.mark.parametrize("adagrad_w_mode", [False, True])
def test_a_step_is_adagrads_formula(op_impl, adagrad_w_mode):
    """The sum gains g^2 (g with the L2 decay folded in unless ``adagrad_w_mode``), the weight
    moves by lr * g / (sqrt(sum) + eps) with lr decayed by the step count."""
    gen = torch.Generator().manual_seed(3)
    w0, g = torch.randn(257, generator=gen), torch.randn(257, generator=gen)
    h0 = torch.rand(257, generator=gen)
    wd, lr_decay, step0 = 0.05, 0.1, 4.0  # the fifth step: lr / (1 + 4 * 0.1)
    w, h, st = _one_step(
        w0, g, h0, step0, weight_decay=wd, lr_decay=lr_decay, adagrad_w_mode=adagrad_w_mode
    )
    w0d, gd, h0d = w0.double(), g.double(), h0.double()
    lr = 0.1 / (1 + step0 * lr_decay) if not adagrad_w_mode else 0.1
    if adagrad_w_mode:
        hd = h0d + gd * gd
        want = w0d - lr * (gd / (hd.sqrt() + 1e-10) + wd * w0d)
    else:
        gd = gd + wd * w0d
        hd = h0d + gd * gd
        want = w0d - lr * gd / (hd.sqrt() + 1e-10)
    assert st.item() == step0 + 1
    torch.testing.assert_close(h.double(), hd, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(w.double(), want, rtol=1e-5, atol=1e-6)
