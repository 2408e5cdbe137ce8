"""mpnb.compat.syncbn: Apex's ``syncbn`` extension kernels."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mpnb.compat import syncbn


@pytest.mark.parametrize("channel_last", [False, True])
def test_syncbn_kernels_chain_like_apexs_kernel_file(channel_last):
    """Apex's optimized SyncBN sequence on two 'ranks' (halves of one batch, merged with
    welford_parallel) equals F.batch_norm on the whole batch, forward and backward."""
    torch.manual_seed(5)
    x = torch.randn(8, 3, 4, 5, dtype=torch.float64)
    w, b = torch.rand(3, dtype=torch.float64) + 0.5, torch.randn(3, dtype=torch.float64)
    dy = torch.randn_like(x)
    xr = x.clone().requires_grad_()
    wr, br = w.clone().requires_grad_(), b.clone().requires_grad_()
    F.batch_norm(xr, None, None, wr, br, training=True, eps=1e-5).backward(dy)
    if channel_last:
        x, dy, xr_grad = (t.permute(0, 2, 3, 1).contiguous() for t in (x, dy, xr.grad))
        stats, fwd = syncbn.welford_mean_var_c_last, syncbn.batchnorm_forward_c_last
        red, bwd = syncbn.reduce_bn_c_last, syncbn.batchnorm_backward_c_last
    else:
        xr_grad = xr.grad
        stats, fwd, red, bwd = (
            syncbn.welford_mean_var,
            syncbn.batchnorm_forward,
            syncbn.reduce_bn,
            syncbn.batchnorm_backward,
        )
    halves = (x[:3], x[3:])
    parts = [stats(h) for h in halves]
    counts = torch.tensor([3 * 20, 5 * 20], dtype=torch.int32)
    mean, var, inv_std = syncbn.welford_parallel(
        torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]), counts, 1e-5
    )
    torch.testing.assert_close(var, x.double().var((0, 1, 2) if channel_last else (0, 2, 3)))
    fwd_args = (None, mean, inv_std, w, b, False) if channel_last else (mean, inv_std, w, b)
    y = fwd(x, *fwd_args)
    want = F.batch_norm(xr.detach(), None, None, w, b, training=True, eps=1e-5)
    if channel_last:
        want = want.permute(0, 2, 3, 1)
    torch.testing.assert_close(y, want)
    sums = [red(dy[s], x[s], mean, inv_std, w) for s in (slice(0, 3), slice(3, 8))]
    sum_dy, sum_dy_xmu = sums[0][0] + sums[1][0], sums[0][1] + sums[1][1]
    grad_w = sums[0][2] + sums[1][2]
    dx = bwd(dy, x, mean, inv_std, w, sum_dy, sum_dy_xmu, counts)
    torch.testing.assert_close(dx, xr_grad)
    torch.testing.assert_close(grad_w, wr.grad)


def test_syncbn_relu_bw_c_last_masks_where_the_fused_relu_was_off():
    torch.manual_seed(6)
    x, z = torch.randn(6, 4), torch.randn(6, 4)
    mean, var = x.mean(0), x.var(0, unbiased=False)
    inv = torch.rsqrt(var + 1e-5)
    w, b = torch.ones(4), torch.zeros(4)
    y = syncbn.batchnorm_forward_c_last(x, z, mean, inv, w, b, True)
    g = syncbn.relu_bw_c_last(torch.ones(6, 4), x, z, mean, inv, w, b)
    assert torch.equal(g, (y > 0).float())
