"""The autograd function of SyncBatchNorm: statistics over every rank's batch.

Forward: per-rank per-channel mean/variance from the Welford kernel (fp32 for half input),
one ``all_gather`` of ``(mean, var, count)`` per rank (fp64, so counts stay exact), Chan's
merge (``welford_parallel``), then the elementwise normalize (+ optional residual ``z`` and
ReLU) in fp32. Backward: local ``sum(dy)`` and ``sum(dy * (x - mean))`` per channel, one
``all_reduce`` of both, then the input gradient; the weight and bias gradients stay local
(summed over the ranks by DDP, as in Apex and PyTorch). Ranks may hold different batch sizes,
including none.

The three elementwise/reduction steps are functions of their own (:func:`batchnorm_forward`,
:func:`reduce_bn`, :func:`batchnorm_backward`, Apex's ``syncbn`` kernels) and work on the
input in its own shape: the output is a fresh tensor, never a view, so an in-place op after
the layer (``ReLU(inplace=True)``) is allowed by autograd.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mpnb.core.ops.welford import welford_mean_var, welford_parallel
from mpnb.core.parallel._watch import collective_watch, wait_watched

__all__ = [
    "SyncBatchnormFunction",
    "sync_batch_norm",
    "world_of",
    "check_channels",
    "batchnorm_forward",
    "reduce_bn",
    "batchnorm_backward",
]


def _wait(work, group, what: str) -> None:
    """Wait for ``work``, a collective of ``group``; under launch (gloo) a long wait fails
    naming the ranks that returned or that wait in another collective (see ``_watch.py``)."""
    cw = collective_watch(group)
    if cw is None:
        work.wait()
        return
    me = dist.get_rank()

    def gone_error(gone: list[int]) -> RuntimeError:
        return RuntimeError(
            f"SyncBatchNorm: rank {me} waits in {what}, but rank(s) "
            f"{', '.join(map(str, gone))} already returned from the launched function: they "
            "ran fewer SyncBatchNorm collectives. A SyncBatchNorm in eval() mode runs none, so "
            "call model.train() or model.eval() on every rank alike; and give every rank the "
            "same number of batches."
        )

    wait_watched(work, cw.watch(cw.issue(), what, gone_error))


def check_channels(x: torch.Tensor, channel_last: bool, group) -> None:
    """Refuse, on every rank, ranks whose inputs have different channel counts (a gather of
    unequal statistics would abort gloo: "EnforceNotMet ... Received data size doesn't
    match"). One all-gather of one number per rank; a no-op on one rank."""
    world = world_of(group)
    if world == 1:
        return
    c = x.shape[-1] if channel_last else x.shape[1]
    mine = torch.tensor([float(c)], dtype=torch.float64, device=x.device)
    parts = [torch.empty_like(mine) for _ in range(world)]
    work = dist.all_gather(parts, mine, group=group, async_op=True)
    _wait(work, group, "SyncBatchNorm's channel check (its first training forward)")
    counts = [int(p.item()) for p in parts]
    if len(set(counts)) > 1:
        ranks = [dist.get_global_rank(group, i) if group is not None else i for i in range(world)]
        seen = ", ".join(f"rank {r}: {n}" for r, n in zip(ranks, counts, strict=True))
        raise ValueError(
            f"SyncBatchNorm: the ranks normalize different numbers of channels ({seen}), so "
            "their statistics cannot be merged. Build the same model on every rank (the same "
            "num_features for this layer) and give it inputs of the same channel count."
        )


def world_of(group) -> int:
    """World size of ``group``; 1 when torch.distributed is not initialized."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def _per_channel(v: torch.Tensor, x: torch.Tensor, channel_last: bool) -> torch.Tensor:
    # A (C,) vector viewed to broadcast against x: (1, C, 1, ...) for (N, C, *), (C,) for
    # (N, *, C) and (N, C).
    if channel_last or x.dim() == 2:
        return v
    return v.view(1, -1, *([1] * (x.dim() - 2)))


def _reduce_dims(x: torch.Tensor, channel_last: bool) -> list[int]:
    if channel_last:
        return list(range(x.dim() - 1))
    return [0, *range(2, x.dim())]


def _count(x: torch.Tensor, channel_last: bool) -> int:
    c = x.shape[-1] if channel_last else x.shape[1]
    return x.numel() // max(c, 1)


def _global_stats(x, channel_last, group, world):
    mean, var = welford_mean_var(x, channel_last)
    count = float(_count(x, channel_last))
    if world == 1:
        return mean, var, count
    c = mean.numel()
    mine = torch.cat([mean.double(), var.double(), mean.new_full((1,), count, dtype=torch.float64)])
    parts = [torch.empty_like(mine) for _ in range(world)]
    work = dist.all_gather(parts, mine, group=group, async_op=True)
    _wait(work, group, "SyncBatchNorm's statistics all_gather (a training forward)")
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


def _affine(x, mean, invstd, weight, bias, z, channel_last):
    # (x - mean) * invstd * w + b (+ z), in the statistics' dtype, in x's own shape.
    acc = mean.dtype
    y = (x.to(acc) - _per_channel(mean, x, channel_last)) * _per_channel(invstd, x, channel_last)
    if weight is not None:
        y = y * _per_channel(weight.to(acc), x, channel_last)
    if bias is not None:
        y = y + _per_channel(bias.to(acc), x, channel_last)
    if z is not None:
        y = y + z.to(acc)
    return y


def batchnorm_forward(
    x: torch.Tensor,
    mean: torch.Tensor,
    invstd: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    z: torch.Tensor | None = None,
    fuse_relu: bool = False,
    channel_last: bool = False,
) -> torch.Tensor:
    """``relu?((x - mean) * invstd * weight + bias + z)`` in ``x``'s dtype (math in fp32 for half).

    Args:
        x: ``(N, C, *)``, or ``(N, *, C)`` with ``channel_last``.
        mean, invstd: ``(C,)`` statistics (fp32 for half input).
        weight, bias: ``(C,)`` or None. z: a residual of ``x``'s shape, or None.
        fuse_relu: apply ReLU to the result.

    Returns:
        A new tensor of ``x``'s shape (never a view of ``x`` or of a temporary).

    Example::

        >>> x = torch.randn(4, 3, 5)
        >>> var, mean = torch.var_mean(x, dim=(0, 2), correction=0)
        >>> y = batchnorm_forward(x, mean, torch.rsqrt(var + 1e-5), None, None)
    """
    y = _affine(x, mean, invstd, weight, bias, z, channel_last)
    if fuse_relu:
        y = torch.relu(y)
    return y.to(x.dtype)


def reduce_bn(
    dy: torch.Tensor,
    x: torch.Tensor,
    mean: torch.Tensor,
    invstd: torch.Tensor,
    weight: torch.Tensor | None,
    channel_last: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """This rank's per-channel ``sum(dy)``, ``sum(dy * (x - mean))`` and the affine gradients.

    Returns:
        ``(sum_dy, sum_dy_xmu, grad_weight, grad_bias)``: the sums in the statistics' dtype
        (to be all-reduced over the ranks), the gradients in ``weight``'s dtype (None without
        a weight).

    Example::

        >>> sum_dy, sum_dy_xmu, gw, gb = reduce_bn(dy, x, mean, invstd, weight)
    """
    acc = mean.dtype
    dims = _reduce_dims(x, channel_last)
    g = dy.to(acc)
    xmu = x.to(acc) - _per_channel(mean, x, channel_last)
    sum_dy = g.sum(dims)
    sum_dy_xmu = (g * xmu).sum(dims)
    if weight is None:
        return sum_dy, sum_dy_xmu, None, None
    return sum_dy, sum_dy_xmu, (sum_dy_xmu * invstd).to(weight.dtype), sum_dy.to(weight.dtype)


def batchnorm_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    mean: torch.Tensor,
    invstd: torch.Tensor,
    weight: torch.Tensor | None,
    sum_dy: torch.Tensor,
    sum_dy_xmu: torch.Tensor,
    count: float,
    channel_last: bool = False,
) -> torch.Tensor:
    r"""The input gradient of a training-mode batch norm, from the sums over every rank.

    .. math::
        dx = \bigl(dy - \tfrac{\sum dy}{n} - (x - \mu)\,\sigma^{-2}\,
             \tfrac{\sum dy\,(x - \mu)}{n}\bigr)\,\sigma^{-1} w

    Args:
        sum_dy, sum_dy_xmu: :func:`reduce_bn`'s sums, already all-reduced over the ranks.
        count: ``n``, the number of values per channel over every rank.

    Example::

        >>> dx = batchnorm_backward(dy, x, mean, invstd, weight, sum_dy, sum_dy_xmu, 64)
    """
    acc = mean.dtype
    scale = invstd if weight is None else invstd * weight.to(acc)
    mean_dy = sum_dy / count
    mean_dy_xmu = sum_dy_xmu / count
    xmu = x.to(acc) - _per_channel(mean, x, channel_last)
    dx = dy.to(acc) - _per_channel(mean_dy, x, channel_last)
    dx = dx - xmu * _per_channel(invstd * invstd * mean_dy_xmu, x, channel_last)
    return (dx * _per_channel(scale, x, channel_last)).to(x.dtype)


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
        world = world_of(group)
        if training:
            mean, var, total = _global_stats(x, channel_last, group, world)
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
        y = batchnorm_forward(x, mean, invstd, weight, bias, z, fuse_relu, channel_last)
        # The ReLU's mask, not y: the caller may modify y in place (ReLU(inplace=True) after).
        mask = y > 0 if fuse_relu else None
        ctx.save_for_backward(x, weight, mean, invstd, mask)
        ctx.meta = (channel_last, z is not None, group, world, total, training, bias is not None)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean, invstd, mask = ctx.saved_tensors
        channel_last, has_z, group, world, total, training, has_bias = ctx.meta
        if mask is not None:
            dy = dy.masked_fill(~mask, 0)
        sum_dy, sum_dy_xmu, gw, gb = reduce_bn(dy, x, mean, invstd, weight, channel_last)
        if not has_bias:
            gb = None
        elif gb is None:  # a bias without a weight
            gb = sum_dy.to(x.dtype)
        if training:
            if world > 1:
                both = torch.cat([sum_dy, sum_dy_xmu])
                work = dist.all_reduce(both, group=group, async_op=True)
                _wait(work, group, "SyncBatchNorm's gradient all_reduce (a training backward)")
                sum_dy, sum_dy_xmu = both.chunk(2)
            dx = batchnorm_backward(
                dy, x, mean, invstd, weight, sum_dy, sum_dy_xmu, total, channel_last
            )
        else:
            scale = invstd if weight is None else invstd * weight.to(mean.dtype)
            dx = (dy.to(mean.dtype) * _per_channel(scale, x, channel_last)).to(x.dtype)
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

    Returns:
        A new tensor (not a view): in-place ops on it, such as ``ReLU(inplace=True)``, are
        allowed and keep the gradients exact.

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
