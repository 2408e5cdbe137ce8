"""Fused scaled (masked) softmax layers: the semantics users rely on (the masked_fill
expression, causal zeros, SDPA parity, Apex's fully masked rows), the fp32 exp's accuracy, the
module's fused and unfused paths, the autograd formulas, gradcheck and errors; and Apex's generic
masked softmax, written from Apex's test_fused_softmax: ``generic_scaled_masked_softmax`` (and
its ``_cuda`` extension's forward/backward) gives a fully masked row zeros and a zero gradient
(test_allmasked, test_allmask_backward), and the module's bad configurations raise what Apex
raises (RuntimeError) while staying ValueErrors.

Kernel vs reference on every dtype and mask shape (the ``zero_all_masked`` samples too), and
opcheck: tests/core/ops/test_library.py.
"""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F

import mpnb.core.ops as ops
from mpnb.compat import apex_alias
from mpnb.transformer import AttnMaskType
from mpnb.transformer.functional import (
    FusedScaleMaskSoftmax,
    attention_mask_func,
    generic_scaled_masked_softmax,
    scaled_masked_softmax,
    scaled_softmax,
    scaled_upper_triang_masked_softmax,
)

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


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float64), ids=ids)
@pytest.mark.parametrize("mdtype", (torch.bool, torch.uint8), ids=ids)
def test_masked_softmax_is_the_masked_fill_expression(op_impl, dtype, mdtype):
    # The composite users write by hand, and Apex's gradient: the backward does not read the
    # mask, so a fully masked row (uniform) passes its gradient through.
    x, dy = scores((2, 3, 5, 40), dtype), scores((2, 3, 5, 40), dtype, 1)
    mask = torch.rand(2, 1, 5, 40, generator=torch.Generator().manual_seed(2)) > 0.6
    mask[0, 0, 1] = True
    mask = mask.to(mdtype)
    mine = fwd_bwd(lambda x: scaled_masked_softmax(x, mask, 0.5), x, dy)
    expr = torch.softmax((x.double() * 0.5).masked_fill(mask.bool(), -10000.0), -1)
    torch.testing.assert_close(mine[0].double(), expr, **TOL[dtype])
    y = mine[0].double()
    through = 0.5 * y * (dy.double() - (dy.double() * y).sum(-1, keepdim=True))
    torch.testing.assert_close(mine[1].double(), through, **TOL[dtype])
    torch.testing.assert_close(mine[0][0, :, 1], torch.full_like(mine[0][0, :, 1], 1 / 40))
    ref = fwd_bwd(lambda x: ops.reference_scaled_masked_softmax_fwd(x, mask, 0.5), x, dy)
    close(mine, ref, dtype)
    # Apex's generic kernel: the same, but a fully masked row attends to nothing
    zero = fwd_bwd(lambda x: ops.reference_scaled_masked_softmax_fwd(x, mask, 0.5, True), x, dy)
    close(fwd_bwd(lambda x: generic_scaled_masked_softmax(x, mask, 0.5), x, dy), zero, dtype)
    assert (zero[0][0, :, 1] == 0).all() and (zero[1][0, :, 1] == 0).all()


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=ids)
@pytest.mark.parametrize("sq", (1, 37))
def test_causal_zeros_and_gradients(op_impl, dtype, sq):
    x, dy = scores((4, sq, sq), dtype), scores((4, sq, sq), dtype, 1)
    mine = fwd_bwd(lambda x: scaled_upper_triang_masked_softmax(x, 0.7), x, dy)
    future = torch.ones(sq, sq, dtype=torch.bool).triu(1)
    expr = fwd_bwd(
        lambda x: torch.softmax((x * 0.7).masked_fill(future, float("-inf")), -1),
        x.double(),
        dy.double(),
    )
    close(mine, expr, dtype)
    assert (mine[0].triu(1) == 0).all() and (mine[1].triu(1) == 0).all()


def test_fp32_exp_accuracy(kernels):
    if not kernels:
        pytest.skip("a property of the C++ kernel's exp (MPNB_DISABLE_EXT=1)")
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
    if not kernels:
        pytest.skip("a property of the C++ kernel's exp (MPNB_DISABLE_EXT=1)")
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


def test_matches_sdpa(op_impl):
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


def test_gradcheck_fp64(op_impl):
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


def test_errors_are_clear(op_impl):
    x = torch.randn(2, 3, 4, 5)
    with pytest.raises(ValueError, match="Apex masks are"):
        scaled_masked_softmax(x, torch.zeros(2, 2, 4, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="does not fit scores"):
        scaled_masked_softmax(x, torch.zeros(4, 5, dtype=torch.bool))
    with pytest.raises(TypeError, match="pass a bool"):
        scaled_masked_softmax(x, torch.zeros(2, 1, 4, 5))
    with pytest.raises(ValueError, match="four dims"):
        scaled_masked_softmax(x[0], torch.zeros(1, 1, 4, 5, dtype=torch.bool))
    with pytest.raises(TypeError, match="supported dtypes"):
        scaled_softmax(x.long())
    with pytest.raises(ValueError, match="sq == sk.*masked softmax"):
        scaled_upper_triang_masked_softmax(torch.randn(2, 3, 4))
    with pytest.raises(ValueError, match="the softmax output"):
        ops.scaled_softmax_bwd(torch.randn(2, 3), torch.rand(2, 4))
    with pytest.raises(ValueError, match="both"):
        FusedScaleMaskSoftmax(True, True, AttnMaskType.padding, True, None, True, None)
    with pytest.raises(ValueError, match="softmax_in_fp32"):
        FusedScaleMaskSoftmax(True, False, AttnMaskType.padding, True, None, False, 0.5)


# Apex's generic masked softmax (a fully masked row is zeros) and the module's configurations


def torch_generic(x, mask, scale):
    """Apex's test reference: the masked softmax times (1 - row fully masked)."""
    probs = torch.softmax((x * scale).masked_fill(mask, -10000.0), -1)
    return probs * (1.0 - mask.all(-1).float())[..., None]


def _case(q, k, allmasked, dtype=torch.float16, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(2, 16, q, k, generator=g) * 2).to(dtype)
    if allmasked:
        mask = torch.ones(2, 1, q, k, dtype=torch.bool)
    else:
        mask = torch.randint(0, 2, (2, 1, q, k), generator=g).bool()
        mask[0, 0, 0] = True  # and one fully masked row among the others
    return x, mask


@pytest.mark.parametrize("allmasked", [False, True])
@pytest.mark.parametrize("q,k", [(1, 1), (2, 5), (2, 13), (1, 1234)])
def test_generic_forward_and_backward_match_apexs_reference(op_impl, allmasked, q, k):
    x, mask = _case(q, k, allmasked)
    xr = x.float().requires_grad_(True)
    want = torch_generic(xr, mask, 1.0)
    dy = torch.rand_like(x)
    want.backward(dy.float())
    xg = x.clone().requires_grad_(True)
    got = generic_scaled_masked_softmax(xg, mask, 1.0)
    got.backward(dy)
    torch.testing.assert_close(got.float(), want.detach(), atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(xg.grad.float(), xr.grad, atol=1.5e-1, rtol=5e-3)
    rows = mask.expand_as(x).all(-1)
    assert (got[rows] == 0).all() and (xg.grad[rows] == 0).all()


def test_the_cuda_extension_module_under_the_alias(op_impl):
    """Apex's test calls the extension directly: forward(inputs, mask, scale) and
    backward(grads, softmax_results, scale)."""
    x, mask = _case(2, 11, True)
    dy = torch.rand_like(x)
    with apex_alias():
        k = importlib.import_module("generic_scaled_masked_softmax_cuda")
        y = k.forward(x, mask, 1.0)
        dx = k.backward(dy, y, torch.tensor([1.0])[0])
    assert (y == 0).all() and (dx == 0).all()
    x, mask = _case(2, 11, False)
    y = k.forward(x, mask, 0.5)
    torch.testing.assert_close(y.float(), torch_generic(x.float(), mask, 0.5), atol=1e-3, rtol=1e-3)


def test_the_masked_softmax_keeps_apexs_uniform_rows():
    """FusedScaleMaskSoftmax's own kernel (scaled_masked_softmax) stays Apex's: a fully masked
    row spreads evenly; only the generic one zeroes it."""
    x, mask = _case(2, 8, True, torch.float32)
    torch.testing.assert_close(scaled_masked_softmax(x, mask, 1.0), torch.full_like(x, 1 / 8))


@pytest.mark.parametrize(
    "args",
    [
        (True, True, AttnMaskType.padding, True, None, True, None),  # both half flags
        (True, False, AttnMaskType.padding, True, None, False, 2.0),  # scale without fp32
        (True, False, "padding", True, None, True, None),  # not an AttnMaskType
    ],
    ids=["both flags", "scale without fp32", "mask type"],
)
def test_bad_configurations_raise_what_apex_raises(args):
    with pytest.raises(RuntimeError):
        FusedScaleMaskSoftmax(*args)
    with pytest.raises(ValueError):
        FusedScaleMaskSoftmax(*args)
