"""FusedLAMB (``mpnb/core/optimizers/fused_lamb.py``): the paper's LAMB (plain PyTorch, fp64
norms) over 100 steps, and the global grad norm: one dtype bucket's is its fp32 norm (whose
square is exact in fp64), several buckets' the fp64 sum of their squares.
"""

from __future__ import annotations

import math

import pytest
import torch

from mpnb.core.ops import multi_tensor_l2norm
from mpnb.optimizers import (
    FusedLAMB,
)
from tests.core.optimizers.test_base import _close, _mlp, _train_mlp


def _lamb_reference_step(params, state, lr, b1, b2, eps, wd, max_norm):
    """LAMB from the paper, plain PyTorch, fp64 norms."""
    gnorm = torch.stack([p.grad.double().norm() for p in params]).norm()
    clip = max(gnorm.item() / max_norm, 1.0)
    for p in params:
        s = state.setdefault(p, {"m": torch.zeros_like(p), "v": torch.zeros_like(p), "t": 0})
        s["t"] += 1
        g = p.grad / clip
        s["m"] = b1 * s["m"] + (1 - b1) * g
        s["v"] = b2 * s["v"] + (1 - b2) * g * g
        u = (s["m"] / (1 - b1 ** s["t"])) / ((s["v"] / (1 - b2 ** s["t"])).sqrt() + eps)
        u = u + wd * p
        pn, un = p.double().norm(), u.double().norm()
        r = (pn / un).item() if pn > 0 and un > 0 else 1.0
        p.sub_(lr * r * u)


def test_lamb_matches_paper_reference_100_steps(kernels):
    a, b = _mlp(), _mlp()
    _train_mlp(a, FusedLAMB(a.parameters(), lr=1e-2, weight_decay=0.01, max_grad_norm=0.5))
    state = {}

    class Ref:
        def zero_grad(self):
            b.zero_grad()

        @torch.no_grad()
        def step(self):
            _lamb_reference_step(list(b.parameters()), state, 1e-2, 0.9, 0.999, 1e-6, 0.01, 0.5)

    _train_mlp(b, Ref())
    _close(a, b, rtol=1e-5)


@pytest.mark.parametrize("magnitude", [1e-30, 1e-3, 1.0, 1e5, 1e18])
def test_lamb_global_norm_of_one_bucket_is_the_fp64_sum_of_its_square(kernels, magnitude):
    # One dtype bucket skips the fp64 sum of squares: an fp32 norm's square is exact in fp64,
    # so its root gives the same bits back. Checked against the sum over several buckets.
    g = torch.Generator().manual_seed(int(math.log10(magnitude)) + 40)
    ps = [torch.nn.Parameter(torch.randn(n, generator=g)) for n in (37, 1000, 5)]
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g) * magnitude
    opt = FusedLAMB(ps, lr=1e-3)
    opt.step()
    norms = [torch.linalg.vector_norm(p.grad.double()).reshape(()) for p in ps]
    one = multi_tensor_l2norm(torch.zeros(1), [p.grad for p in ps], False, None)[0]
    assert torch.equal(opt._global_norm, one.reshape(1))
    fp64 = one.reshape(()).double().square().sqrt().float().reshape(1)
    assert torch.equal(opt._global_norm, fp64)
    assert torch.allclose(
        opt._global_norm.double(), torch.stack(norms).norm().reshape(1), rtol=1e-6
    )

    # Two buckets (fp32 and bf16 params): the fp64 sum of their squares.
    ps2 = [torch.nn.Parameter(torch.randn(64, generator=g)) for _ in range(2)]
    ps2[1] = torch.nn.Parameter(ps2[1].detach().bfloat16())
    for p in ps2:
        p.grad = (torch.randn(64, generator=g) * magnitude).to(p.dtype)
    opt2 = FusedLAMB(ps2, lr=1e-3)
    opt2.step()
    per = [multi_tensor_l2norm(torch.zeros(1), [p.grad], False, None)[0] for p in ps2]
    total = sum(n.reshape(()).double().square() for n in per).sqrt().float().reshape(1)
    assert torch.equal(opt2._global_norm, total)
