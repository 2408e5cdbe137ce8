"""FusedLayerNorm under fp16 autocast on the CPU rounds as PyTorch's fp16 layer norm does.

Apex's ``test_autocast_fused_layer_norm`` (fp16, ``memory_efficient=False``) compares the
fused layer under autocast (which runs it in fp16) with an fp16 ``torch.nn.LayerNorm`` at
fp16's default tolerance (``rtol=1e-3, atol=1e-5``), output and input gradient. On the CPU
that reference computes its mean and rstd in fp32, writes the output from them, and saves them
in fp16 (``native_layer_norm`` returns statistics in the parameters' dtype there; autocast has
no CPU policy for layer norm, so it runs in its input's dtype); its backward reads the fp16
statistics. With fp32 statistics, mpnb's input gradient was 7 to 23 elements of 8192 (71 in
Apex's run) outside that tolerance, up to 4.9e-4 away. Inside an autocast region the fused
layer now saves fp16 statistics too (``torch_stats``; on CUDA PyTorch and mpnb keep fp32).
Outside autocast, and for bf16 regions, the statistics stay fp32 (the last tests here).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mpnb import normalization as N
from mpnb.core.ops import layer_norm_bwd, layer_norm_fwd

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
