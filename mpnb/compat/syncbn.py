"""Apex's ``syncbn`` extension: the Welford and batch-norm kernels, on mpnb's SyncBatchNorm steps.

Apex's ``optimized_sync_batchnorm_kernel`` (and code copied from it) calls these with Apex's
signatures; each maps onto the step :class:`mpnb.parallel.SyncBatchNorm` itself runs
(:mod:`mpnb.core.parallel.sync_batchnorm_kernel` and the Welford op). Statistics are fp32 for
half input. ``count`` arguments are the per-rank element counts per channel (a tensor, as
Apex's all-gathered ``count_all``) or one number.

Example::

    >>> import syncbn                          # under mpnb's Apex alias
    >>> mean, var_biased = syncbn.welford_mean_var(x)
    >>> mean, var, inv_std = syncbn.welford_parallel(mean[None], var_biased[None], counts, 1e-5)
    >>> y = syncbn.batchnorm_forward(x, mean, inv_std, weight, bias)
"""

from __future__ import annotations

import torch

from mpnb.core.ops.welford import welford_mean_var as _welford
from mpnb.core.ops.welford import welford_parallel as _merge
from mpnb.core.parallel.sync_batchnorm_kernel import (
    batchnorm_backward as _backward,
)
from mpnb.core.parallel.sync_batchnorm_kernel import (
    batchnorm_forward as _forward,
)
from mpnb.core.parallel.sync_batchnorm_kernel import (
    reduce_bn as _reduce,
)

__all__ = [
    "welford_mean_var",
    "welford_mean_var_c_last",
    "welford_parallel",
    "batchnorm_forward",
    "batchnorm_forward_c_last",
    "reduce_bn",
    "reduce_bn_c_last",
    "batchnorm_backward",
    "batchnorm_backward_c_last",
    "relu_bw_c_last",
]


def _total(count) -> float:
    return float(count.sum().item()) if isinstance(count, torch.Tensor) else float(count)


def welford_mean_var(input: torch.Tensor):
    """``(mean, biased_var)`` per channel of ``(N, C, *)`` input."""
    return _welford(input, False)


def welford_mean_var_c_last(input: torch.Tensor):
    """``(mean, biased_var)`` per channel of ``(N, *, C)`` input."""
    return _welford(input, True)


def welford_parallel(mean: torch.Tensor, var_biased: torch.Tensor, count, eps: float):
    """Merge ``[world, C]`` statistics: ``(mean, unbiased_var, inv_std)`` over every rank."""
    counts = count if isinstance(count, torch.Tensor) else torch.full((mean.shape[0],), count)
    counts = counts.to(device=mean.device, dtype=mean.dtype).reshape(-1)
    m, v = _merge(mean, var_biased, counts)
    n = float(counts.sum().item())
    unbiased = v * (n / (n - 1)) if n > 1 else v
    return m, unbiased, torch.rsqrt(v + eps)


def batchnorm_forward(input, mean, inv_std, weight, shift):
    """``(x - mean) * inv_std * weight + shift`` for ``(N, C, *)`` input."""
    return _forward(input, mean, inv_std, weight, shift)


def batchnorm_forward_c_last(input, z, mean, inv_std, weight, shift, fuse_relu: bool):
    """The same for ``(N, *, C)`` input, plus a residual ``z`` and an optional ReLU."""
    return _forward(input, mean, inv_std, weight, shift, z, fuse_relu, channel_last=True)


def reduce_bn(grad_output, input, mean, inv_std, weight):
    """``(sum_dy, sum_dy_xmu, grad_weight, grad_bias)`` of this rank, ``(N, C, *)`` input."""
    return _reduce(grad_output, input, mean, inv_std, weight)


def reduce_bn_c_last(grad_output, input, mean, inv_std, weight):
    """:func:`reduce_bn` for ``(N, *, C)`` input."""
    return _reduce(grad_output, input, mean, inv_std, weight, channel_last=True)


def batchnorm_backward(grad_output, input, mean, inv_std, weight, sum_dy, sum_dy_xmu, count):
    """``grad_input`` from the all-reduced sums; ``count``: the per-rank counts (summed)."""
    return _backward(grad_output, input, mean, inv_std, weight, sum_dy, sum_dy_xmu, _total(count))


def batchnorm_backward_c_last(grad_output, input, mean, inv_std, weight, sum_dy, sum_dy_xmu, count):
    """:func:`batchnorm_backward` for ``(N, *, C)`` input."""
    total = _total(count)
    return _backward(grad_output, input, mean, inv_std, weight, sum_dy, sum_dy_xmu, total, True)


def relu_bw_c_last(grad_output, input, z, mean, inv_std, weight, shift):
    """``grad_output`` zeroed where the fused ReLU's input (``bn(x) + z``) was not positive."""
    pre = _forward(input, mean, inv_std, weight, shift, z, False, channel_last=True)
    return grad_output.masked_fill(pre <= 0, 0)
