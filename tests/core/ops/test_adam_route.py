"""The CPU kernel of ``fused_adam_`` hands fp32 tensors of at least ``TORCH_ROUTE_ELEMS``
elements (no masters, bias correction, no loss scale) to PyTorch's fused op and keeps smaller
ones on its multi-tensor walk: the path is observed, and both paths equal
``torch.optim.AdamW/Adam(fused=True)`` bit for bit in one call."""

from __future__ import annotations

import pytest
import torch

import mpnb.core.ops as ops
from mpnb.core.ops.adam import TORCH_ROUTE_ELEMS, cpu_route

TORCH_OP, OURS = "PyTorch's fused op", "mpnb's multi-tensor walk"


@pytest.fixture
def needs_kernels(kernels):
    if not kernels:
        pytest.skip("the routing is the C++ kernel's (MPNB_DISABLE_EXT=1 runs the references)")


@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_route_switches_at_the_threshold(needs_kernels, adam_w_mode):
    """Below the threshold the tensor stays on our walk, from it on PyTorch's op takes it."""
    assert cpu_route(TORCH_ROUTE_ELEMS - 1, adam_w_mode) == OURS
    assert cpu_route(TORCH_ROUTE_ELEMS, adam_w_mode) == TORCH_OP


def _profiled_step(n, **kw):
    from torch.profiler import ProfilerActivity, profile

    w, g, m, v, st = torch.zeros(n), torch.ones(n), torch.zeros(n), torch.zeros(n), torch.zeros(())
    args = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, adam_w_mode=True)
    args |= dict(bias_correction=True) | kw
    masters = [w.clone()] if args.pop("masters", False) else []
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        ops.fused_adam_([w], [g], [m], [v], masters, [st], **args)
    return {e.name for e in prof.events()}


@pytest.mark.parametrize(
    "kw",
    [dict(bias_correction=False), dict(inv_scale=torch.tensor(0.5)), dict(masters=True)],
    ids=["no bias correction", "loss scale", "masters"],
)
def test_calls_pytorch_computes_differently_stay_ours(needs_kernels, kw):
    """A call PyTorch's op would not compute bit for bit is never routed, however large."""
    assert "aten::_fused_adamw_" not in _profiled_step(TORCH_ROUTE_ELEMS, **kw)


@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_mixed_list_equals_torch_fused_bitwise(needs_kernels, adam_w_mode):
    """One call over a routed tensor and small ones (a scalar tail included) equals PyTorch's
    fused optimizer bit for bit over several steps: weights, moments, step counts."""
    sizes = (TORCH_ROUTE_ELEMS, 1003, TORCH_ROUTE_ELEMS + 9, 40003)
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in sizes]
    cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    opt = cls(params, lr=1e-2, weight_decay=0.1, fused=True)
    w = [p.detach().clone() for p in params]
    m, v = [torch.zeros(n) for n in sizes], [torch.zeros(n) for n in sizes]
    st = [torch.tensor(0.0) for _ in sizes]
    for _ in range(3):
        grads = [torch.randn(n, generator=gen) for n in sizes]
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        opt.step()
        ops.fused_adam_(
            w, grads, m, v, [], st, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8,
            weight_decay=0.1, adam_w_mode=adam_w_mode, bias_correction=True,
        )  # fmt: skip
    for i, p in enumerate(params):
        s = opt.state[p]
        assert torch.equal(st[i], s["step"])
        assert torch.equal(m[i], s["exp_avg"]) and torch.equal(v[i], s["exp_avg_sq"])
        assert torch.equal(w[i], p.detach())
