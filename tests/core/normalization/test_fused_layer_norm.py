"""Fused layer norm / RMS norm layers: parity with PyTorch's own layers, the autograd formulas
(memory_efficient both ways) against autograd through the references, gradcheck, the mixed
layers, the CUDA path's PyTorch ops, and errors that name the fix.

Kernel vs reference on every dtype and opcheck: tests/core/ops/test_op_table.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import mpnb.core.ops as ops
from mpnb import normalization as N

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


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float64), ids=ids)
@pytest.mark.parametrize("cols", (3, 1000))
@pytest.mark.parametrize("memory_efficient", [False, True])
def test_autograd_matches_autograd_through_reference(op_impl, dtype, cols, memory_efficient):
    # The registered formula (the backward op, from x or from y) against PyTorch's autograd
    # through the reference's own ops.
    x, w, b, dy = data(5, cols, dtype)
    me = memory_efficient

    def ln(x, w, b):
        return ops.layer_norm_fwd(x, [cols], w, b, 1e-5, me)[0]

    def ln_ref(x, w, b):
        return ops.reference_layer_norm_fwd(x, [cols], w, b, 1e-5)[0]

    def rms(x, w):
        return ops.rms_norm_fwd(x, [cols], w, 1e-5, me)[0]

    def rms_ref(x, w):
        return ops.reference_rms_norm_fwd(x, [cols], w, 1e-5)[0]

    close(grads(ln, x, (w, b), dy), grads(ln_ref, x, (w, b), dy), dtype, loose=me)
    close(grads(rms, x, (w,), dy), grads(rms_ref, x, (w,), dy), dtype, loose=me)


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


def test_multi_dim_normalized_shape_and_non_contiguous(op_impl):
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
@pytest.mark.parametrize("memory_efficient", [False, True])
def test_mixed_dtype_layers(op_impl, dtype, memory_efficient):
    x, w, b, dy = data(9, 1000, dtype, wdtype=torch.float32)
    me = memory_efficient
    ln = N.MixedFusedLayerNorm(1000, memory_efficient=me)
    rms = N.MixedFusedRMSNorm(1000, memory_efficient=me)
    with torch.no_grad():
        ln.weight.copy_(w), ln.bias.copy_(b), rms.weight.copy_(w)
    xl = x.clone().requires_grad_(True)
    y = ln(xl)
    y.backward(dy)
    assert y.dtype == dtype and ln.weight.grad.dtype == torch.float32
    ref = grads(
        lambda x, w, b: ops.reference_layer_norm_fwd(x, [1000], w, b, 1e-5)[0], x, (w, b), dy
    )
    close([y, xl.grad, ln.weight.grad, ln.bias.grad], ref, dtype, loose=me)
    xr = x.clone().requires_grad_(True)
    y = rms(xr)
    y.backward(dy)
    assert y.dtype == dtype and rms.weight.grad.dtype == torch.float32
    ref = grads(lambda x, w: ops.reference_rms_norm_fwd(x, [1000], w, 1e-5)[0], x, (w,), dy)
    close([y, xr.grad, rms.weight.grad], ref, dtype, loose=me)
    with pytest.raises(ValueError, match="fp32 affine"):
        N.MixedFusedLayerNorm(8, elementwise_affine=False)


@pytest.mark.parametrize("memory_efficient", [False, True])
def test_gradcheck_fp64(op_impl, memory_efficient):
    x, w, b, _ = data(3, 7, torch.float64)
    x, w, b = (t.requires_grad_(True) for t in (x, w, b))
    me = memory_efficient
    assert torch.autograd.gradcheck(
        lambda x, w, b: ops.layer_norm_fwd(x, [7], w, b, 1e-5, me)[0], (x, w, b)
    )
    assert torch.autograd.gradcheck(
        lambda x: ops.layer_norm_fwd(x, [7], None, None, 1e-5, me)[0], (x,)
    )
    assert torch.autograd.gradcheck(
        lambda x, b: ops.layer_norm_fwd(x, [7], None, b, 1e-5, me)[0], (x, b)
    )
    assert torch.autograd.gradcheck(lambda x, w: ops.rms_norm_fwd(x, [7], w, 1e-5, me)[0], (x, w))
    assert torch.autograd.gradcheck(lambda x: ops.rms_norm_fwd(x, [7], None, 1e-5, me)[0], (x,))


@pytest.mark.parametrize("layer", ["layer_norm", "rms_norm"])
def test_memory_efficient_saves_the_output(op_impl, layer):
    # memory_efficient=True keeps y (not x) for the backward: an input overwritten behind
    # autograd's back after the forward leaves its gradient right; without it, it does not.
    x, _, _, dy = data(4, 16, torch.float32)
    make = N.FusedLayerNorm if layer == "layer_norm" else N.FusedRMSNorm
    expect = grads(lambda x: make(16)(x), x, (), dy)[1]

    def grad_after_overwrite(memory_efficient):
        xa = x.clone().requires_grad_(True)
        h = xa * 1.0
        y = make(16, memory_efficient=memory_efficient)(h)
        h.data.mul_(3.0)  # .data: the version counter does not see it
        y.backward(dy)
        return xa.grad

    torch.testing.assert_close(grad_after_overwrite(True), expect, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(grad_after_overwrite(False), expect, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("offset", [0.0, 30.0, 300.0])
def test_large_row_mean_as_accurate_as_the_reference(kernels, offset):
    # Rows whose mean dwarfs their spread: fp32 statistics lose digits to the mean's rounding
    # (at a mean of 300 one ulp of the input is 3e-5). The kernel's two-pass statistics stay as
    # close to the fp64 result as the reference's.
    x, w, b, _ = data(6, 257, torch.float32)
    x = x + offset
    exact = ops.reference_layer_norm_fwd(x.double(), [257], w.double(), b.double(), 1e-5)
    mine = ops.layer_norm_fwd(x, [257], w, b, 1e-5)
    ref = ops.reference_layer_norm_fwd(x, [257], w, b, 1e-5)
    for m, r, e in zip(mine, ref, exact, strict=True):
        assert (m.double() - e).abs().max() <= (r.double() - e).abs().max() * 1.5 + 1e-7


def test_modules_match_torch_modules(kernels):
    x = torch.randn(4, 7, 64)
    ln, ref = N.FusedLayerNorm(64), torch.nn.LayerNorm(64)
    torch.testing.assert_close(ln(x), ref(x), rtol=1e-5, atol=1e-5)
    rms, ref = N.FusedRMSNorm(64, eps=1e-6), torch.nn.RMSNorm(64, eps=1e-6)
    torch.testing.assert_close(rms(x), ref(x), rtol=1e-5, atol=1e-5)
    assert "memory_efficient=False" in repr(ln)


@pytest.mark.parametrize("name", ["layer_norm_fwd", "layer_norm_bwd"])
@pytest.mark.parametrize("dtype", (torch.float32, torch.float64, torch.bfloat16), ids=ids)
def test_cuda_path_matches_reference(name, dtype):
    # The PyTorch ops registered for CUDA (native_layer_norm and its backward for fp32/fp64,
    # the reference otherwise), run here on the CPU over the op table's samples: the same
    # values as the reference. (PyTorch's CPU backward computes x * rstd - mean * rstd: on
    # one-column rows, where xhat is 0 and rstd = 1/sqrt(eps) = 316, it is off by ~3e-5.)
    op = ops.op_info(name)
    rtol, atol = {torch.float64: (1e-12, 1e-12), torch.float32: (1e-5, 1e-4)}.get(dtype, (0, 0))
    for sample in op.sample_inputs(dtype):
        with torch.no_grad():
            got = op.torch_path(**copy.deepcopy(sample.kwargs))
            want = op.reference(**copy.deepcopy(sample.kwargs))
        for g, w in zip(got, want, strict=True):
            assert g.dtype == w.dtype and g.shape == w.shape, sample.name
            torch.testing.assert_close(g, w, rtol=rtol, atol=atol, msg=sample.name)


def test_errors_are_clear(op_impl):
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="does not end with normalized_shape"):
        N.fused_layer_norm(x, [7])
    with pytest.raises(ValueError, match="weight has 7 elements.*pass a weight of shape"):
        N.fused_rms_norm_affine(x, torch.ones(7), [8])
    with pytest.raises(TypeError, match="supported dtypes.*convert with"):
        N.fused_layer_norm(x.int(), [8])
    with pytest.raises(TypeError, match="use the input's dtype"):
        N.fused_layer_norm_affine(x.double(), torch.ones(8), torch.zeros(8), [8])
    with pytest.raises(TypeError, match="one dtype"):
        N.fused_layer_norm_affine(x.bfloat16(), torch.ones(8), torch.zeros(8).bfloat16(), [8])
    y, mean, invvar = ops.layer_norm_fwd(x, [8])
    with pytest.raises(ValueError, match="does not match the saved tensor"):
        ops.layer_norm_bwd(torch.ones(4, 7), x, mean, invvar, [8])
    with pytest.raises(ValueError, match="invvar the forward returned"):
        ops.rms_norm_bwd(torch.ones_like(x), x, invvar[:3], [8])
    with pytest.raises(ValueError, match="mean the forward returned"):
        ops.layer_norm_bwd(torch.ones_like(x), x, mean[:2], invvar, [8])


def test_empty_input(op_impl):
    x = torch.randn(0, 8, requires_grad=True)
    y = N.FusedLayerNorm(8)(x)
    y.sum().backward()
    assert y.shape == (0, 8) and x.grad.shape == (0, 8)


@pytest.mark.parametrize("layer", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=ids)
@pytest.mark.parametrize("threads", [1, 2])
def test_backward_rows_taken_in_groups_match_rows_one_at_a_time(kernels, layer, dtype, threads):
    """Wide rows with a weight go through the backward's write pass four at a time (the
    partials kept across the group, csrc/cpu/norm_common.h): 4100 wide, 13 rows (three groups
    and a row alone per thread). dx must be the bits of each row's own call, the weight's and
    bias's gradients the reference's sums."""
    rows, cols = 13, 4100
    x, w, b, dy = data(rows, cols, dtype, seed=3)
    bias = (b,) if layer == "layer_norm" else ()
    fwd, bwd = getattr(ops, f"{layer}_fwd"), getattr(ops, f"{layer}_bwd")

    def backward(xs, dys):
        out = fwd(xs, [cols], w, *bias)
        return bwd(dys, xs, *out[1:], [cols], w, *bias)

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = backward(x, dy)
        alone = [backward(x[r : r + 1], dy[r : r + 1])[0] for r in range(rows)]
    finally:
        torch.set_num_threads(before)

    def bits(t):
        return t.view(torch.int16 if t.element_size() == 2 else torch.int32)

    assert torch.equal(bits(got[0]), bits(torch.cat(alone)))
    with ops.use_reference():
        want = backward(x, dy)
    assert all(g.numel() == cols for g in got[1 : 2 + len(bias)])
    close(got[1 : 2 + len(bias)], want[1 : 2 + len(bias)], dtype)
