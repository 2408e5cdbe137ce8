"""Layer norm and RMS norm ops: typed wrappers, pure-PyTorch references, fakes and autograd.

Four ops, each with a reference of the same signature:

* ``layer_norm_fwd(input, normalized_shape, weight, bias, eps, memory_efficient)
  -> (output, mean, invvar)``
* ``layer_norm_bwd(grad_out, saved, mean, invvar, normalized_shape, weight, bias,
  memory_efficient) -> (grad_input, grad_weight, grad_bias)``
* ``rms_norm_fwd(input, normalized_shape, weight, eps, memory_efficient) -> (output, invvar)``
* ``rms_norm_bwd(grad_out, saved, invvar, normalized_shape, weight, memory_efficient)
  -> (grad_input, grad_weight)``

``mean``/``invvar`` hold one fp32 value per row (fp64 for fp64 input). ``saved`` is the input,
or the output when ``memory_efficient`` (the backward then recomputes ``xhat = (y - b) / w``,
as Apex does). Missing weight/bias gradients are returned as empty tensors by the ops and as
``None`` through autograd. Weights may be the input's dtype or fp32 (the "mixed" layers).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mpnb.core.ops._layer_common import (
    acc_dtype,
    check_float,
    check_param,
    norm_rows,
)
from mpnb.core.ops._registry import (
    OpInfo,
    register_autograd,
    register_fake,
    register_op,
    use_kernel,
)

__all__ = [
    "layer_norm_fwd",
    "layer_norm_bwd",
    "rms_norm_fwd",
    "rms_norm_bwd",
    "reference_layer_norm_fwd",
    "reference_layer_norm_bwd",
    "reference_rms_norm_fwd",
    "reference_rms_norm_bwd",
]

Shape = Sequence[int]


def _validate(op: str, x: torch.Tensor, shape: Shape, weight, bias=None) -> tuple[int, int]:
    check_float(op, x, "input")
    rows, cols = norm_rows(op, x, shape)
    check_param(op, x, weight, cols, "weight")
    check_param(op, x, bias, cols, "bias")
    if weight is not None and bias is not None and weight.dtype != bias.dtype:
        raise TypeError(
            f"{op}: weight is {weight.dtype} but bias is {bias.dtype}; give them one dtype."
        )
    return rows, cols


def _empty(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(0)


# ---- references ---------------------------------------------------------------------------


def reference_layer_norm_fwd(input, normalized_shape, weight, bias, eps, memory_efficient=False):
    """Reference of :func:`layer_norm_fwd`: statistics in fp32 (fp64 for fp64), two-pass."""
    rows, cols = _validate("layer_norm_fwd", input, normalized_shape, weight, bias)
    acc = acc_dtype(input)
    x = input.reshape(rows, cols).to(acc)
    mean = x.mean(dim=1)
    xc = x - mean[:, None]
    invvar = torch.rsqrt((xc * xc).mean(dim=1) + eps)
    y = xc * invvar[:, None]
    if weight is not None:
        y = y * weight.reshape(cols).to(acc)
    if bias is not None:
        y = y + bias.reshape(cols).to(acc)
    return y.to(input.dtype).reshape(input.shape), mean, invvar


def reference_rms_norm_fwd(input, normalized_shape, weight, eps, memory_efficient=False):
    """Reference of :func:`rms_norm_fwd`: ``y = x * rsqrt(mean(x^2) + eps) * w`` in fp32."""
    rows, cols = _validate("rms_norm_fwd", input, normalized_shape, weight)
    x = input.reshape(rows, cols).to(acc_dtype(input))
    invvar = torch.rsqrt((x * x).mean(dim=1) + eps)
    y = x * invvar[:, None]
    if weight is not None:
        y = y * weight.reshape(cols).to(y.dtype)
    return y.to(input.dtype).reshape(input.shape), invvar


def _xhat(saved, mean, invvar, weight, bias, rows, cols, memory_efficient, acc):
    s = saved.reshape(rows, cols).to(acc)
    if not memory_efficient:
        return s * invvar[:, None] if mean is None else (s - mean[:, None]) * invvar[:, None]
    if bias is not None:
        s = s - bias.reshape(cols).to(acc)
    if weight is not None:
        s = s / weight.reshape(cols).to(acc)
    return s


def _norm_bwd(grad_out, saved, mean, invvar, shape, weight, bias, memory_efficient, rms):
    rows, cols = norm_rows("norm_bwd", saved, shape)
    acc = acc_dtype(saved)
    xhat = _xhat(
        saved, None if rms else mean, invvar, weight, bias, rows, cols, memory_efficient, acc
    )
    dy = grad_out.reshape(rows, cols).to(acc)
    g = dy * weight.reshape(cols).to(acc) if weight is not None else dy
    c1 = (g * xhat).mean(dim=1, keepdim=True)
    dx = g - xhat * c1
    if not rms:
        dx = dx - g.mean(dim=1, keepdim=True)
    dx = (dx * invvar[:, None]).to(saved.dtype).reshape(saved.shape)
    dw = _empty(saved) if weight is None else (dy * xhat).sum(0).to(weight.dtype).view(weight.shape)
    db = _empty(saved) if bias is None else dy.sum(0).to(bias.dtype).view(bias.shape)
    return dx, dw, db


def reference_layer_norm_bwd(
    grad_out, saved, mean, invvar, normalized_shape, weight, bias, memory_efficient=False
):
    """Reference of :func:`layer_norm_bwd` (the textbook formula, in fp32)."""
    return _norm_bwd(
        grad_out, saved, mean, invvar, normalized_shape, weight, bias, memory_efficient, False
    )


def reference_rms_norm_bwd(
    grad_out, saved, invvar, normalized_shape, weight, memory_efficient=False
):
    """Reference of :func:`rms_norm_bwd`."""
    dx, dw, _ = _norm_bwd(
        grad_out, saved, None, invvar, normalized_shape, weight, None, memory_efficient, True
    )
    return dx, dw


# ---- dispatchers --------------------------------------------------------------------------


def layer_norm_fwd(
    input, normalized_shape, weight=None, bias=None, eps=1e-5, memory_efficient=False
):
    """Layer norm over the trailing ``normalized_shape`` dims; returns ``(y, mean, invvar)``.

    Differentiable (through the kernel's registered autograd or the reference's ops).

    Example::

        >>> y, mean, invvar = layer_norm_fwd(torch.randn(4, 8), [8], torch.ones(8), torch.zeros(8))
    """
    shape = [int(s) for s in normalized_shape]
    if use_kernel(input):
        _validate("layer_norm_fwd", input, shape, weight, bias)
        return torch.ops.mpnb.layer_norm_fwd(
            input, shape, weight, bias, float(eps), bool(memory_efficient)
        )
    return reference_layer_norm_fwd(input, shape, weight, bias, eps, memory_efficient)


def rms_norm_fwd(input, normalized_shape, weight=None, eps=1e-5, memory_efficient=False):
    """RMS norm over the trailing ``normalized_shape`` dims; returns ``(y, invvar)``."""
    shape = [int(s) for s in normalized_shape]
    if use_kernel(input):
        _validate("rms_norm_fwd", input, shape, weight)
        return torch.ops.mpnb.rms_norm_fwd(input, shape, weight, float(eps), bool(memory_efficient))
    return reference_rms_norm_fwd(input, shape, weight, eps, memory_efficient)


def layer_norm_bwd(
    grad_out, saved, mean, invvar, normalized_shape, weight=None, bias=None, memory_efficient=False
):
    """Gradients of :func:`layer_norm_fwd`: ``(grad_input, grad_weight, grad_bias)``."""
    shape = [int(s) for s in normalized_shape]
    if use_kernel(saved):
        return torch.ops.mpnb.layer_norm_bwd(
            grad_out, saved, mean, invvar, shape, weight, bias, bool(memory_efficient)
        )
    return reference_layer_norm_bwd(
        grad_out, saved, mean, invvar, shape, weight, bias, memory_efficient
    )


def rms_norm_bwd(grad_out, saved, invvar, normalized_shape, weight=None, memory_efficient=False):
    """Gradients of :func:`rms_norm_fwd`: ``(grad_input, grad_weight)``."""
    shape = [int(s) for s in normalized_shape]
    if use_kernel(saved):
        return torch.ops.mpnb.rms_norm_bwd(
            grad_out, saved, invvar, shape, weight, bool(memory_efficient)
        )
    return reference_rms_norm_bwd(grad_out, saved, invvar, shape, weight, memory_efficient)


# ---- fakes --------------------------------------------------------------------------------


def _stats(x: torch.Tensor, shape: Shape) -> int:
    cols = 1
    for s in shape:
        cols *= s
    return x.numel() // cols if cols else 0


@register_fake("layer_norm_fwd")
def _(input, normalized_shape, weight, bias, eps, memory_efficient=False):
    rows = _stats(input, normalized_shape)
    acc = acc_dtype(input)
    y = torch.empty_like(input, memory_format=torch.contiguous_format)
    return y, input.new_empty(rows, dtype=acc), input.new_empty(rows, dtype=acc)


@register_fake("rms_norm_fwd")
def _(input, normalized_shape, weight, eps, memory_efficient=False):
    y = torch.empty_like(input, memory_format=torch.contiguous_format)
    return y, input.new_empty(_stats(input, normalized_shape), dtype=acc_dtype(input))


def _grad_like(p, saved):
    return (
        _empty(saved) if p is None else torch.empty_like(p, memory_format=torch.contiguous_format)
    )


@register_fake("layer_norm_bwd")
def _(grad_out, saved, mean, invvar, normalized_shape, weight, bias, memory_efficient):
    dx = torch.empty_like(saved, memory_format=torch.contiguous_format)
    return dx, _grad_like(weight, saved), _grad_like(bias, saved)


@register_fake("rms_norm_bwd")
def _(grad_out, saved, invvar, normalized_shape, weight, memory_efficient):
    return torch.empty_like(saved, memory_format=torch.contiguous_format), _grad_like(weight, saved)


# ---- autograd of the kernels --------------------------------------------------------------


def _ln_setup(ctx, inputs, output):
    x, shape, w, b, _eps, me = inputs
    y, mean, invvar = output
    ctx.shape, ctx.me = shape, me
    ctx.save_for_backward(y if me else x, mean, invvar, w, b)
    ctx.mark_non_differentiable(mean, invvar)


def _ln_backward(ctx, gy, _gmean, _ginvvar):
    saved, mean, invvar, w, b = ctx.saved_tensors
    dx, dw, db = torch.ops.mpnb.layer_norm_bwd(
        gy.contiguous(), saved, mean, invvar, ctx.shape, w, b, ctx.me
    )
    return dx, None, dw if w is not None else None, db if b is not None else None, None, None


def _rms_setup(ctx, inputs, output):
    x, shape, w, _eps, me = inputs
    y, invvar = output
    ctx.shape, ctx.me = shape, me
    ctx.save_for_backward(y if me else x, invvar, w)
    ctx.mark_non_differentiable(invvar)


def _rms_backward(ctx, gy, _ginvvar):
    saved, invvar, w = ctx.saved_tensors
    dx, dw = torch.ops.mpnb.rms_norm_bwd(gy.contiguous(), saved, invvar, ctx.shape, w, ctx.me)
    return dx, None, dw if w is not None else None, None, None


register_autograd("layer_norm_fwd", _ln_backward, _ln_setup)
register_autograd("rms_norm_fwd", _rms_backward, _rms_setup)

for _name, _ref in (
    ("layer_norm_fwd", reference_layer_norm_fwd),
    ("layer_norm_bwd", reference_layer_norm_bwd),
    ("rms_norm_fwd", reference_rms_norm_fwd),
    ("rms_norm_bwd", reference_rms_norm_bwd),
):
    register_op(OpInfo(_name, "layer", _ref))
