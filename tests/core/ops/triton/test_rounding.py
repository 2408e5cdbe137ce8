"""Triton pure-bf16 steps (``fused_adam_bf16_``, ``fused_sgd_bf16_``) against the references:
the same random bits and roundings bitwise, the updates within the optimizer tolerance."""

from __future__ import annotations

import pytest
import torch

from .triton_cases import SIZES, bitwise, close, gen, kernel, on, randn, reference

reference_fused_adam_bf16_ = reference("fused_adam_bf16_")
reference_fused_lamb_bf16_ = reference("fused_lamb_bf16_")
reference_fused_sgd_bf16_ = reference("fused_sgd_bf16_")

BF16 = torch.bfloat16
ROUNDINGS = ("stochastic", "kahan")


def _comps(params, rounding, g):
    if rounding != "kahan":
        return []
    return [randn(p.numel(), BF16, g, 1e-4) for p in params]


@pytest.mark.parametrize("rounding", ROUNDINGS)
def test_rounding_alone_is_bitwise(device, rounding):
    """SGD with lr 1 and no momentum: the new weight ``w - g`` is one exact-rounded fp32
    subtraction on both sides, so the stored bits test the rounding (and the random bits)."""
    g = gen(0)
    params = [randn(n, BF16, g) for n in SIZES]
    grads = [randn(n, torch.float32, g, 1e-3) for n in SIZES]
    grads[-1].view(-1)[:3] = torch.tensor([float("inf"), float("nan"), -float("inf")])
    comps = _comps(params, rounding, g)
    args = [
        params,
        grads,
        [],
        comps,
        [False] * len(SIZES),
        1.0,
        0.0,
        0.0,
        0.0,
        False,
        False,
        rounding,
        1234,
        7,
    ]
    ours = on(device, args[:4])
    kernel("fused_sgd_bf16_")(*ours, *args[4:])
    reference_fused_sgd_bf16_(*args)
    bitwise(ours[0], params)
    bitwise(ours[3], comps)


@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("momentum, nesterov", [(0.9, False), (0.9, True), (0.0, False)])
def test_sgd_bf16_matches_reference(device, ulps, rounding, momentum, nesterov):
    g = gen(1)
    params = [randn(n, BF16, g) for n in SIZES]
    grads = [randn(n, BF16, g) for n in SIZES]
    bufs = [randn(n, torch.float32, g) for n in SIZES] if momentum else []
    comps = _comps(params, rounding, g)
    first = [k % 2 == 0 for k in range(len(SIZES))]
    inv = torch.full((1,), 0.5)
    args = [
        params,
        grads,
        bufs,
        comps,
        first,
        0.1,
        momentum,
        0.0,
        0.01,
        nesterov,
        False,
        rounding,
        5,
        2,
        inv,
        torch.zeros(1),
    ]
    ours = on(device, args[:4])
    kernel("fused_sgd_bf16_")(*ours, *args[4:14], *on(device, args[14:]))
    reference_fused_sgd_bf16_(*args)
    close(ours[2], bufs, ulps)
    close(ours[0], params, 1.0)  # an fp32 ulp apart may round to the next bf16
    close(ours[3], comps, 1.0)


@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("adam_w", [True, False])
def test_adam_bf16_matches_reference(device, ulps, rounding, adam_w):
    g = gen(2)
    params = [randn(n, BF16, g) for n in SIZES]
    grads = [randn(n, torch.float32, g) for n in SIZES]
    m = [randn(n, torch.float32, g, 0.1) for n in SIZES]
    v = [torch.rand(n, generator=g) * 0.1 for n in SIZES]
    steps = [torch.tensor(float(k + 2)) for k in range(len(SIZES))]
    comps = _comps(params, rounding, g)
    args = [
        params,
        grads,
        m,
        v,
        comps,
        steps,
        1e-3,
        0.9,
        0.999,
        1e-8,
        0.01,
        adam_w,
        True,
        rounding,
        9,
        3,
    ]
    ours = on(device, args[:6])
    kernel("fused_adam_bf16_")(*ours, *args[6:])
    reference_fused_adam_bf16_(*args)
    close(ours[2], m, ulps)
    close(ours[3], v, ulps)
    bitwise(ours[5], steps)
    close(ours[0], params, 1.0)
    close(ours[4], comps, 1.0)


def test_flagged_step_writes_nothing(device):
    g = gen(3)
    params = [randn(n, BF16, g) for n in SIZES]
    before = [p.clone() for p in params]
    grads = [randn(n, torch.float32, g) for n in SIZES]
    m = [torch.zeros(n) for n in SIZES]
    v = [torch.zeros(n) for n in SIZES]
    steps = [torch.tensor(1.0) for _ in SIZES]
    ours = on(device, [params, grads, m, v, [], steps])
    kernel("fused_adam_bf16_")(
        *ours,
        1e-3,
        0.9,
        0.999,
        1e-8,
        0.0,
        True,
        True,
        "stochastic",
        1,
        1,
        None,
        on(device, torch.ones(1)),
    )
    bitwise(ours[0], before)
    bitwise(ours[5], steps)


def test_errors_are_the_references(device):
    p = [torch.zeros(4, device=device)]
    with pytest.raises(TypeError, match="bfloat16 params"):
        kernel("fused_sgd_bf16_")(
            p, p, [], [], [False], 0.1, 0.0, 0.0, 0.0, False, False, "stochastic", 0, 0
        )


@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("wd, nvlamb", [(0.01, False), (0.0, True), (0.0, False)])
def test_lamb_bf16_matches_reference(device, ulps, rounding, wd, nvlamb):
    g = gen(4)
    params = [randn(n, BF16, g) for n in SIZES]
    grads = [randn(n, BF16, g) for n in SIZES]
    m = [randn(n, torch.float32, g, 0.1) for n in SIZES]
    v = [torch.rand(n, generator=g) * 0.1 for n in SIZES]
    steps = [torch.tensor(float(k + 2)) for k in range(len(SIZES))]
    comps = _comps(params, rounding, g)
    gnorm = torch.tensor([3.0])
    args = [
        params,
        grads,
        m,
        v,
        comps,
        steps,
        gnorm,
        1e-2,
        0.9,
        0.999,
        1e-6,
        wd,
        True,
        True,
        True,
        1.0,
        nvlamb,
        rounding,
        4,
        6,
    ]
    ours = on(device, args[:7])
    kernel("fused_lamb_bf16_")(*ours, *args[7:])
    reference_fused_lamb_bf16_(*args)
    close(ours[2], m, ulps)
    close(ours[3], v, ulps)
    bitwise(ours[5], steps)
    close(ours[0], params, 1.0)
    close(ours[4], comps, 1.0)
