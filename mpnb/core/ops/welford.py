"""``mpnb::welford_mean_var`` and ``mpnb::welford_parallel``: SyncBatchNorm's batch statistics.

* :func:`welford_mean_var` returns ``(mean, var)``: per-channel mean and biased
  variance, fp32 (fp64 for fp64 input). Channels are dim 1 (``(N, C, *)``) or, with
  ``channel_last``, the last dim (``(N, *, C)``).
* :func:`welford_parallel` returns ``(mean, var)``: it merges W ranks' statistics
  (``mean``/``var`` of shape ``[W, C]``, ``count`` of shape ``[W]``, one floating dtype) with
  Chan's formula in fp64; ranks with a count of 0 contribute nothing.

Neither is differentiable (SyncBatchNorm's autograd function writes its own backward).

Kernels: ``csrc/cpu/welford.cpp`` (CPU); the reference elsewhere.
"""

from __future__ import annotations

import torch

from mpnb.core.ops._checks import acc_dtype, check_float
from mpnb.core.ops._library import Sample, Tensor, define

__all__ = [
    "welford_mean_var",
    "welford_parallel",
    "reference_welford_mean_var",
    "reference_welford_parallel",
]


def reference_welford_mean_var(input: Tensor, channel_last: bool = False) -> tuple[Tensor, Tensor]:
    """Per-channel mean and biased variance of ``input`` (fp32 statistics for half input);
    the reference is ``torch.var_mean`` in fp64, rounded to fp32.

    Example::

        >>> mean, var = welford_mean_var(torch.randn(8, 3, 5, 5))
        >>> mean.shape, var.dtype
        (torch.Size([3]), torch.float32)
    """
    dims = tuple(range(input.dim() - 1)) if channel_last else (0, *range(2, input.dim()))
    acc = acc_dtype(input)
    c = input.shape[-1] if channel_last else input.shape[1]
    if input.numel() == 0:
        return input.new_zeros(c, dtype=acc), input.new_zeros(c, dtype=acc)
    var, mean = torch.var_mean(input.double(), dim=dims, correction=0)
    return mean.to(acc), var.to(acc)


def reference_welford_parallel(mean: Tensor, var: Tensor, count: Tensor) -> tuple[Tensor, Tensor]:
    """Merge per-rank statistics: global per-channel mean and biased variance (the reference
    is the closed form of the merge, in fp64).

    Example::

        >>> m, v = welford_parallel(torch.zeros(2, 3), torch.ones(2, 3), torch.tensor([4., 2.]))
    """
    m, v, n = mean.double(), var.double(), count.double()[:, None]
    total = n.sum(0)
    safe = total.clamp_min(1e-300)
    mu = (m * n).sum(0) / safe
    var_out = ((v + (m - mu) ** 2) * n).sum(0) / safe
    zero = total == 0
    return mu.masked_fill(zero, 0).to(mean.dtype), var_out.masked_fill(zero, 0).to(mean.dtype)


def _check_mean_var(args, per_tensor: bool) -> None:
    op, x = args.op_name, args.input
    check_float(op, x)
    if x.dim() < 2:
        raise ValueError(
            f"{op}: input of shape {tuple(x.shape)} has no channel dim; pass (N, C, ...) "
            "(or (N, ..., C) with channel_last=True)."
        )


def _check_parallel(args, per_tensor: bool) -> None:
    op, mean, var, count = args.op_name, args.mean, args.var, args.count
    ok = mean.dim() == 2 and var.shape == mean.shape and count.shape == (mean.shape[0],)
    if not ok:
        raise ValueError(
            f"{op}: expected mean and var of shape [world, C] and count of shape [world], got "
            f"{tuple(mean.shape)}, {tuple(var.shape)} and {tuple(count.shape)}; stack one row "
            "per rank."
        )
    if not (mean.is_floating_point() and var.dtype == mean.dtype == count.dtype):
        raise TypeError(
            f"{op}: mean, var and count must share one floating dtype, got {mean.dtype}, "
            f"{var.dtype} and {count.dtype}; convert the counts with .to(mean)."
        )


def _fake_mean_var(args):
    x = args.input
    c = x.shape[-1] if args.channel_last else x.shape[1]
    acc = acc_dtype(x)
    return x.new_empty(c, dtype=acc), x.new_empty(c, dtype=acc)


def _fake_parallel(args):
    mean = args.mean
    return mean.new_empty(mean.shape[1]), mean.new_empty(mean.shape[1])


_SHAPES = (
    ((7, 5), False),
    ((4, 3, 33), False),
    ((3, 6, 4, 5), False),
    ((2, 3, 2, 3, 4), False),
    ((300, 2, 70), False),
    ((9, 17), True),
    ((2, 5, 6, 19), True),
    ((1200, 40), True),
    ((0, 4, 3), False),
    ((0, 6), True),
)


def _samples_mean_var(dtype):
    for i, (shape, channel_last) in enumerate(_SHAPES):
        g = torch.Generator().manual_seed(i)
        x = (torch.randn(shape, generator=g, dtype=torch.float64) * 3 + 1).to(dtype)
        kw = dict(input=x, channel_last=channel_last)
        yield Sample(kw, name=f"{shape} channel_last={channel_last}")
    g = torch.Generator().manual_seed(len(_SHAPES))
    x = torch.randn(3, 4, 20, generator=g, dtype=torch.float64).to(dtype).transpose(1, 2)
    yield Sample(dict(input=x, channel_last=True), name="strided, channel_last")


def _samples_parallel(dtype):
    g = torch.Generator().manual_seed(0)
    for world, c in ((1, 5), (2, 3), (4, 70)):
        mean = (torch.randn(world, c, generator=g, dtype=torch.float64) * 2).to(dtype)
        var = (torch.rand(world, c, generator=g, dtype=torch.float64) + 0.1).to(dtype)
        count = torch.randint(1, 50, (world,), generator=g).to(dtype)
        yield Sample(dict(mean=mean, var=var, count=count), name=f"world={world} C={c}")
    mean = torch.randn(3, 4, generator=g, dtype=torch.float64).to(dtype)
    var = torch.rand(3, 4, generator=g, dtype=torch.float64).to(dtype)
    count = torch.tensor([5.0, 0.0, 2.0]).to(dtype)
    yield Sample(dict(mean=mean, var=var, count=count), name="a rank without data")
    count = torch.zeros(3).to(dtype)
    yield Sample(dict(mean=mean, var=var, count=count), name="no data at all")


# Kernel vs reference, measured over the samples: the kernel merges fp32 chunk statistics with
# Chan's formula, the reference reduces in fp64; both round the result to fp32 once. The
# statistics are fp32 for every half input. (The chunks depend on the shape only.)
MEAN_VAR_TOLERANCE = {
    torch.float32: (1e-6, 1e-6),
    torch.float64: (1e-14, 1e-15),
    torch.float16: (1e-6, 1e-6),
    torch.bfloat16: (1e-6, 1e-6),
}
# Both merge in fp64 and round once to the statistics' dtype (bitwise but for fp64, where the
# kernel's sequential merge and the reference's closed form differ in the last bits).
PARALLEL_TOLERANCE = {torch.float64: (1e-14, 0.0)}

MEAN_VAR = define(
    reference_welford_mean_var,
    family="welford",
    check=_check_mean_var,
    fake=_fake_mean_var,
    sample_inputs=_samples_mean_var,
    tolerance=MEAN_VAR_TOLERANCE,
)
PARALLEL = define(
    reference_welford_parallel,
    family="welford",
    check=_check_parallel,
    fake=_fake_parallel,
    sample_inputs=_samples_parallel,
    tolerance=PARALLEL_TOLERANCE,
)
welford_mean_var = MEAN_VAR.wrapper
welford_parallel = PARALLEL.wrapper
