"""Rotary position embedding op: typed wrapper, pure-PyTorch reference, fake and autograd.

``rope(t, cos, sin, group, transpose_output=False, backward=False)``: ``t`` is ``[s, b, h, d]``
(any strides), ``cos``/``sin`` are fp32 (fp64 for fp64 ``t``) tables ``[s, d2]``, ``d2 <= d``.
The first ``d2`` channels form groups of ``group`` channels, each rotated as ``rotate_half``
(``y = x * cos + rotate_half(x) * sin``); the other channels pass through. ``backward=True``
applies the transposed rotation (the gradient). ``transpose_output`` lays the result out as
``[b, s, h, d]`` in memory (Apex's ``transpose_output_memory``), still shaped ``[s, b, h, d]``.
"""

from __future__ import annotations

import torch

from mpnb.core.ops._layer_common import acc_dtype, check_float
from mpnb.core.ops._registry import (
    OpInfo,
    register_autograd,
    register_fake,
    register_op,
    use_kernel,
)

__all__ = ["rope", "reference_rope", "check_rope"]


def check_rope(op: str, t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, group: int) -> None:
    """Raise with the problem and the fix unless the arguments fit :func:`rope`."""
    check_float(op, t, "t")
    if t.dim() != 4:
        raise ValueError(f"{op}: t must be [s, b, h, d], got shape {tuple(t.shape)}.")
    acc = acc_dtype(t)
    s, _, _, d = t.shape
    for name, tab in (("cos", cos), ("sin", sin)):
        if tab.dim() != 2 or tab.shape[0] != s or tab.shape[1] > d or tab.dtype != acc:
            raise ValueError(
                f"{op}: {name} must be a {acc} table [s={s}, d2<={d}], got "
                f"{tuple(tab.shape)} {tab.dtype}; the freqs/cos/sin must cover every position."
            )
        if tab.device != t.device:
            raise ValueError(f"{op}: {name} is on {tab.device} but t is on {t.device}.")
    d2 = cos.shape[1]
    if group <= 0 or group % 2 or d2 % group:
        raise ValueError(
            f"{op}: the rotary dim {d2} must be a multiple of an even group, got "
            f"group={group}; use an even number of rotary channels."
        )


def reference_rope(t, cos, sin, group, transpose_output=False, backward=False):
    """Reference of :func:`rope`, computed in fp32 (fp64 for fp64)."""
    check_rope("rope", t, cos, sin, group)
    acc = acc_dtype(t)
    d2 = cos.shape[1]
    half = group // 2
    x = t.to(acc)
    xr = x[..., :d2].unflatten(-1, (d2 // group, 2, half))
    c = cos[:, None, None, :].unflatten(-1, (d2 // group, 2, half))
    s = sin[:, None, None, :].unflatten(-1, (d2 // group, 2, half))
    x1, x2 = xr[..., 0, :], xr[..., 1, :]
    if backward:
        y1 = x1 * c[..., 0, :] + x2 * s[..., 1, :]
        y2 = x2 * c[..., 1, :] - x1 * s[..., 0, :]
    else:
        y1 = x1 * c[..., 0, :] - x2 * s[..., 0, :]
        y2 = x2 * c[..., 1, :] + x1 * s[..., 1, :]
    y = torch.cat([torch.stack([y1, y2], -2).flatten(-3), x[..., d2:]], -1).to(t.dtype)
    return y.transpose(0, 1).contiguous().transpose(0, 1) if transpose_output else y


def rope(t, cos, sin, group, transpose_output=False, backward=False):
    """Rotate ``t`` by the position tables (differentiable in ``t``); see the module docstring."""
    check_rope("rope", t, cos, sin, int(group))
    if use_kernel(t):
        return torch.ops.mpnb.rope(t, cos, sin, int(group), bool(transpose_output), bool(backward))
    return reference_rope(t, cos, sin, int(group), transpose_output, backward)


@register_fake("rope")
def _(t, cos, sin, group, transpose_output=False, backward=False):
    if transpose_output:
        s, b, h, d = t.shape
        return t.new_empty(b, s, h, d).transpose(0, 1)
    return t.new_empty(t.shape)


def _setup(ctx, inputs, output):
    _t, cos, sin, group, _transpose, backward = inputs
    ctx.group, ctx.backward = group, backward
    ctx.save_for_backward(cos, sin)


def _backward(ctx, gy):
    cos, sin = ctx.saved_tensors
    dx = torch.ops.mpnb.rope(gy, cos, sin, ctx.group, False, not ctx.backward)
    return dx, None, None, None, None, None


register_autograd("rope", _backward, _setup)
register_op(OpInfo("rope", "layer", reference_rope))
