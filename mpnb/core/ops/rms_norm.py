"""``mpnb::rms_norm_fwd`` and ``mpnb::rms_norm_bwd``: Apex's fused RMS norm.

* ``rms_norm_fwd(input, normalized_shape, weight, eps, memory_efficient) -> (output, invvar)``
* ``rms_norm_bwd(grad_out, saved, invvar, normalized_shape, weight, memory_efficient)
  -> (grad_input, grad_weight)``

``y = x * rsqrt(mean(x^2) + eps) * w`` over the trailing ``normalized_shape`` dims, with
``invvar`` one fp32 value per row (fp64 for fp64 input). The weight may have the input's dtype
or be fp32 with a half input (Apex's mixed layers). ``saved`` is the input, or the output when
``memory_efficient`` (the backward recomputes ``xhat = y / w``). The forward is differentiable
through its registered autograd formula (the backward op).

Kernels: ``csrc/cpu/rms_norm.cpp`` (CPU); the reference elsewhere.
"""

from __future__ import annotations

import torch

from mpnb.core.ops import _norm
from mpnb.core.ops._checks import acc_dtype
from mpnb.core.ops._library import Sample, define, ensure_kernels

__all__ = [
    "rms_norm_fwd",
    "rms_norm_bwd",
    "reference_rms_norm_fwd",
    "reference_rms_norm_bwd",
]


def reference_rms_norm_fwd(input, normalized_shape, weight, eps, memory_efficient=False):
    """Reference of :func:`rms_norm_fwd`: ``y = x * rsqrt(mean(x^2) + eps) * w`` in fp32."""
    rows, cols = _norm.check_forward("rms_norm_fwd", input, normalized_shape, weight)
    x = input.reshape(rows, cols).to(acc_dtype(input))
    invvar = torch.rsqrt((x * x).mean(dim=1) + eps)
    y = x * invvar[:, None]
    if weight is not None:
        y = y * weight.reshape(cols).to(y.dtype)
    return y.to(input.dtype).reshape(input.shape), invvar


def reference_rms_norm_bwd(
    grad_out, saved, invvar, normalized_shape, weight, memory_efficient=False
):
    """Reference of :func:`rms_norm_bwd` (the textbook formula, in fp32)."""
    rows, cols = _norm.check_backward(
        "rms_norm_bwd",
        grad_out,
        saved,
        None,
        invvar,
        normalized_shape,
        weight,
        None,
        memory_efficient,
    )
    dx, dw, _ = _norm.backward(
        grad_out, saved, None, invvar, rows, cols, weight, None, memory_efficient
    )
    return dx, dw


def _fake_fwd(input, normalized_shape, weight, eps, memory_efficient=False):
    rows = _norm.fake_rows(input, normalized_shape)
    return _norm.fake_like(input), input.new_empty(rows, dtype=acc_dtype(input))


def _fake_bwd(grad_out, saved, invvar, normalized_shape, weight, memory_efficient):
    return _norm.fake_like(saved), _norm.fake_grad(weight, saved)


def _setup_context(ctx, inputs, output):
    x, shape, w, _eps, memory_efficient = inputs
    y, invvar = output
    ctx.shape, ctx.memory_efficient = shape, memory_efficient
    ctx.save_for_backward(y if memory_efficient else x, invvar, w)
    ctx.mark_non_differentiable(invvar)


def _backward(ctx, grad_y, _grad_invvar):
    saved, invvar, w = ctx.saved_tensors
    dx, dw = _bwd(grad_y, saved, invvar, ctx.shape, w, ctx.memory_efficient)
    return dx, None, dw if w is not None else None, None, None


def _samples_fwd(dtype: torch.dtype):
    for case in _norm.sample_cases(dtype):
        if case.get("affine") == "b":  # no bias in an RMS norm
            continue
        x, w, _b, _dy, nshape = _norm.sample_tensors(dtype, case)
        me = case.get("me", False)
        yield Sample((x, nshape, w, 1e-5, me), name=_norm.sample_name(case))


def _samples_bwd(dtype: torch.dtype):
    return _norm.backward_samples(dtype, reference_rms_norm_fwd, rms=True)


FWD = define(
    "rms_norm_fwd(Tensor input, int[] normalized_shape, Tensor? weight, float eps, "
    "bool memory_efficient=False) -> (Tensor, Tensor)",
    family="rms_norm",
    reference=reference_rms_norm_fwd,
    fake=_fake_fwd,
    autograd=(_backward, _setup_context),
    sample_inputs=_samples_fwd,
    tolerance=_norm.TOLERANCE,
)
_fwd = FWD.overload

BWD = define(
    "rms_norm_bwd(Tensor grad_out, Tensor saved, Tensor invvar, int[] normalized_shape, "
    "Tensor? weight, bool memory_efficient) -> (Tensor, Tensor)",
    family="rms_norm",
    reference=reference_rms_norm_bwd,
    fake=_fake_bwd,
    sample_inputs=_samples_bwd,
    tolerance=_norm.TOLERANCE,
)
_bwd = BWD.overload


def rms_norm_fwd(input, normalized_shape, weight=None, eps=1e-5, memory_efficient=False):
    """RMS norm over the trailing ``normalized_shape`` dims; returns ``(y, invvar)``.

    Differentiable in ``input`` and ``weight`` (the backward is :func:`rms_norm_bwd`).

    Args:
        input: the tensor to normalize (fp32, fp16, bf16 or fp64).
        normalized_shape: its trailing dims to normalize over (a list of ints).
        weight: optional scale of shape ``normalized_shape``, in the input's dtype or fp32
            (with a half input).
        eps: added to the mean square.
        memory_efficient: save the output instead of the input for the backward.

    Example::

        >>> y, invvar = rms_norm_fwd(torch.randn(4, 8), [8], torch.ones(8))
    """
    ensure_kernels()
    return _fwd(input, normalized_shape, weight, eps, memory_efficient)


def rms_norm_bwd(grad_out, saved, invvar, normalized_shape, weight=None, memory_efficient=False):
    """Gradients of :func:`rms_norm_fwd`: ``(grad_input, grad_weight)``.

    Args:
        grad_out: the gradient of the forward's output.
        saved: the forward's input, or its output when ``memory_efficient``.
        invvar: the statistics the forward returned.
        normalized_shape, weight: as given to the forward.
        memory_efficient: ``saved`` is the output (``xhat`` recomputed as ``y / w``).

    Example::

        >>> x, w = torch.randn(4, 8), torch.ones(8)
        >>> y, invvar = rms_norm_fwd(x, [8], w)
        >>> dx, dw = rms_norm_bwd(torch.ones_like(y), x, invvar, [8], w)
    """
    ensure_kernels()
    return _bwd(grad_out, saved, invvar, normalized_shape, weight, memory_efficient)
