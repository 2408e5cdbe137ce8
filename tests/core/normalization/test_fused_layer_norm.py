"""Fused layer norm / RMS norm layers: parity with PyTorch's own layers, the autograd formulas
(memory_efficient both ways) against autograd through the references, gradcheck, the mixed
layers, the CUDA path's PyTorch ops, and errors that name the fix. Then two aspects:

* FusedLayerNorm under fp16 autocast on the CPU rounds as PyTorch's fp16 layer norm does.
  Apex's ``test_autocast_fused_layer_norm`` (fp16, ``memory_efficient=False``) compares the
  fused layer under autocast (which runs it in fp16) with an fp16 ``torch.nn.LayerNorm`` at
  fp16's default tolerance (``rtol=1e-3, atol=1e-5``), output and input gradient. On the CPU
  that reference computes its mean and rstd in fp32, writes the output from them, and saves them
  in fp16 (``native_layer_norm`` returns statistics in the parameters' dtype there; autocast has
  no CPU policy for layer norm, so it runs in its input's dtype); its backward reads the fp16
  statistics. With fp32 statistics, mpnb's input gradient was 7 to 23 elements of 8192 (71 in
  Apex's run) outside that tolerance, up to 4.9e-4 away. Inside an autocast region the fused
  layer now saves fp16 statistics too (``torch_stats``; on CUDA PyTorch and mpnb keep fp32).
  Outside autocast, and for bf16 regions, the statistics stay fp32.
* A norm's ``eps`` must be a finite number >= 0: a negative one (``FusedLayerNorm(eps=-1)``)
  made ``var + eps`` negative for some rows and the output NaN. Every module refuses it when
  it is built, every functional form and op when it is called, naming ``eps`` and the fix.

Kernel vs reference on every dtype and opcheck: tests/core/ops/test_library.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import mpnb.core.ops as ops
from mpnb import normalization as N
from mpnb.core.ops import layer_norm_bwd, layer_norm_fwd

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
    with pytest.raises(ValueError, match="does not end with"):
        N.fused_layer_norm(x, [7])
    with pytest.raises(ValueError, match="weight has 7 elements"):
        N.fused_rms_norm_affine(x, torch.ones(7), [8])
    with pytest.raises(TypeError, match="supported dtypes"):
        N.fused_layer_norm(x.int(), [8])
    with pytest.raises(TypeError, match="use the input's dtype"):
        N.fused_layer_norm_affine(x.double(), torch.ones(8), torch.zeros(8), [8])
    with pytest.raises(TypeError, match="one dtype"):
        N.fused_layer_norm_affine(x.bfloat16(), torch.ones(8), torch.zeros(8).bfloat16(), [8])
    y, mean, invvar = ops.layer_norm_fwd(x, [8])
    with pytest.raises(ValueError, match="the saved tensor"):
        ops.layer_norm_bwd(torch.ones(4, 7), x, mean, invvar, [8])
    with pytest.raises(ValueError, match="pass the invvar"):
        ops.rms_norm_bwd(torch.ones_like(x), x, invvar[:3], [8])
    with pytest.raises(ValueError, match="pass the mean"):
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


# FusedLayerNorm under fp16 autocast on the CPU rounds as PyTorch's fp16 layer norm does

SHAPE = [32, 16]  # Apex's test's normalized_shape, batch 16
APEX_FP16 = dict(rtol=1e-3, atol=1e-5)
SEEDS = range(6)


def _inputs(seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(16, *SHAPE, generator=g)
    return x, torch.rand(16, *SHAPE, generator=g).half()


def _fused(x, dy, affine, dtype=torch.float16):
    """Apex's fused side: an fp32 layer and input, run inside an autocast region."""
    fx = x.clone().requires_grad_(True)
    layer = N.FusedLayerNorm(SHAPE, elementwise_affine=affine)
    with torch.autocast("cpu", dtype=dtype):
        y = layer(fx)
    y.backward(dy.to(y.dtype))
    return y, fx.grad, layer


def _native(x, dy, affine):
    """Apex's reference side: an fp16 ``torch.nn.LayerNorm`` on the fp16 input, no autocast."""
    nx = x.half().requires_grad_(True)
    layer = torch.nn.LayerNorm(SHAPE, elementwise_affine=affine).half()
    y = layer(nx)
    y.backward(dy)
    return y, nx.grad, layer


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("affine", [True, False])
def test_autocast_fp16_matches_torchs_fp16_layer_norm_at_apexs_tolerance(op_impl, affine, seed):
    x, dy = _inputs(seed)
    y, dx, _ = _fused(x, dy, affine)
    want_y, want_dx, _ = _native(x, dy, affine)
    assert y.dtype == torch.float16  # Apex's fused norms run in the region's dtype
    torch.testing.assert_close(y, want_y, **APEX_FP16)
    torch.testing.assert_close(want_dx, dx, check_dtype=False, **APEX_FP16)  # Apex's order


@pytest.mark.parametrize("affine", [True, False])
def test_autocast_fp16_saves_the_statistics_torch_saves(op_impl, affine):
    x, _ = _inputs(0)
    x16 = x.half()
    p16 = (torch.ones(SHAPE).half(), torch.zeros(SHAPE).half()) if affine else (None, None)
    # what FusedLayerNorm passes in an fp16 region: fp16 tensors and torch_stats
    _, mean, invvar = layer_norm_fwd(x16, SHAPE, *p16, 1e-5, False, True)
    _, tmean, trstd = torch.native_layer_norm(x16, SHAPE, *p16, 1e-5)
    assert tmean.dtype == torch.float16 and mean.dtype == torch.float32
    assert torch.equal(mean, mean.half().float()) and torch.equal(invvar, invvar.half().float())
    # the same fp32 values up to summation order, so the same fp16 values but for a rare tie
    torch.testing.assert_close(mean, tmean.float().reshape(-1), rtol=2**-10, atol=0)
    torch.testing.assert_close(invvar, trstd.float().reshape(-1), rtol=2**-10, atol=0)


def test_autocast_fp16_gradient_has_the_accuracy_of_torchs_cpu_fp16(op_impl):
    # The price of rounding as PyTorch does: the input gradient's error against fp64 is
    # PyTorch's (measured 4.4e-4 to 5.3e-4 on these shapes; 2.4e-4 with fp32 statistics).
    errs = []
    for seed in SEEDS:
        x, dy = _inputs(seed)
        _, dx, _ = _fused(x, dy, affine=False)
        _, tdx, _ = _native(x, dy, affine=False)
        x64 = x.half().double().requires_grad_(True)
        F.layer_norm(x64, SHAPE, eps=1e-5).backward(dy.double())
        errs.append(((dx.double() - x64.grad).abs().max(), (tdx.double() - x64.grad).abs().max()))
    ours, torchs = max(e[0] for e in errs), max(e[1] for e in errs)
    assert abs(ours - torchs) <= 2**-14, (ours, torchs)


def test_autocast_fp16_weight_and_bias_gradients_sum_in_fp32(op_impl):  # a guard
    # PyTorch's CPU kernel sums each thread's rows of the weight/bias gradients in fp16
    # partials; mpnb sums them in fp32 and rounds once, so it is nearer the fp64 sums.
    x, dy = _inputs(3)
    _, _, layer = _fused(x, dy, affine=True)
    _, _, native = _native(x, dy, affine=True)
    xh = x.half().double()
    xh = (xh - xh.mean((1, 2), keepdim=True)) / (xh.var((1, 2), False, True) + 1e-5).sqrt()
    for got, torchs, want in (
        (layer.weight.grad, native.weight.grad, (dy.double() * xh).sum(0)),
        (layer.bias.grad, native.bias.grad, dy.double().sum(0)),
    ):
        assert (got.double() - want).abs().max() <= (torchs.double() - want).abs().max()


def test_fp16_outside_autocast_keeps_fp32_statistics(op_impl):  # a guard: held before too
    x, dy = _inputs(1)
    x16 = x.half().requires_grad_(True)
    _, mean, invvar = layer_norm_fwd(x16.detach(), SHAPE, None, None, 1e-5)
    assert not torch.equal(invvar, invvar.half().float())  # not rounded to fp16
    layer = N.FusedLayerNorm(SHAPE, elementwise_affine=False)
    layer(x16).backward(dy)
    want = layer_norm_bwd(dy, x16.detach(), mean, invvar, SHAPE)[0]
    assert torch.equal(x16.grad, want)


def test_bf16_autocast_keeps_fp32_statistics(op_impl):  # a guard: held before too
    x, dy = _inputs(2)
    _, dx, _ = _fused(x, dy, affine=False, dtype=torch.bfloat16)
    xb = x.bfloat16().requires_grad_(True)
    N.FusedLayerNorm(SHAPE, elementwise_affine=False)(xb).backward(dy.bfloat16())
    assert torch.equal(dx, xb.grad.float())  # the same bits as without autocast


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_keeps_fp32_statistics_as_torch_does():
    x = torch.randn(16, *SHAPE, device="cuda").half()
    _, tmean, trstd = torch.native_layer_norm(x, SHAPE, None, None, 1e-5)
    assert tmean.dtype == torch.float32 and trstd.dtype == torch.float32
    got = layer_norm_fwd(x, SHAPE, None, None, 1e-5, False, True)
    plain = layer_norm_fwd(x, SHAPE, None, None, 1e-5, False, False)
    assert torch.equal(got[1], plain[1]) and torch.equal(got[2], plain[2])
    torch.testing.assert_close(got[2], trstd.reshape(-1), rtol=1e-5, atol=0)


# eps must be a finite number >= 0, for every module, functional form and op

BAD = [-1.0, -1e-12, float("nan"), float("inf")]


@pytest.mark.parametrize("eps", BAD)
@pytest.mark.parametrize(
    "cls", [N.FusedLayerNorm, N.FusedRMSNorm, N.MixedFusedLayerNorm, N.MixedFusedRMSNorm]
)
def test_modules_refuse_a_bad_eps_when_built(cls, eps):
    with pytest.raises(ValueError, match=r"eps=.*1e-5"):
        cls(8, eps=eps)


def _calls(x, w, b, eps):
    return {
        "fused_layer_norm": lambda: N.fused_layer_norm(x, [8], eps),
        "fused_layer_norm_affine": lambda: N.fused_layer_norm_affine(x, w, b, [8], eps),
        "mixed_dtype_fused_layer_norm_affine": lambda: N.mixed_dtype_fused_layer_norm_affine(
            x, w, b, [8], eps
        ),
        "fused_rms_norm": lambda: N.fused_rms_norm(x, [8], eps),
        "fused_rms_norm_affine": lambda: N.fused_rms_norm_affine(x, w, [8], eps),
        "mixed_dtype_fused_rms_norm_affine": lambda: N.mixed_dtype_fused_rms_norm_affine(
            x, w, [8], eps
        ),
        "layer_norm_fwd": lambda: ops.layer_norm_fwd(x, [8], w, b, eps),
        "rms_norm_fwd": lambda: ops.rms_norm_fwd(x, [8], w, eps),
    }


@pytest.mark.parametrize("eps", BAD)
@pytest.mark.parametrize("name", list(_calls(None, None, None, 0.0)))
def test_functions_and_ops_refuse_a_bad_eps(op_impl, name, eps):
    x, w, b = torch.randn(3, 8), torch.ones(8), torch.zeros(8)
    with pytest.raises(ValueError, match=r"eps=.*1e-5"):
        _calls(x, w, b, eps)[name]()


def test_zero_eps_is_still_accepted():
    x = torch.randn(3, 8)
    y = N.FusedLayerNorm(8, eps=0.0)(x)
    torch.testing.assert_close(y, torch.nn.functional.layer_norm(x, [8], eps=0.0))
    assert torch.isfinite(N.FusedRMSNorm(8, eps=0)(x)).all()
