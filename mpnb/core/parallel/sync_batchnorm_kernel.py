"""The autograd function of SyncBatchNorm: statistics over every rank's batch.

Forward: per-rank per-channel mean/variance from the Welford kernel (fp32 for half input),
one ``all_gather`` of ``(mean, var, count)`` per rank (fp64, so counts stay exact), Chan's
merge (``welford_parallel``), then the elementwise normalize (+ optional residual ``z`` and
ReLU) in fp32. Backward: local ``sum(dy)`` and ``sum(dy * (x - mean))`` per channel, one
``all_reduce`` of both, then the input gradient; the weight and bias gradients stay local
(summed over the ranks by DDP, as in Apex and PyTorch). Ranks may hold different batch sizes,
including none.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mpnb.core.ops.welford import welford_mean_var, welford_parallel

__all__ = ["SyncBatchnormFunction", "sync_batch_norm", "world_of"]


def world_of(group) -> int:
    """World size of ``group``; 1 when torch.distributed is not initialized."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def _shape(x: torch.Tensor, channel_last: bool) -> tuple[torch.Tensor, list[int]]:
    # A view of x as (N, C, L) or (M, C), and the dims to reduce over.
    if channel_last or x.dim() == 2:
        return x.reshape(x.numel() // max(x.shape[-1], 1), x.shape[-1]), [0]
    return x.reshape(x.shape[0], x.shape[1], x.shape[2:].numel()), [0, 2]


def _bcast(v: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    return v.view(1, -1, 1) if rows.dim() == 3 else v.view(1, -1)


def _global_stats(x3, group, world):
    channel_last = x3.dim() == 2
    mean, var = welford_mean_var(x3, channel_last)
    count = float(x3.numel() // max(x3.shape[1], 1))
    if world == 1:
        return mean, var, count
    c = mean.numel()
    mine = torch.cat([mean.double(), var.double(), mean.new_full((1,), count, dtype=torch.float64)])
    parts = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(parts, mine, group=group)
    g = torch.stack(parts)
    gm, gv = welford_parallel(g[:, :c].cpu(), g[:, c : 2 * c].cpu(), g[:, 2 * c].cpu())
    total = float(g[:, 2 * c].sum().item())
    return gm.to(device=mean.device, dtype=mean.dtype), gv.to(mean.device, mean.dtype), total


def _update_running(running_mean, running_var, mean, var, total, momentum) -> None:
    with torch.no_grad():
        if running_mean is not None:
            running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
        if running_var is not None:
            unbiased = var * (total / (total - 1))
            running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)


def _normalize(x3, mean, invstd, weight, bias, z, fuse_relu, dtype):
    y = (x3.to(mean.dtype) - _bcast(mean, x3)) * _bcast(invstd, x3)
    if weight is not None:
        y = y * _bcast(weight.to(mean.dtype), x3)
    if bias is not None:
        y = y + _bcast(bias.to(mean.dtype), x3)
    if z is not None:
        y = y + z.reshape(x3.shape).to(mean.dtype)
    if fuse_relu:
        y = torch.relu(y)
    return y.to(dtype)


class SyncBatchnormFunction(torch.autograd.Function):
    """``y = relu?((x - mean) * invstd * w + b + z)`` with mean/var over every rank's batch."""

    @staticmethod
    def forward(
        ctx,
        x,
        weight,
        bias,
        running_mean,
        running_var,
        eps,
        momentum,
        group,
        channel_last,
        fuse_relu,
        z,
        training,
    ):
        x3, dims = _shape(x, channel_last)
        world = world_of(group)
        if training:
            mean, var, total = _global_stats(x3, group, world)
            if total <= 1:
                raise ValueError(
                    f"SyncBatchNorm: {int(total)} value(s) per channel over all ranks (input "
                    f"{tuple(x.shape)}); training needs more than 1. Use a larger batch, or "
                    "eval() mode."
                )
            _update_running(running_mean, running_var, mean, var, total, momentum)
        else:
            mean, var, total = running_mean.float(), running_var.float(), 0.0
            if x.dtype == torch.float64:
                mean, var = mean.double(), var.double()
        invstd = torch.rsqrt(var + eps)
        y = _normalize(x3, mean, invstd, weight, bias, z, fuse_relu, x.dtype).view(x.shape)
        ctx.save_for_backward(x, weight, mean, invstd, y if fuse_relu else None)
        ctx.meta = (
            channel_last,
            fuse_relu,
            z is not None,
            group,
            world,
            total,
            training,
            bias is not None,
        )
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean, invstd, y = ctx.saved_tensors
        channel_last, fuse_relu, has_z, group, world, total, training, has_bias = ctx.meta
        if fuse_relu:
            dy = dy.masked_fill(y <= 0, 0)
        x3, dims = _shape(x, channel_last)
        g3 = dy.reshape(x3.shape).to(mean.dtype)
        xmu = x3.to(mean.dtype) - _bcast(mean, x3)
        sum_dy = g3.sum(dims)
        sum_dy_xmu = (g3 * xmu).sum(dims)
        gw = (sum_dy_xmu * invstd).to(weight.dtype) if weight is not None else None
        gb = sum_dy.to(weight.dtype if weight is not None else x.dtype) if has_bias else None
        scale = invstd if weight is None else invstd * weight.to(mean.dtype)
        if training:
            if world > 1:
                both = torch.cat([sum_dy, sum_dy_xmu])
                dist.all_reduce(both, group=group)
                sum_dy, sum_dy_xmu = both.chunk(2)
            mean_dy = sum_dy / total
            mean_dy_xmu = sum_dy_xmu / total
            dx = g3 - _bcast(mean_dy, x3) - xmu * _bcast(invstd * invstd * mean_dy_xmu, x3)
            dx = dx * _bcast(scale, x3)
        else:
            dx = g3 * _bcast(scale, x3)
        dx = dx.to(x.dtype).view(x.shape)
        dz = dy if has_z else None
        return dx, gw, gb, None, None, None, None, None, None, None, dz, None


def sync_batch_norm(
    x,
    weight,
    bias,
    running_mean,
    running_var,
    eps=1e-5,
    momentum=0.1,
    process_group=None,
    channel_last=False,
    fuse_relu=False,
    z=None,
    training=True,
):
    """Functional SyncBatchNorm (see :class:`mpnb.parallel.SyncBatchNorm`).

    Args:
        x: ``(N, C, *)``, or ``(N, *, C)`` with ``channel_last``.
        weight, bias: ``(C,)`` or None. running_mean, running_var: ``(C,)`` buffers or None.
        eps, momentum: as in ``nn.BatchNorm``. process_group: the ranks sharing statistics.
        fuse_relu: apply ReLU to the output. z: a residual added before the ReLU.
        training: use batch statistics (and update the running ones) or the running ones.

    Example::

        >>> y = sync_batch_norm(torch.randn(4, 3, 8), torch.ones(3), torch.zeros(3), None, None)
    """
    return SyncBatchnormFunction.apply(
        x,
        weight,
        bias,
        running_mean,
        running_var,
        eps,
        momentum,
        process_group,
        channel_last,
        fuse_relu,
        z,
        training,
    )
