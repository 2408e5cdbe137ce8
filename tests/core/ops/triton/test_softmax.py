"""The Triton scaled (masked, causal) softmax against its references (CPU interpreter, or the GPU
when there is one): fp32, fp16, bf16 (and fp64), odd and empty shapes, rows longer than one
block, inf/NaN at random positions."""

from __future__ import annotations

import itertools

import pytest
import torch

import mpnb.core.ops as S

from .triton_cases import bitwise, close, gen, kernel, on, poison, randn

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
HALF_OR_32 = [torch.float32, torch.float16, torch.bfloat16]

# ---- softmax -----------------------------------------------------------------------------

SOFTMAX_SHAPES = [(2, 3, 5, 5), (1, 2, 9, 9), (2, 1, 0, 0), (1, 1, 1, 8200)]


def _row_ulps(ulps, shape):
    # A row's sum is accumulated in another order than the reference's: on rows of thousands
    # of elements its rounding reaches a few more ulps.
    return ulps * (8 if shape[-1] > 1024 else 1)


def _mask(shape, g, heads_broadcast=True):
    b, h, sq, sk = shape
    m = torch.rand(b, 1 if heads_broadcast else h, sq, sk, generator=g) > 0.6
    if m.numel():
        m[0, 0, 0, :] = True  # a fully masked row: uniform, as in Apex
    return m


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SOFTMAX_SHAPES, ids=str)
def test_softmax_forward_matches_reference(device, ulps, dtype, shape):
    ulps = _row_ulps(ulps, shape)
    g = gen(20)
    x = randn(shape, dtype, g, 3.0)
    close(
        kernel("scaled_softmax_fwd")(on(device, x), 0.3),
        S.reference_scaled_softmax_fwd(x, 0.3),
        ulps,
    )
    for bcast, zero in itertools.product((True, False), (False, True)):
        m = _mask(shape, g, bcast)  # with a fully masked row: uniform, or zero (generic)
        got = kernel("scaled_masked_softmax_fwd")(*on(device, [x, m]), 0.3, zero)
        close(got, S.reference_scaled_masked_softmax_fwd(x, m, 0.3, zero), ulps)
        if zero and m.numel():
            assert (got.cpu()[0, 0, 0] == 0).all()
    if shape[-1] == shape[-2]:
        got = kernel("scaled_upper_triang_masked_softmax_fwd")(on(device, x), 0.3)
        want = S.reference_scaled_upper_triang_masked_softmax_fwd(x, 0.3)
        close(got, want, ulps)
        assert (got.cpu().triu(1) == 0).all()  # exactly zero past the diagonal


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SOFTMAX_SHAPES, ids=str)
def test_softmax_backward_matches_reference(device, ulps, dtype, shape):
    ulps = _row_ulps(ulps, shape)
    g = gen(21)
    y = S.reference_scaled_softmax_fwd(randn(shape, dtype, g, 3.0), 1.0)
    dy = randn(shape, dtype, g)
    for upper in (False, True):
        got = kernel("scaled_softmax_bwd")(*on(device, [dy, y]), 0.3, upper)
        close(got, S.reference_scaled_softmax_bwd(dy, y, 0.3, upper), 2 * ulps)


@pytest.mark.parametrize("dtype", HALF_OR_32)
def test_softmax_inf_nan_rows(device, ulps, dtype):
    g = gen(22)
    x = randn((2, 2, 6, 6), dtype, g, 3.0)
    poison([x], g, count=4)
    m = _mask(x.shape, g)
    # The reference's straight-through gradient turns a non-finite *masked* score into NaN
    # (Apex and the kernels replace it by -10000: test_masked_softmax_ignores_masked_scores),
    # so here the masked scores are finite.
    xm = torch.where(m.expand(x.shape), torch.zeros((), dtype=dtype), x)
    close(
        kernel("scaled_softmax_fwd")(on(device, x), 0.5),
        S.reference_scaled_softmax_fwd(x, 0.5),
        ulps,
    )
    close(
        kernel("scaled_masked_softmax_fwd")(*on(device, [xm, m]), 0.5),
        S.reference_scaled_masked_softmax_fwd(xm, m, 0.5),
        ulps,
    )
    close(
        kernel("scaled_upper_triang_masked_softmax_fwd")(on(device, x), 0.5),
        S.reference_scaled_upper_triang_masked_softmax_fwd(x, 0.5),
        ulps,
    )
    dy = randn(x.shape, dtype, g)
    poison([dy], g, count=2)
    y = S.reference_scaled_softmax_fwd(x, 0.5)
    close(
        kernel("scaled_softmax_bwd")(*on(device, [dy, y]), 0.5),
        S.reference_scaled_softmax_bwd(dy, y, 0.5),
        2 * ulps,
    )


def test_masked_softmax_ignores_masked_scores(device):
    """A masked score counts as -10000 whatever it holds, inf and NaN included (Apex's rule)."""
    g = gen(23)
    x = randn((1, 2, 4, 4), torch.float32, g)
    m = _mask(x.shape, g)
    dirty = x.clone()
    dirty[m.expand(x.shape)] = float("nan")
    dirty[0, 0, 0, 0] = float("inf")
    got = kernel("scaled_masked_softmax_fwd")(*on(device, [dirty, m]), 0.7)
    bitwise(got, kernel("scaled_masked_softmax_fwd")(*on(device, [x, m]), 0.7).cpu())
    close(got, S.reference_scaled_masked_softmax_fwd(x, m, 0.7))


def test_softmax_refuses_bad_masks(device):
    x = torch.ones(2, 3, 4, 4, device=device)
    with pytest.raises(ValueError, match="does not fit scores"):
        kernel("scaled_masked_softmax_fwd")(
            x, torch.ones(2, 2, 4, 4, dtype=torch.bool, device=device), 1.0
        )
    with pytest.raises(TypeError, match="bool"):
        kernel("scaled_masked_softmax_fwd")(x, torch.ones(2, 1, 4, 4, device=device), 1.0)
    with pytest.raises(ValueError, match="square"):
        kernel("scaled_upper_triang_masked_softmax_fwd")(torch.ones(2, 3, 4, device=device), 1.0)
