"""``mpnb::bias_act_bwd``: the backward epilogue of a dense layer and its activation.

:func:`bias_act_bwd` returns ``(dz, db)``: ``dz = grad * act'(saved)`` and
``db = dz.sum(rows)`` in one pass (``db`` is empty when ``bias_grad`` is False).
``activation``: 0 none, 1 relu and 2 sigmoid (``saved`` = the activation's output), 3 gelu
(erf form; ``saved`` = its input). Used by :mod:`mpnb.core.mlp` and
:mod:`mpnb.core.fused_dense`, whose autograd functions call it (it is itself a backward, and
is not differentiable).

Kernels: ``csrc/cpu/dense.cpp`` (CPU); the reference elsewhere.
"""

from __future__ import annotations

import math

import torch

from mpnb.core.ops._checks import acc_dtype, check_float
from mpnb.core.ops._library import Sample, Tensor, define

__all__ = ["ACTIVATIONS", "bias_act_bwd", "reference_bias_act_bwd"]

#: The activation codes of :func:`bias_act_bwd` (Apex's ``mlp`` uses 0, 1 and 2).
ACTIVATIONS = {"none": 0, "relu": 1, "sigmoid": 2, "gelu": 3}


def reference_bias_act_bwd(
    grad: Tensor, saved: Tensor, activation: int, bias_grad: bool
) -> tuple[Tensor, Tensor]:
    """``(grad * act'(saved), column sums)`` in one pass; see :mod:`mpnb.core.ops.dense`. The
    reference computes in fp32 (fp64 for fp64).

    Args:
        grad: the gradient of the activation's output, ``[..., features]``.
        saved: the activation's output (relu, sigmoid) or input (gelu), like ``grad``.
        activation: a value of :data:`ACTIVATIONS`.
        bias_grad: also return the bias gradient (``dz`` summed over every row).

    Example::

        >>> y = torch.relu(torch.randn(4, 3))
        >>> dz, db = bias_act_bwd(torch.ones(4, 3), y, ACTIVATIONS["relu"], True)
    """
    acc = acc_dtype(grad)
    g, s = grad.to(acc), saved.to(acc)
    if activation == 1:
        g = g * (s > 0)
    elif activation == 2:
        g = g * s * (1 - s)
    elif activation == 3:
        cdf = 0.5 * (1 + torch.erf(s * math.sqrt(0.5)))
        g = g * (cdf + s * torch.exp(-0.5 * s * s) / math.sqrt(2 * math.pi))
    if bias_grad:
        db = (g.flatten(0, -2) if g.dim() > 1 else g[None]).sum(0).to(grad.dtype)
    else:
        db = grad.new_empty(0)
    return g.to(grad.dtype), db


def _check(args, per_tensor: bool) -> None:
    op, grad, saved = args.op_name, args.grad, args.saved
    check_float(op, grad, "grad")
    if grad.shape != saved.shape or grad.dtype != saved.dtype:
        raise ValueError(
            f"{op}: grad {tuple(grad.shape)} {grad.dtype} does not match the saved activation "
            f"{tuple(saved.shape)} {saved.dtype}; pass the tensor the forward saved for this "
            "gradient."
        )
    if args.activation not in ACTIVATIONS.values():
        raise ValueError(f"{op}: activation must be one of {ACTIVATIONS}, got {args.activation}.")
    if grad.dim() < 1:
        raise ValueError(f"{op}: grad is a scalar; pass [..., features] gradients.")


def _fake(args):
    grad = args.grad
    dz = torch.empty_like(grad, memory_format=torch.contiguous_format)
    return dz, grad.new_empty(grad.shape[-1] if args.bias_grad else 0)


def _samples(dtype):
    g = torch.Generator().manual_seed(0)

    def make(shape, act, bias_grad):
        dy = torch.randn(shape, generator=g).to(dtype)
        s = torch.randn(shape, generator=g).to(dtype)
        s = s.sigmoid() if act == 2 else s
        return dict(grad=dy, saved=s, activation=act, bias_grad=bias_grad)

    for act in ACTIVATIONS.values():
        for cols in (1, 3, 1000):
            for bias_grad in (True, False):
                name = f"act={act} cols={cols} bias_grad={bias_grad}"
                yield Sample(make((37, cols), act, bias_grad), name=name)
        yield Sample(make((2, 5, 7), act, True), name=f"act={act} 3-d")
    yield Sample(make((9,), 3, True), name="1-d")
    yield Sample(make((0, 5), 1, True), name="no rows")
    yield Sample(make((4, 0), 1, True), name="no columns")


# Kernel vs reference, measured over the samples: the gelu derivative uses ATen's vectorized
# erf and exp (a few ulp); db sums per-thread partials in another order (and the number of
# partials depends on the number of threads); a half dz is within one rounding.
TOLERANCE = {
    torch.float32: (1e-6, 4e-6),
    torch.float64: (1e-13, 1e-15),
    torch.float16: (2**-10, 1e-6),
    torch.bfloat16: (2**-7, 1e-6),
}

OP = define(
    reference_bias_act_bwd,
    family="dense",
    check=_check,
    fake=_fake,
    sample_inputs=_samples,
    tolerance=TOLERANCE,
)
bias_act_bwd = OP.wrapper
