"""SyncBatchNorm's autograd function and its three steps (:mod:`mpnb.core.parallel.
sync_batchnorm_kernel`), in one process: ``batchnorm_forward``, ``reduce_bn`` and
``batchnorm_backward`` compose to torch's training-mode batch norm (values and gradients), in
both layouts, in eval mode too, and the output is a fresh tensor, never a view."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mpnb.core.parallel.sync_batchnorm_kernel import (
    batchnorm_backward,
    batchnorm_forward,
    check_channels,
    reduce_bn,
    sync_batch_norm,
    world_of,
)

SHAPES = [(6, 4), (5, 4, 7), (3, 4, 3, 5)]


def _inputs(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    c = shape[1]
    w = torch.rand(c, generator=g, dtype=torch.float64) + 0.5
    b = torch.randn(c, generator=g, dtype=torch.float64)
    dy = torch.randn(shape, generator=g, dtype=torch.float64)
    return x, w, b, dy


def _stats(x):
    dims = [0, *range(2, x.dim())]
    var, mean = torch.var_mean(x, dim=dims, correction=0)
    return mean, var, x.numel() // x.shape[1]


@pytest.mark.parametrize("shape", SHAPES)
def test_the_three_steps_are_torchs_batch_norm_and_its_gradients(shape):
    x, w, b, dy = _inputs(shape)
    xr, wr, br = (t.clone().requires_grad_() for t in (x, w, b))
    y_ref = F.batch_norm(xr, None, None, wr, br, training=True, eps=1e-5)
    (y_ref * dy).sum().backward()

    mean, var, n = _stats(x)
    invstd = torch.rsqrt(var + 1e-5)
    y = batchnorm_forward(x, mean, invstd, w, b)
    sum_dy, sum_dy_xmu, gw, gb = reduce_bn(dy, x, mean, invstd, w)
    dx = batchnorm_backward(dy, x, mean, invstd, w, sum_dy, sum_dy_xmu, n)
    torch.testing.assert_close(y, y_ref.detach())
    torch.testing.assert_close(dx, xr.grad)
    torch.testing.assert_close(gw, wr.grad)
    torch.testing.assert_close(gb, br.grad)


def test_channel_last_layout_gives_the_same_result():
    x, w, b, dy = _inputs((3, 4, 5))
    mean, var, n = _stats(x)
    invstd = torch.rsqrt(var + 1e-5)
    xl, dyl = x.transpose(1, 2).contiguous(), dy.transpose(1, 2).contiguous()
    y = batchnorm_forward(xl, mean, invstd, w, b, channel_last=True)
    torch.testing.assert_close(y.transpose(1, 2), batchnorm_forward(x, mean, invstd, w, b))
    sums = reduce_bn(dyl, xl, mean, invstd, w, channel_last=True)
    dx = batchnorm_backward(dyl, xl, mean, invstd, w, sums[0], sums[1], n, channel_last=True)
    ref = batchnorm_backward(dy, x, mean, invstd, w, *reduce_bn(dy, x, mean, invstd, w)[:2], n)
    torch.testing.assert_close(dx.transpose(1, 2), ref)


def test_no_weight_means_no_affine_gradients():
    x, _, _, dy = _inputs((6, 4))
    mean, var, _ = _stats(x)
    invstd = torch.rsqrt(var + 1e-5)
    torch.testing.assert_close(batchnorm_forward(x, mean, invstd, None, None), (x - mean) * invstd)
    assert reduce_bn(dy, x, mean, invstd, None)[2:] == (None, None)


def test_residual_and_fused_relu_and_a_half_input_keep_its_dtype():
    x, w, b, _ = _inputs((6, 4))
    z = torch.randn(6, 4, dtype=torch.float64)
    mean, var, _ = _stats(x)
    invstd = torch.rsqrt(var + 1e-5)
    want = torch.relu(batchnorm_forward(x, mean, invstd, w, b) + z)
    torch.testing.assert_close(batchnorm_forward(x, mean, invstd, w, b, z, fuse_relu=True), want)
    xh = x.bfloat16()
    yh = batchnorm_forward(xh, mean.float(), invstd.float(), w.float(), b.float())
    assert yh.dtype == torch.bfloat16


@pytest.mark.parametrize("training", [True, False])
def test_sync_batch_norm_on_one_process_matches_torch_and_is_no_view(training):
    x, w, b, dy = _inputs((5, 4, 7))
    rm, rv = torch.randn(4, dtype=torch.float64), torch.rand(4, dtype=torch.float64) + 0.5
    rm_ref, rv_ref = rm.clone(), rv.clone()
    xo, wo, bo = (t.clone().requires_grad_() for t in (x, w, b))
    xr, wr, br = (t.clone().requires_grad_() for t in (x, w, b))
    y = sync_batch_norm(xo, wo, bo, rm, rv, training=training)
    y_ref = F.batch_norm(xr, rm_ref, rv_ref, wr, br, training=training, momentum=0.1, eps=1e-5)
    assert y._base is None  # in-place ops on the output are allowed
    (y * dy).sum().backward()
    (y_ref * dy).sum().backward()
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(xo.grad, xr.grad)
    torch.testing.assert_close(wo.grad, wr.grad)
    torch.testing.assert_close(rm, rm_ref)
    torch.testing.assert_close(rv, rv_ref)


def test_one_value_per_channel_cannot_train():
    with pytest.raises(ValueError, match="more than 1"):
        sync_batch_norm(torch.randn(1, 3), torch.ones(3), torch.zeros(3), None, None)


def test_without_a_process_group_the_world_is_one_and_the_channel_check_is_a_no_op():
    assert world_of(None) == 1
    check_channels(torch.randn(2, 3), channel_last=False, group=None)  # nothing to compare
