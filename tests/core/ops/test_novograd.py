"""``mpnb::fused_novograd_`` (``mpnb/core/ops/novograd.py``): a step is NovoGrad's formula, the
second moment one scalar per tensor blended from the grad's L2 norm (``norm_type=2``) or its
max (``norm_type=0``), the first step taking the norm itself unless ``init_zero``; bad norms
are refused, naming the fix. (What every optimizer op shares: ``test_optim.py``; kernel vs
reference on every dtype: ``test_library.py``.)"""

from __future__ import annotations

import pytest
import torch

import mpnb.core.ops as ops

HYPER = dict(lr=1e-2, beta1=0.95, beta2=0.98, eps=1e-8)


def _step(norm_type, init_zero, step0=0.0, v0=0.0, weight_decay=0.0, reg_inside_moment=False):
    """One ``fused_novograd_`` step on a fresh 300-element param; returns the inputs and the
    updated (weight, exp_avg, v, step)."""
    gen = torch.Generator().manual_seed(7)
    w0, g = torch.randn(300, generator=gen), torch.randn(300, generator=gen)
    m0 = torch.randn(300, generator=gen) * 0.1
    w, m, v, st = w0.clone(), m0.clone(), torch.tensor(v0), torch.tensor(step0)
    n = g.norm() if norm_type == 2 else g.abs().max()
    ops.fused_novograd_(
        [w],
        [g],
        [m],
        [v],
        [],
        [st],
        n.reshape(1),
        **HYPER,
        weight_decay=weight_decay,
        reg_inside_moment=reg_inside_moment,
        norm_type=norm_type,
        init_zero=init_zero,
    )
    return (w0, g, m0, n), (w, m, v, st)


def _want(w0, g, m0, v, step, weight_decay=0.0, reg_inside_moment=False):
    """NovoGrad's update in fp64 from the new second moment ``v``."""
    b1, b2, lr, eps = HYPER["beta1"], HYPER["beta2"], HYPER["lr"], HYPER["eps"]
    w0, g, m0 = w0.double(), g.double(), m0.double()
    bc1, bc2 = 1 - b1**step, (1 - b2**step) ** 0.5
    d = v / bc2 + eps
    if reg_inside_moment:
        m = b1 * m0 + (1 - b1) * (g / d + weight_decay * w0)
        return w0 - lr * m / bc1, m
    m = b1 * m0 + (1 - b1) * g
    return w0 - lr * ((m / bc1) / d + weight_decay * w0), m


@pytest.mark.parametrize("norm_type", [0, 2])
def test_the_first_step_takes_the_norm_itself(op_impl, norm_type):
    (w0, g, m0, n), (w, m, v, st) = _step(norm_type, init_zero=False, v0=5.0)
    assert st.item() == 1.0
    assert v.item() == pytest.approx(n.item(), rel=1e-6)  # v0 is ignored on the first step
    want_w, want_m = _want(w0, g, m0, n.item(), 1)
    torch.testing.assert_close(m.double(), want_m, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(w.double(), want_w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("norm_type", [0, 2])
def test_later_steps_blend_the_norm_as_its_type_says(op_impl, norm_type):
    """norm_type 2 blends squares (``sqrt(b2 v^2 + (1 - b2) n^2)``), norm_type 0 the values;
    ``init_zero`` blends from the first step on."""
    b2 = HYPER["beta2"]
    for init_zero, step0 in ((False, 3.0), (True, 0.0)):
        (w0, g, m0, n), (w, m, v, st) = _step(norm_type, init_zero, step0=step0, v0=0.7)
        n = n.item()
        blend = (b2 * 0.49 + (1 - b2) * n * n) ** 0.5 if norm_type == 2 else b2 * 0.7 + (1 - b2) * n
        assert v.item() == pytest.approx(blend, rel=1e-6), (init_zero, step0)
        want_w, _ = _want(w0, g, m0, blend, step0 + 1)
        torch.testing.assert_close(w.double(), want_w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("reg_inside_moment", [False, True])
def test_weight_decay_enters_the_update_or_the_moment(op_impl, reg_inside_moment):
    (w0, g, m0, n), (w, m, v, st) = _step(
        2, False, step0=2.0, v0=0.7, weight_decay=0.1, reg_inside_moment=reg_inside_moment
    )
    want_w, want_m = _want(w0, g, m0, v.item(), 3, 0.1, reg_inside_moment)
    torch.testing.assert_close(m.double(), want_m, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(w.double(), want_w, rtol=1e-5, atol=1e-6)


BAD = {
    "novograd norm_type": (
        ValueError,
        "pass 0 or 2",
        lambda: ops.fused_novograd_(
            [torch.randn(4)],
            [torch.randn(4)],
            [torch.zeros(4)],
            [torch.tensor(0.0)],
            [],
            [torch.tensor(0.0)],
            torch.ones(1),
            lr=1e-2,
            beta1=0.9,
            beta2=0.98,
            eps=1e-8,
            weight_decay=0.0,
            norm_type=1,
        ),
    ),
    "novograd grad_norms": (
        ValueError,
        "one norm per param",
        lambda: ops.fused_novograd_(
            [torch.randn(4)],
            [torch.randn(4)],
            [torch.zeros(4)],
            [torch.tensor(0.0)],
            [],
            [torch.tensor(0.0)],
            torch.ones(3),
            lr=1e-2,
            beta1=0.9,
            beta2=0.98,
            eps=1e-8,
            weight_decay=0.0,
        ),
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_arguments_raise_errors_that_name_the_fix(op_impl, case):
    """The kernel and the reference raise the same exception type, naming the fix."""
    exc, fix, call = BAD[case]
    with pytest.raises(exc, match=fix):
        call()
