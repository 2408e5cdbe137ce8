"""Fused scaled (masked) softmax: kernels against references, torch.softmax and SDPA, every
mask shape Apex accepts, autograd, gradcheck, opcheck and errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mpnb.core.ops import softmax_ops as ops
from mpnb.transformer import AttnMaskType
from mpnb.transformer.functional import (
    FusedScaleMaskSoftmax,
    attention_mask_func,
    generic_scaled_masked_softmax,
    scaled_masked_softmax,
    scaled_softmax,
    scaled_upper_triang_masked_softmax,
)

DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
TOL = {
    torch.float32: dict(rtol=1e-5, atol=1e-6),
    torch.float64: dict(rtol=1e-10, atol=1e-12),
    torch.float16: dict(rtol=2e-3, atol=1e-3),  # backward uses the rounded y, as Apex
    torch.bfloat16: dict(rtol=1.6e-2, atol=8e-3),
}


def ids(x):
    return str(x).replace("torch.", "")


def scores(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * 3).to(dtype)


def fwd_bwd(fn, x, dy):
    x = x.detach().clone().requires_grad_(True)
    y = fn(x)
    y.backward(dy)
    return y.detach(), x.grad


def close(a, b, dtype):
    for u, v in zip(a, b, strict=True):
        torch.testing.assert_close(u.double(), v.double(), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("sk", (1, 3, 1000, 4097))
def test_scaled_softmax(kernels, dtype, sk):
    x, dy = scores((2, 3, 4, sk), dtype), scores((2, 3, 4, sk), dtype, 1)
    mine = fwd_bwd(lambda x: scaled_softmax(x, 0.3), x, dy)
    ref = fwd_bwd(lambda x: ops.reference_scaled_softmax_fwd(x, 0.3), x, dy)
    close(mine, ref, dtype)


MASK_SHAPES = [(2, 1, 5, 0), (1, 1, 5, 0), (2, 3, 5, 0), (1, 3, 5, 0)]


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("sk", (1, 3, 1000, 4097))
@pytest.mark.parametrize("mshape", MASK_SHAPES, ids=str)
@pytest.mark.parametrize("mdtype", (torch.bool, torch.uint8), ids=ids)
def test_scaled_masked_softmax(kernels, dtype, sk, mshape, mdtype):
    x, dy = scores((2, 3, 5, sk), dtype), scores((2, 3, 5, sk), dtype, 1)
    g = torch.Generator().manual_seed(2)
    mask = torch.rand(mshape[:3] + (sk,), generator=g) > 0.6
    mask[0, 0, 1] = True  # a fully masked row: uniform, as Apex
    mask = mask.to(mdtype)
    mine = fwd_bwd(lambda x: scaled_masked_softmax(x, mask, 0.5), x, dy)
    ref = fwd_bwd(lambda x: ops.reference_scaled_masked_softmax_fwd(x, mask, 0.5), x, dy)
    close(mine, ref, dtype)
    gen = fwd_bwd(lambda x: generic_scaled_masked_softmax(x, mask, 0.5), x, dy)
    close(gen, ref, dtype)
    # the composite expression users write by hand
    expr = torch.softmax((x.double() * 0.5).masked_fill(mask.bool(), -10000.0), -1)
    torch.testing.assert_close(mine[0].double(), expr, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("sq", (1, 3, 37, 300))
def test_upper_triang(kernels, dtype, sq):
    x, dy = scores((4, sq, sq), dtype), scores((4, sq, sq), dtype, 1)
    mine = fwd_bwd(lambda x: scaled_upper_triang_masked_softmax(x, 0.7), x, dy)
    ref = fwd_bwd(lambda x: ops.reference_scaled_upper_triang_masked_softmax_fwd(x, 0.7), x, dy)
    close(mine, ref, dtype)
    assert (mine[0].triu(1) == 0).all() and (mine[1].triu(1) == 0).all()


def test_fp32_exp_accuracy(kernels):
    # The fp32 kernels use an 8-entry table and a degree-3 polynomial for exp (<= 1.15 ulp,
    # fast_math.h): a few ulp of the fp64 softmax over the whole range exp sees after the max
    # subtraction (down to -87.3).
    x = torch.linspace(-95.0, 0.0, 4 * 777, dtype=torch.float64).view(1, 4, 1, 777)
    x = x[..., torch.randperm(777, generator=torch.Generator().manual_seed(0))]
    x = x.float()
    y = scaled_softmax(x, 1.0).double()
    ref = torch.softmax(x.double(), -1)
    torch.testing.assert_close(y, ref, rtol=4e-7, atol=1e-38)
    # exp of arguments below ln(FLT_MIN) is exactly 0, as for ATen's exp_u20
    assert (y[ref < 1e-38] == 0).all()


def test_fp32_exp_ulp_error(kernels):
    # A row [v, 0] with v < -17: the shift is 0 and 1 + exp(v) rounds to 1 in fp32, so the
    # first output is the kernel's exp(v) itself, unrounded by the division. fast_math.h's
    # table exp is within 1.15 ulp of the correctly rounded exp.
    v = torch.linspace(-87.3, -17.0, 200_003, dtype=torch.float64).float()
    x = torch.stack([v, torch.zeros_like(v)], -1).view(1, 1, -1, 2)
    got = scaled_softmax(x, 1.0)[..., 0].flatten().double()
    ref = torch.exp(v.double())
    ulp = torch.nextafter(ref.float(), torch.tensor(float("inf"))).double() - ref.float().double()
    err = ((got - ref).abs() / ulp).max().item()
    assert err <= 1.2, f"exp error {err:.3f} ulp"


@pytest.mark.parametrize("dtype", (torch.float32, torch.float64), ids=ids)
def test_masked_shift_far_above_row(kernels, dtype):
    # Masked scores far above the unmasked ones (the kernel shifts by the unmasked bound first,
    # then by the exact masked max), negative scales and a fully masked row.
    x = scores((2, 2, 4, 70), dtype)
    mask = torch.zeros(1, 1, 4, 70, dtype=torch.bool)
    mask[..., 10:] = True
    mask[..., 2, :] = True
    x[..., 10:] += 500.0
    x[..., 1, :10] -= 5000.0  # unmasked entries down at -2500: masked -10000 still far below
    for scale in (0.5, -0.5):
        xs = x if scale > 0 else -x
        ref = ops.reference_scaled_masked_softmax_fwd(xs, mask, scale)
        torch.testing.assert_close(scaled_masked_softmax(xs, mask, scale), ref, **TOL[dtype])


def test_non_finite_rows(kernels):
    x = scores((1, 3, 2, 40), torch.float32)
    x[0, 0, 0, 5] = float("nan")
    x[0, 1, 1, 7] = float("inf")
    x[0, 2, 0, 9] = float("-inf")
    ref = ops.reference_scaled_softmax_fwd(x, 0.5)
    torch.testing.assert_close(scaled_softmax(x, 0.5), ref, equal_nan=True, **TOL[torch.float32])


def test_matches_sdpa(kernels):
    q, k, v = (scores((2, 4, 33, 16), torch.float32, s) for s in range(3))
    sm = FusedScaleMaskSoftmax(False, False, AttnMaskType.causal, True, None, True, 16**-0.5)
    out = sm(q @ k.transpose(-1, -2), None) @ v
    torch.testing.assert_close(
        out, F.scaled_dot_product_attention(q, k, v, is_causal=True), rtol=1e-5, atol=1e-5
    )
    pad = torch.zeros(2, 1, 33, 33, dtype=torch.bool)
    pad[..., 30:] = True
    sm = FusedScaleMaskSoftmax(False, False, AttnMaskType.padding, True, None, True, 16**-0.5)
    out = sm(q @ k.transpose(-1, -2), pad) @ v
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=~pad)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=ids)
@pytest.mark.parametrize("kind", [AttnMaskType.padding, AttnMaskType.causal], ids=str)
def test_module_fused_matches_unfused(kernels, dtype, kind):
    x, dy = scores((2, 3, 16, 16), dtype), scores((2, 3, 16, 16), dtype, 1)
    mask = (torch.rand(2, 1, 16, 16) > 0.5) if kind == AttnMaskType.padding else None
    half = dtype != torch.float32
    fused = FusedScaleMaskSoftmax(False, half, kind, True, attention_mask_func, True, 0.25)
    plain = FusedScaleMaskSoftmax(False, half, kind, False, attention_mask_func, True, 0.25)
    close(fwd_bwd(lambda x: fused(x, mask), x, dy), fwd_bwd(lambda x: plain(x, mask), x, dy), dtype)
    # a mask shape the kernel does not take falls back to the PyTorch expression
    odd = torch.rand(16, 16) > 0.5
    if kind == AttnMaskType.padding:
        torch.testing.assert_close(fused(x, odd), plain(x, odd))


def test_non_contiguous_scores(kernels):
    x = scores((2, 5, 3, 40), torch.float32).transpose(1, 2)  # [2, 3, 5, 40] strided
    mask = torch.rand(2, 1, 5, 40) > 0.5
    torch.testing.assert_close(
        scaled_masked_softmax(x, mask, 0.2), ops.reference_scaled_masked_softmax_fwd(x, mask, 0.2)
    )


def test_gradcheck_fp64(kernels):
    x = scores((2, 2, 3, 5), torch.float64).requires_grad_(True)
    g = torch.Generator().manual_seed(0)
    mask = torch.rand(1, 1, 3, 5, generator=g) > 0.5
    # A fully masked row passes its gradient through (Apex's backward ignores the mask), which
    # a numerical gradcheck rejects by design: keep one column of every row unmasked.
    mask[..., 0] = False
    assert torch.autograd.gradcheck(lambda x: scaled_softmax(x, 0.5), (x,))
    assert torch.autograd.gradcheck(lambda x: scaled_masked_softmax(x, mask, 0.5), (x,))
    xc = scores((3, 4, 4), torch.float64).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x: scaled_upper_triang_masked_softmax(x, 0.5), (xc,))


def test_opcheck(kernels):
    if not kernels:
        pytest.skip("opcheck needs the compiled ops")
    x = scores((2, 3, 4, 20), torch.float32).requires_grad_(True)
    mask = torch.rand(2, 1, 4, 20) > 0.5
    scaled_softmax(x, 1.0)  # registers the autograd formulas
    m = torch.ops.mpnb
    torch.library.opcheck(m.scaled_softmax_fwd, (x, 0.5))
    torch.library.opcheck(m.scaled_masked_softmax_fwd, (x, mask, 0.5))
    xc = scores((6, 9, 9), torch.bfloat16).requires_grad_(True)
    torch.library.opcheck(m.scaled_upper_triang_masked_softmax_fwd, (xc, 0.5))
    y = m.scaled_softmax_fwd(x.detach(), 0.5)
    torch.library.opcheck(m.scaled_softmax_bwd, (torch.randn_like(y), y, 0.5, False))
    torch.library.opcheck(
        m.scaled_softmax_bwd, (torch.randn(6, 9, 9), torch.rand(6, 9, 9), 1.0, True)
    )


def test_errors_are_clear(kernels):
    x = torch.randn(2, 3, 4, 5)
    with pytest.raises(ValueError, match="does not fit scores"):
        scaled_masked_softmax(x, torch.zeros(2, 2, 4, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="does not fit scores"):
        scaled_masked_softmax(x, torch.zeros(4, 5, dtype=torch.bool))
    with pytest.raises(TypeError, match="bool"):
        scaled_masked_softmax(x, torch.zeros(2, 1, 4, 5))
    with pytest.raises(TypeError, match="supported dtypes"):
        scaled_softmax(x.long())
    with pytest.raises(ValueError, match="sq == sk"):
        scaled_upper_triang_masked_softmax(torch.randn(2, 3, 4))
    with pytest.raises(ValueError, match="both"):
        FusedScaleMaskSoftmax(True, True, AttnMaskType.padding, True, None, True, None)
    with pytest.raises(ValueError, match="softmax_in_fp32"):
        FusedScaleMaskSoftmax(True, False, AttnMaskType.padding, True, None, False, 0.5)
