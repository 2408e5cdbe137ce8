"""Fused layer norm / RMS norm: kernels against references and PyTorch, autograd, opcheck,
errors. With MPNB_DISABLE_EXT=1 the same tests exercise the reference path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mpnb import normalization as N
from mpnb.core.ops import norm_ops as ops

DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
COLS = (1, 3, 1000, 4097)
TOL = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.float64: dict(rtol=1e-10, atol=1e-10),
    torch.float16: dict(rtol=2e-3, atol=2e-3),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2),
}


def ids(x):
    return str(x).replace("torch.", "")


def data(rows, cols, dtype, seed=0, wdtype=None):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, cols, generator=g, dtype=torch.float64) * 2 + 0.5).to(dtype)
    w = (torch.rand(cols, generator=g, dtype=torch.float64) + 0.5).to(wdtype or dtype)
    b = torch.randn(cols, generator=g, dtype=torch.float64).to(wdtype or dtype)
    dy = torch.randn(rows, cols, generator=g, dtype=torch.float64).to(dtype)
    return x, w, b, dy


def grads(fn, x, params, dy):
    leaves = [t.detach().clone().requires_grad_(True) for t in (x, *params) if t is not None]
    y = fn(*leaves)
    y.backward(dy)
    return [y.detach()] + [t.grad for t in leaves]


def close(a, b, dtype, loose=False):
    tol = dict(TOL[dtype])
    if loose and dtype in (torch.float16, torch.bfloat16):
        # memory_efficient recomputes xhat from the rounded half output: one more rounding
        tol = {k: v * 4 for k, v in tol.items()}
    for u, v in zip(a, b, strict=True):
        torch.testing.assert_close(u.double(), v.double(), **tol)


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("cols", COLS)
@pytest.mark.parametrize("memory_efficient", [False, True])
def test_layer_norm_matches_reference(kernels, dtype, cols, memory_efficient):
    x, w, b, dy = data(5, cols, dtype)
    me = memory_efficient

    def k(x, w, b):
        return ops.layer_norm_fwd(x, [cols], w, b, 1e-5, me)[0]

    def r(x, w, b):
        return ops.reference_layer_norm_fwd(x, [cols], w, b, 1e-5)[0]

    close(grads(k, x, (w, b), dy), grads(r, x, (w, b), dy), dtype, loose=me)


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("cols", COLS)
@pytest.mark.parametrize("memory_efficient", [False, True])
def test_rms_norm_matches_reference(kernels, dtype, cols, memory_efficient):
    x, w, _, dy = data(5, cols, dtype)

    def k(x, w):
        return ops.rms_norm_fwd(x, [cols], w, 1e-5, memory_efficient)[0]

    def r(x, w):
        return ops.reference_rms_norm_fwd(x, [cols], w, 1e-5)[0]

    close(grads(k, x, (w,), dy), grads(r, x, (w,), dy), dtype, loose=memory_efficient)


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("cols", (3, 4097))
@pytest.mark.parametrize("memory_efficient", [False, True])
def test_backward_ops_match_reference(kernels, dtype, cols, memory_efficient):
    x, w, b, dy = data(6, cols, dtype)
    me = memory_efficient
    y, mean, iv = ops.layer_norm_fwd(x, [cols], w, b, 1e-5)
    s = y if me else x
    close(
        ops.layer_norm_bwd(dy, s, mean, iv, [cols], w, b, me),
        ops.reference_layer_norm_bwd(dy, s, mean, iv, [cols], w, b, me),
        dtype,
    )
    y, iv = ops.rms_norm_fwd(x, [cols], w, 1e-5)
    s = y if me else x
    close(
        ops.rms_norm_bwd(dy, s, iv, [cols], w, me),
        ops.reference_rms_norm_bwd(dy, s, iv, [cols], w, me),
        dtype,
    )


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16), ids=ids)
@pytest.mark.parametrize("affine", [True, False])
def test_layer_norm_matches_torch(kernels, dtype, affine):
    x, w, b, dy = data(33, 1000, dtype)
    p = (w, b) if affine else ()
    ln = N.FusedLayerNorm(1000, elementwise_affine=affine).to(dtype)
    mine = grads(
        lambda x, *p: (
            N.fused_layer_norm_affine(x, *p, [1000], 1e-5)
            if p
            else N.fused_layer_norm(x, [1000], 1e-5)
        ),
        x,
        p,
        dy,
    )
    ref = grads(lambda x, *p: F.layer_norm(x, [1000], *p, eps=1e-5), x, p, dy)
    if dtype == torch.float32:
        close(mine, ref, dtype)
    else:  # PyTorch reduces the half weight/bias grads less precisely: compare errors to fp64
        exact = grads(
            lambda x, *p: F.layer_norm(x, [1000], *p, eps=1e-5),
            x.double(),
            [t.double() for t in p],
            dy.double(),
        )
        for m, r, e in zip(mine, ref, exact, strict=True):
            assert (m.double() - e).abs().max() <= (r.double() - e).abs().max() * 1.01 + 1e-6
    assert ln(x).dtype == dtype


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=ids)
def test_rms_norm_matches_torch(kernels, dtype):
    x, w, _, dy = data(17, 4097, dtype)
    mine = grads(lambda x, w: N.fused_rms_norm_affine(x, w, [4097], 1e-6), x, (w,), dy)
    ref = grads(lambda x, w: F.rms_norm(x.float(), [4097], w.float(), eps=1e-6), x, (w,), dy)
    close(mine, ref, dtype)


def test_multi_dim_normalized_shape_and_non_contiguous(kernels):
    x, w, b, dy = data(4 * 6, 10 * 3, torch.float32)
    x = x.reshape(4, 6, 10, 3).transpose(0, 1)  # non-contiguous
    w, b, dy = w.reshape(10, 3), b.reshape(10, 3), dy.reshape(6, 4, 10, 3)
    assert not x.is_contiguous()
    mine = grads(lambda x, w, b: N.fused_layer_norm_affine(x, w, b, (10, 3), 1e-5), x, (w, b), dy)
    ref = grads(lambda x, w, b: F.layer_norm(x, (10, 3), w, b, 1e-5), x, (w, b), dy)
    close(mine, ref, torch.float32)
    mine = grads(lambda x, w: N.fused_rms_norm_affine(x, w, (10, 3), 1e-5), x, (w,), dy)
    ref = grads(lambda x, w: F.rms_norm(x, (10, 3), w, 1e-5), x, (w,), dy)
    close(mine, ref, torch.float32)


@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16), ids=ids)
def test_mixed_dtype_layers(kernels, dtype):
    x, w, b, dy = data(9, 1000, dtype, wdtype=torch.float32)
    ln, rms = N.MixedFusedLayerNorm(1000), N.MixedFusedRMSNorm(1000)
    with torch.no_grad():
        ln.weight.copy_(w), ln.bias.copy_(b), rms.weight.copy_(w)
    xl = x.clone().requires_grad_(True)
    y = ln(xl)
    y.backward(dy)
    assert y.dtype == dtype and ln.weight.grad.dtype == torch.float32
    ref = grads(
        lambda x, w, b: ops.reference_layer_norm_fwd(x, [1000], w, b, 1e-5)[0], x, (w, b), dy
    )
    close([y, xl.grad, ln.weight.grad, ln.bias.grad], ref, dtype)
    assert rms(x).dtype == dtype
    with pytest.raises(ValueError, match="fp32 affine"):
        N.MixedFusedLayerNorm(8, elementwise_affine=False)


@pytest.mark.parametrize("memory_efficient", [False, True])
def test_gradcheck_fp64(kernels, memory_efficient):
    x, w, b, _ = data(3, 7, torch.float64)
    x, w, b = (t.requires_grad_(True) for t in (x, w, b))
    me = memory_efficient
    assert torch.autograd.gradcheck(
        lambda x, w, b: ops.layer_norm_fwd(x, [7], w, b, 1e-5, me)[0], (x, w, b)
    )
    assert torch.autograd.gradcheck(
        lambda x: ops.layer_norm_fwd(x, [7], None, None, 1e-5, me)[0], (x,)
    )
    assert torch.autograd.gradcheck(lambda x, w: ops.rms_norm_fwd(x, [7], w, 1e-5, me)[0], (x, w))
    assert torch.autograd.gradcheck(lambda x: ops.rms_norm_fwd(x, [7], None, 1e-5, me)[0], (x,))


def test_modules_match_torch_modules(kernels):
    x = torch.randn(4, 7, 64)
    ln, ref = N.FusedLayerNorm(64), torch.nn.LayerNorm(64)
    torch.testing.assert_close(ln(x), ref(x), rtol=1e-5, atol=1e-5)
    rms, ref = N.FusedRMSNorm(64, eps=1e-6), torch.nn.RMSNorm(64, eps=1e-6)
    torch.testing.assert_close(rms(x), ref(x), rtol=1e-5, atol=1e-5)
    assert "memory_efficient=False" in repr(ln)


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_opcheck(kernels, op):
    if not kernels:
        pytest.skip("opcheck needs the compiled ops")
    x, w, b, dy = data(6, 40, torch.float32)
    x.requires_grad_(True), w.requires_grad_(True), b.requires_grad_(True)
    ops.layer_norm_fwd(x, [40], w, b)  # registers the autograd formulas
    if op == "layer_norm":
        for me in (False, True):
            torch.library.opcheck(torch.ops.mpnb.layer_norm_fwd, (x, [40], w, b, 1e-5, me))
        y, mean, iv = torch.ops.mpnb.layer_norm_fwd(x.detach(), [40], w.detach(), b.detach(), 1e-5)
        for me, s in ((False, x.detach()), (True, y)):
            args = (dy, s, mean, iv, [40], w.detach(), b.detach(), me)
            torch.library.opcheck(torch.ops.mpnb.layer_norm_bwd, args)
    else:
        torch.library.opcheck(torch.ops.mpnb.rms_norm_fwd, (x, [40], w, 1e-5, False))
        torch.library.opcheck(
            torch.ops.mpnb.rms_norm_fwd, (x.detach().bfloat16(), [40], None, 1e-5)
        )
        y, iv = torch.ops.mpnb.rms_norm_fwd(x.detach(), [40], w.detach(), 1e-5)
        torch.library.opcheck(
            torch.ops.mpnb.rms_norm_bwd, (dy, x.detach(), iv, [40], w.detach(), False)
        )


def test_errors_are_clear(kernels):
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="does not end with normalized_shape"):
        N.fused_layer_norm(x, [7])
    with pytest.raises(ValueError, match="weight has 7 elements"):
        N.fused_rms_norm_affine(x, torch.ones(7), [8])
    with pytest.raises(TypeError, match="supported dtypes"):
        N.fused_layer_norm(x.int(), [8])
    with pytest.raises(TypeError, match="use the input's dtype"):
        N.fused_layer_norm_affine(x.double(), torch.ones(8), torch.zeros(8), [8])
    with pytest.raises(TypeError, match="one dtype"):
        N.fused_layer_norm_affine(x.bfloat16(), torch.ones(8), torch.zeros(8).bfloat16(), [8])


def test_empty_input(kernels):
    x = torch.randn(0, 8, requires_grad=True)
    y = N.FusedLayerNorm(8)(x)
    y.sum().backward()
    assert y.shape == (0, 8) and x.grad.shape == (0, 8)
