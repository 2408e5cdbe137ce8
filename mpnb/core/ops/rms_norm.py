"""``mpnb::rms_norm_fwd`` and ``mpnb::rms_norm_bwd``: Apex's fused RMS norm.

* :func:`rms_norm_fwd` returns ``(output, invvar)``;
* :func:`rms_norm_bwd` returns ``(grad_input, grad_weight)``.

``y = x * rsqrt(mean(x^2) + eps) * w`` over the trailing ``normalized_shape`` dims, with
``invvar`` one fp32 value per row (fp64 for fp64 input). The weight may have the input's dtype
or be fp32 with a half input (Apex's mixed layers). ``saved`` is the input, or the output when
``memory_efficient`` (the backward recomputes ``xhat = y / w``). The forward is differentiable
through its registered autograd formula (the backward op).

Kernels: ``csrc/cpu/rms_norm.cpp`` (CPU); the reference elsewhere.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mpnb.core.ops import _norm
from mpnb.core.ops._checks import acc_dtype
from mpnb.core.ops._library import Sample, Tensor, define

__all__ = [
    "rms_norm_fwd",
    "rms_norm_bwd",
    "reference_rms_norm_fwd",
    "reference_rms_norm_bwd",
]


def reference_rms_norm_fwd(
    input: Tensor,
    normalized_shape: Sequence[int],
    weight: Tensor | None = None,
    eps: float = 1e-5,
    memory_efficient: bool = False,
) -> tuple[Tensor, Tensor]:
    """RMS norm over the trailing ``normalized_shape`` dims; returns ``(y, invvar)``.

    Differentiable in ``input`` and ``weight`` (the backward is :func:`rms_norm_bwd`). The
    reference computes ``y = x * rsqrt(mean(x^2) + eps) * w`` in fp32 (fp64 for fp64).

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
    rows, cols = _norm.rows_cols(input, normalized_shape)
    x = input.reshape(rows, cols).to(acc_dtype(input))
    invvar = torch.rsqrt((x * x).mean(dim=1) + eps)
    y = x * invvar[:, None]
    if weight is not None:
        y = y * weight.reshape(cols).to(y.dtype)
    return y.to(input.dtype).reshape(input.shape), invvar


def reference_rms_norm_bwd(
    grad_out: Tensor,
    saved: Tensor,
    invvar: Tensor,
    normalized_shape: Sequence[int],
    weight: Tensor | None = None,
    memory_efficient: bool = False,
) -> tuple[Tensor, Tensor]:
    """Gradients of :func:`rms_norm_fwd`: ``(grad_input, grad_weight)`` (the textbook
    formula in fp32; an empty gradient without weight).

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
    rows, cols = _norm.rows_cols(saved, normalized_shape)
    dx, dw, _ = _norm.backward(
        grad_out, saved, None, invvar, rows, cols, weight, None, memory_efficient
    )
    return dx, dw


def _fake_fwd(args):
    x = args.input
    rows, _ = _norm.rows_cols(x, args.normalized_shape)
    return _norm.fake_like(x), x.new_empty(rows, dtype=acc_dtype(x))


def _fake_bwd(args):
    return _norm.fake_like(args.saved), _norm.fake_grad(args.weight, args.saved)


def _setup_context(ctx, args, output):
    y, invvar = output
    ctx.shape, ctx.memory_efficient = args.normalized_shape, args.memory_efficient
    ctx.save_for_backward(y if args.memory_efficient else args.input, invvar, args.weight)
    ctx.mark_non_differentiable(invvar)


def _backward(ctx, grad_y, _grad_invvar):
    saved, invvar, w = ctx.saved_tensors
    dx, dw = _bwd(grad_y, saved, invvar, ctx.shape, w, ctx.memory_efficient)
    return {"input": dx, "weight": None if w is None else dw}


def _samples_fwd(dtype: torch.dtype):
    for case in _norm.sample_cases(dtype):
        if case.get("affine") == "b":  # no bias in an RMS norm
            continue
        x, w, _b, _dy, nshape = _norm.sample_tensors(dtype, case)
        kw = dict(input=x, normalized_shape=nshape, weight=w, eps=1e-5)
        yield Sample(
            kw | dict(memory_efficient=case.get("me", False)), name=_norm.sample_name(case)
        )


def _samples_bwd(dtype: torch.dtype):
    return _norm.backward_samples(dtype, reference_rms_norm_fwd, rms=True)


FWD = define(
    reference_rms_norm_fwd,
    family="rms_norm",
    check=_norm.check_forward,
    fake=_fake_fwd,
    triton="rms_norm",
    autograd=(_backward, _setup_context),
    sample_inputs=_samples_fwd,
    tolerance=_norm.TOLERANCE,
)
rms_norm_fwd = FWD.wrapper

BWD = define(
    reference_rms_norm_bwd,
    family="rms_norm",
    check=_norm.check_backward,
    fake=_fake_bwd,
    triton="rms_norm",
    sample_inputs=_samples_bwd,
    tolerance=_norm.TOLERANCE,
)
rms_norm_bwd = BWD.wrapper
_bwd = BWD.overload  # the autograd formula calls the op itself (its inputs are checked)
