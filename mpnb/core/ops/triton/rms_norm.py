"""``rms_norm_fwd`` / ``rms_norm_bwd`` in Triton (kernels in :mod:`._norm`).

``y = x * rsqrt(mean(x**2) + eps) * weight`` with fp32 statistics (fp64 for fp64 input), half
in and out; the ``memory_efficient`` backward recomputes ``xhat = y / weight``.
"""

from __future__ import annotations

import torch

from mpnb.core.ops.triton._norm import check_norm_args, norm_bwd, norm_fwd, rows_cols
from mpnb.core.ops.triton.layer_norm import _check_grad

__all__ = ["rms_norm_fwd", "rms_norm_bwd"]


def rms_norm_fwd(input, normalized_shape, weight, eps, memory_efficient=False):
    """``(y, invvar)``: the signature and semantics of
    :func:`mpnb.core.ops.rms_norm.reference_rms_norm_fwd`.

    Example::

        >>> x = torch.randn(4, 8, device="cuda", dtype=torch.float16)
        >>> y, invvar = rms_norm_fwd(x, [8], torch.ones(8, device="cuda"), 1e-6)
    """
    op = "rms_norm_fwd"
    rows, cols = rows_cols(op, input, normalized_shape)
    check_norm_args(op, input, cols, weight=weight)
    y, _, rstd = norm_fwd(input, weight, None, eps, rows, cols, is_rms=True)
    return y.view(input.shape), rstd


def rms_norm_bwd(
    grad_out, saved, invvar, normalized_shape, weight, memory_efficient=False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(grad_input, grad_weight)`` (an empty tensor without weight): the signature and
    semantics of :func:`mpnb.core.ops.rms_norm.reference_rms_norm_bwd`."""
    op = "rms_norm_bwd"
    rows, cols = rows_cols(op, saved, normalized_shape)
    check_norm_args(op, saved, cols, weight=weight)
    _check_grad(op, grad_out, saved)
    dx, dw, _ = norm_bwd(
        grad_out, saved, None, invvar, weight, None, memory_efficient, rows, cols, is_rms=True
    )
    return dx.view(saved.shape), dw
