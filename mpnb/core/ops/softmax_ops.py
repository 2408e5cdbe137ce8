"""Fused scaled (masked) softmax ops: typed wrappers, references, fakes and autograd.

The kernels behind Apex's ``FusedScaleMaskSoftmax`` (softmax over the last dim, computed in
fp32 for half input, output in the input dtype):

* ``scaled_softmax_fwd(input, scale)``: ``softmax(input * scale)``.
* ``scaled_masked_softmax_fwd(input, mask, scale)``: input ``[b, np, sq, sk]``, mask
  ``[b or 1, np or 1, sq, sk]`` (bool or uint8, true = masked): masked scores become -10000
  after scaling, as in Apex/Megatron (a fully masked row is uniform, not NaN). As in Apex,
  the backward does not read the mask: a fully masked row passes its gradient through.
* ``scaled_upper_triang_masked_softmax_fwd(input, scale)``: causal, ``[..., sq, sk]`` with
  ``sq == sk``; row ``i`` keeps columns ``0..i`` and is exactly zero after them.
* ``scaled_softmax_bwd(grad_out, output, scale, upper_triang=False)``: the one backward,
  ``scale * y * (dy - sum(dy * y))``.
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

__all__ = [
    "scaled_softmax_fwd",
    "scaled_masked_softmax_fwd",
    "scaled_upper_triang_masked_softmax_fwd",
    "generic_scaled_masked_softmax_fwd",
    "scaled_softmax_bwd",
    "reference_scaled_softmax_fwd",
    "reference_scaled_masked_softmax_fwd",
    "reference_scaled_upper_triang_masked_softmax_fwd",
    "reference_scaled_softmax_bwd",
    "check_mask",
]

MASKED_VALUE = -10000.0


def check_mask(op: str, input: torch.Tensor, mask: torch.Tensor) -> None:
    """Raise unless ``mask`` is a bool/uint8 ``[b or 1, np or 1, sq, sk]`` mask for ``input``."""
    if input.dim() != 4:
        raise ValueError(
            f"{op}: input must be [b, np, sq, sk] scores, got shape {tuple(input.shape)}."
        )
    if not isinstance(mask, torch.Tensor) or mask.dtype not in (torch.bool, torch.uint8):
        what = mask.dtype if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise TypeError(
            f"{op}: mask is {what}; pass a bool (or uint8) mask where True means 'masked out'."
        )
    b, h, sq, sk = input.shape
    ok = (
        mask.dim() == 4
        and mask.shape[0] in (1, b)
        and mask.shape[1] in (1, h)
        and tuple(mask.shape[2:]) == (sq, sk)
    )
    if not ok:
        raise ValueError(
            f"{op}: mask of shape {tuple(mask.shape)} does not fit scores of shape "
            f"{tuple(input.shape)}; Apex masks are [b or 1, np or 1, sq, sk] "
            f"(here [{b} or 1, {h} or 1, {sq}, {sk}])."
        )
    if mask.device != input.device:
        raise ValueError(f"{op}: mask is on {mask.device} but the scores are on {input.device}.")


def _check_causal(op: str, input: torch.Tensor) -> None:
    if input.dim() < 2 or input.shape[-1] != input.shape[-2]:
        raise ValueError(
            f"{op}: the causal softmax needs square [..., sq, sk] scores with "
            f"sq == sk, got shape {tuple(input.shape)}."
        )


# ---- references ---------------------------------------------------------------------------


def reference_scaled_softmax_fwd(input, scale):
    """``softmax(input * scale, -1)`` computed in fp32 (fp64 for fp64)."""
    check_float("scaled_softmax", input)
    return torch.softmax(input.to(acc_dtype(input)) * scale, -1).to(input.dtype)


def reference_scaled_masked_softmax_fwd(input, mask, scale):
    """``softmax(masked_fill(input * scale, mask, -10000), -1)`` in fp32."""
    check_float("scaled_masked_softmax", input)
    check_mask("scaled_masked_softmax", input, mask)
    x = input.to(acc_dtype(input)) * scale
    m = mask.bool()
    # Value: -10000 where masked. Gradient: straight through, as Apex's kernel (its backward
    # does not see the mask; it differs from masked_fill's only in fully masked rows).
    x = torch.where(m, torch.full_like(x, MASKED_VALUE), x) + (x - x.detach()) * m
    return torch.softmax(x, -1).to(input.dtype)


def reference_scaled_upper_triang_masked_softmax_fwd(input, scale):
    """Causal softmax: column ``j > i`` of row ``i`` is excluded (its probability is 0)."""
    check_float("scaled_upper_triang_masked_softmax", input)
    _check_causal("scaled_upper_triang_masked_softmax", input)
    sq, sk = input.shape[-2:]
    future = torch.ones(sq, sk, dtype=torch.bool, device=input.device).triu(1)
    x = (input.to(acc_dtype(input)) * scale).masked_fill(future, float("-inf"))
    return torch.softmax(x, -1).to(input.dtype)


def reference_scaled_softmax_bwd(grad_out, output, scale, upper_triang=False):
    """``scale * y * (dy - sum(dy * y, -1))`` in fp32; the backward of every variant."""
    acc = acc_dtype(output)
    y, dy = output.to(acc), grad_out.to(acc)
    return (scale * y * (dy - (dy * y).sum(-1, keepdim=True))).to(output.dtype)


# ---- dispatchers --------------------------------------------------------------------------


def scaled_softmax_fwd(input: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """Softmax of ``input * scale`` over the last dim (differentiable)."""
    check_float("scaled_softmax", input)
    if use_kernel(input):
        return torch.ops.mpnb.scaled_softmax_fwd(input, float(scale))
    return reference_scaled_softmax_fwd(input, scale)


def scaled_masked_softmax_fwd(input: torch.Tensor, mask: torch.Tensor, scale: float = 1.0):
    """Masked softmax of ``[b, np, sq, sk]`` scores (differentiable in ``input``).

    Example::

        >>> x = torch.randn(2, 4, 8, 8)
        >>> pad = torch.zeros(2, 1, 8, 8, dtype=torch.bool); pad[..., 6:] = True
        >>> scaled_masked_softmax_fwd(x, pad, 0.125)[..., 6:].abs().max() < 1e-3
        tensor(True)
    """
    check_float("scaled_masked_softmax", input)
    check_mask("scaled_masked_softmax", input, mask)
    if use_kernel(input):
        return torch.ops.mpnb.scaled_masked_softmax_fwd(input, mask, float(scale))
    return reference_scaled_masked_softmax_fwd(input, mask, scale)


def generic_scaled_masked_softmax_fwd(input: torch.Tensor, mask: torch.Tensor, scale: float = 1.0):
    """Apex's ``generic_scaled_masked_softmax`` (any ``sk``): the same kernel on the CPU."""
    return scaled_masked_softmax_fwd(input, mask, scale)


def scaled_upper_triang_masked_softmax_fwd(input: torch.Tensor, scale: float = 1.0):
    """Causal softmax of ``[..., sq, sq]`` scores without a mask tensor (differentiable)."""
    check_float("scaled_upper_triang_masked_softmax", input)
    _check_causal("scaled_upper_triang_masked_softmax", input)
    if use_kernel(input):
        return torch.ops.mpnb.scaled_upper_triang_masked_softmax_fwd(input, float(scale))
    return reference_scaled_upper_triang_masked_softmax_fwd(input, scale)


def scaled_softmax_bwd(grad_out, output, scale: float = 1.0, upper_triang: bool = False):
    """Gradient of any of the softmax forwards from its output ``y`` and ``grad_out``."""
    if use_kernel(output):
        return torch.ops.mpnb.scaled_softmax_bwd(grad_out, output, float(scale), bool(upper_triang))
    return reference_scaled_softmax_bwd(grad_out, output, scale, upper_triang)


# ---- fakes and autograd -------------------------------------------------------------------


def _like(x):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@register_fake("scaled_softmax_fwd")
def _(input, scale):
    return _like(input)


@register_fake("scaled_masked_softmax_fwd")
def _(input, mask, scale):
    return _like(input)


@register_fake("scaled_upper_triang_masked_softmax_fwd")
def _(input, scale):
    return _like(input)


@register_fake("scaled_softmax_bwd")
def _(grad_out, output, scale, upper_triang=False):
    return _like(output)


def _setup(ctx, inputs, output):
    ctx.scale = inputs[-1]
    ctx.save_for_backward(output)


def _bwd(upper: bool, n_inputs: int):
    def backward(ctx, gy):
        (y,) = ctx.saved_tensors
        dx = torch.ops.mpnb.scaled_softmax_bwd(gy.contiguous(), y, ctx.scale, upper)
        return (dx,) + (None,) * (n_inputs - 1)

    return backward


register_autograd("scaled_softmax_fwd", _bwd(False, 2), _setup)
register_autograd("scaled_masked_softmax_fwd", _bwd(False, 3), _setup)
register_autograd("scaled_upper_triang_masked_softmax_fwd", _bwd(True, 2), _setup)

for _name, _ref in (
    ("scaled_softmax_fwd", reference_scaled_softmax_fwd),
    ("scaled_masked_softmax_fwd", reference_scaled_masked_softmax_fwd),
    ("scaled_upper_triang_masked_softmax_fwd", reference_scaled_upper_triang_masked_softmax_fwd),
    ("scaled_softmax_bwd", reference_scaled_softmax_bwd),
):
    register_op(OpInfo(_name, "layer", _ref))
