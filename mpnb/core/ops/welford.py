"""Per-channel batch statistics for SyncBatchNorm: typed wrappers, references and fakes.

Two ops, each with a pure-PyTorch reference of the same signature:

* ``welford_mean_var(input, channel_last=False) -> (mean, var)``: per-channel mean and biased
  variance, fp32 (fp64 for fp64 input). Channels are dim 1 (``(N, C, *)``) or, with
  ``channel_last``, the last dim (``(N, *, C)``).
* ``welford_parallel(mean, var, count) -> (mean, var)``: merges W ranks' statistics
  (``mean``/``var`` of shape ``[W, C]``, ``count`` of shape ``[W]``, one floating dtype) with
  Chan's formula in fp64; ranks with a count of 0 contribute nothing.
"""

from __future__ import annotations

import torch

from mpnb.core.ops._layer_common import acc_dtype, check_float
from mpnb.core.ops._registry import OpInfo, register_fake, register_op, use_kernel

__all__ = [
    "welford_mean_var",
    "welford_parallel",
    "reference_welford_mean_var",
    "reference_welford_parallel",
]


def _check_input(x: torch.Tensor, op: str) -> None:
    check_float(op, x)
    if x.dim() < 2:
        raise ValueError(
            f"{op}: input of shape {tuple(x.shape)} has no channel dim; pass (N, C, ...) "
            "(or (N, ..., C) with channel_last=True)."
        )


def _check_parallel(mean, var, count) -> None:
    ok = mean.dim() == 2 and var.shape == mean.shape and count.shape == (mean.shape[0],)
    if not ok:
        raise ValueError(
            "welford_parallel: expected mean and var of shape [world, C] and count of shape "
            f"[world], got {tuple(mean.shape)}, {tuple(var.shape)} and {tuple(count.shape)}."
        )
    if not (mean.is_floating_point() and var.dtype == mean.dtype == count.dtype):
        raise TypeError(
            "welford_parallel: mean, var and count must share one floating dtype, got "
            f"{mean.dtype}, {var.dtype} and {count.dtype}; convert the counts with .to(mean)."
        )


def reference_welford_mean_var(input: torch.Tensor, channel_last: bool = False):
    """Reference of :func:`welford_mean_var`: ``torch.var_mean`` in fp64, rounded to fp32."""
    _check_input(input, "welford_mean_var")
    dims = tuple(range(input.dim() - 1)) if channel_last else (0, *range(2, input.dim()))
    acc = acc_dtype(input)
    c = input.shape[-1] if channel_last else input.shape[1]
    if input.numel() == 0:
        return input.new_zeros(c, dtype=acc), input.new_zeros(c, dtype=acc)
    var, mean = torch.var_mean(input.double(), dim=dims, correction=0)
    return mean.to(acc), var.to(acc)


def reference_welford_parallel(mean: torch.Tensor, var: torch.Tensor, count: torch.Tensor):
    """Reference of :func:`welford_parallel`: the closed form of the merge, in fp64."""
    _check_parallel(mean, var, count)
    m, v, n = mean.double(), var.double(), count.double()[:, None]
    total = n.sum(0)
    safe = total.clamp_min(1e-300)
    mu = (m * n).sum(0) / safe
    var_out = ((v + (m - mu) ** 2) * n).sum(0) / safe
    zero = total == 0
    return mu.masked_fill(zero, 0).to(mean.dtype), var_out.masked_fill(zero, 0).to(mean.dtype)


def welford_mean_var(input: torch.Tensor, channel_last: bool = False):
    """Per-channel mean and biased variance of ``input`` (fp32 statistics for half input).

    Example::

        >>> mean, var = welford_mean_var(torch.randn(8, 3, 5, 5))
        >>> mean.shape, var.dtype
        (torch.Size([3]), torch.float32)
    """
    if use_kernel(input):
        _check_input(input, "welford_mean_var")
        return torch.ops.mpnb.welford_mean_var(input, bool(channel_last))
    return reference_welford_mean_var(input, channel_last)


def welford_parallel(mean: torch.Tensor, var: torch.Tensor, count: torch.Tensor):
    """Merge per-rank statistics: global per-channel mean and biased variance.

    Example::

        >>> m, v = welford_parallel(torch.zeros(2, 3), torch.ones(2, 3), torch.tensor([4., 2.]))
    """
    if use_kernel(mean):
        _check_parallel(mean, var, count)
        return torch.ops.mpnb.welford_parallel(mean, var, count)
    return reference_welford_parallel(mean, var, count)


@register_fake("welford_mean_var")
def _(input, channel_last=False):
    c = input.shape[-1] if channel_last else input.shape[1]
    acc = acc_dtype(input)
    return input.new_empty(c, dtype=acc), input.new_empty(c, dtype=acc)


@register_fake("welford_parallel")
def _(mean, var, count):
    return mean.new_empty(mean.shape[1]), mean.new_empty(mean.shape[1])


register_op(OpInfo("welford_mean_var", "layer", reference_welford_mean_var))
register_op(OpInfo("welford_parallel", "layer", reference_welford_parallel))
