"""Dense-layer epilogue op: ``bias_act_bwd`` (typed wrapper, reference, fake).

``bias_act_bwd(grad, saved, activation, bias_grad) -> (dz, db)``: ``dz = grad * act'(saved)``
and ``db = dz.sum(rows)`` in one pass (``db`` is empty when ``bias_grad`` is False).
``activation``: 0 none, 1 relu and 2 sigmoid (``saved`` = the activation's output), 3 gelu
(erf form; ``saved`` = its input). Used by :mod:`mpnb.core.mlp` and
:mod:`mpnb.core.fused_dense`, whose autograd functions call it directly (it is a backward).
"""

from __future__ import annotations

import math

import torch

from mpnb.core.ops._layer_common import acc_dtype, check_float
from mpnb.core.ops._registry import OpInfo, register_fake, register_op, use_kernel

__all__ = ["ACTIVATIONS", "bias_act_bwd", "reference_bias_act_bwd"]

ACTIVATIONS = {"none": 0, "relu": 1, "sigmoid": 2, "gelu": 3}


def _check(grad, saved, activation):
    check_float("bias_act_bwd", grad, "grad")
    if grad.shape != saved.shape or grad.dtype != saved.dtype:
        raise ValueError(
            f"bias_act_bwd: grad {tuple(grad.shape)} {grad.dtype} does not match the "
            f"saved activation {tuple(saved.shape)} {saved.dtype}."
        )
    if activation not in ACTIVATIONS.values():
        raise ValueError(
            f"bias_act_bwd: activation must be one of {ACTIVATIONS}, got {activation}."
        )


def reference_bias_act_bwd(grad, saved, activation, bias_grad):
    """Reference of :func:`bias_act_bwd` in fp32 (fp64 for fp64)."""
    _check(grad, saved, activation)
    acc = acc_dtype(grad)
    g, s = grad.to(acc), saved.to(acc)
    if activation == 1:
        g = g * (s > 0)
    elif activation == 2:
        g = g * s * (1 - s)
    elif activation == 3:
        cdf = 0.5 * (1 + torch.erf(s * math.sqrt(0.5)))
        g = g * (cdf + s * torch.exp(-0.5 * s * s) / math.sqrt(2 * math.pi))
    db = g.reshape(-1, g.shape[-1]).sum(0).to(grad.dtype) if bias_grad else grad.new_empty(0)
    return g.to(grad.dtype), db


def bias_act_bwd(grad, saved, activation: int, bias_grad: bool):
    """``(grad * act'(saved), column sums)`` in one pass; see the module docstring."""
    _check(grad, saved, activation)
    if use_kernel(grad):
        return torch.ops.mpnb.bias_act_bwd(grad, saved, int(activation), bool(bias_grad))
    return reference_bias_act_bwd(grad, saved, activation, bias_grad)


@register_fake("bias_act_bwd")
def _(grad, saved, activation, bias_grad):
    dz = torch.empty_like(grad, memory_format=torch.contiguous_format)
    return dz, grad.new_empty(grad.shape[-1] if bias_grad else 0)


register_op(OpInfo("bias_act_bwd", "layer", reference_bias_act_bwd))
