"""The Triton SGD kernel (``mpnb/core/ops/triton/sgd.py``) beyond the steps every optimizer
kernel shares (test_optim.py): half momentum buffers, as torch.optim.SGD keeps them."""

from __future__ import annotations

import pytest
import torch

from .test_optim import BF16, F16, REFERENCES, SGD, _args, _state
from .triton_cases import close, kernel, on


@pytest.mark.parametrize("stepwise", [False, True])
@pytest.mark.parametrize("half", [BF16, F16])
@pytest.mark.parametrize("opts", SGD[1:], ids=["momentum", "nesterov", "wd_after"])
def test_sgd_half_momentum_buffers_match_reference(device, ulps, half, opts, stepwise):
    """Half params without masters may keep their momentum buffers in their own dtype
    (torch.optim.SGD's and Apex's): computed in fp32 and stored rounded, or with every
    operation rounded to the param dtype (``stepwise``, torch.optim.SGD's ops), as the
    reference."""
    base = _state(half, half, False, seed=5)
    base[3] = [[m.to(half) for m in base[3][0]], base[3][1]]
    out = []
    for fn, dev in ((kernel("fused_sgd_"), device), (REFERENCES["fused_sgd_"], "cpu")):
        st = on(dev, base)
        fn(
            **_args("fused_sgd_", st, opts, torch.tensor([0.5], device=dev), None),
            stepwise=stepwise,
        )
        out.append(st)
    got, want = out
    assert got[3][0][0].dtype == half
    close(got[3][0], want[3][0], 1.0)
    close(got[0], want[0], 1.0)
    with pytest.raises(TypeError, match="momentum buffers are"):
        st = on(device, _state(half, half, True))
        st[3] = [[m.to(half) for m in st[3][0]], st[3][1]]
        kernel("fused_sgd_")(**_args("fused_sgd_", st, opts, None, None))


def test_a_momentum_step_after_a_plain_one_checks_its_buffers(device):
    """The per-tensor guard is planned per set of non-empty lists and per momentum: a step with
    momentum after one without still pairs the buffers with the params."""
    p = [torch.randn(5, device=device), torch.randn(9000, device=device)]
    g = [torch.randn_like(t) for t in p]
    kernel("fused_sgd_")(p, g, [], [], [], 0.1)  # no momentum: no buffers read
    short = [torch.zeros(5, device=device), torch.zeros(10, device=device)]
    with pytest.raises(ValueError, match="elements"):
        kernel("fused_sgd_")(p, g, short, [], [True, True], 0.1, 0.9)


def test_stepwise_alphas_keep_the_sign_of_zero(triton_kernels):
    """The rounded alphas are kept per value; 0.0 and -0.0 are equal keys of a dict but not the
    same alpha (the sign of a zero reaches the sum's)."""
    from mpnb.core.ops.triton import sgd

    for dtype in (F16, BF16):
        assert str(sgd._alphas(dtype, (0.0, -0.0))) == "(0.0, -0.0)"
        assert str(sgd._alphas(dtype, (-0.0, 0.0))) == "(-0.0, 0.0)"
        assert sgd._alphas(dtype, (0.1,)) == (float(torch.tensor(0.1).to(dtype)),)
    xs = (-0.1, 0.9, -0.0, 1e-4)  # fp32 otherwise, the four in one pass
    fp32 = sgd._ALPHAS.unpack(sgd._ALPHAS.pack(*xs))
    assert str(fp32) == str(tuple(float(torch.tensor(x)) for x in xs))
