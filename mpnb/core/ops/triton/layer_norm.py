"""``layer_norm_fwd`` / ``layer_norm_bwd`` in Triton (kernels in :mod:`._norm`).

Statistics in fp32 (fp64 for fp64 input), half in and out, ``memory_efficient`` backward
recomputing ``xhat = (y - bias) / weight`` from the saved output, as Apex does.
"""

from __future__ import annotations

import torch

from mpnb.core.ops.triton._norm import check_norm_args, norm_bwd, norm_fwd, rows_cols

__all__ = ["layer_norm_fwd", "layer_norm_bwd"]


def layer_norm_fwd(input, normalized_shape, weight, bias, eps, memory_efficient=False):
    """``(y, mean, invvar)``: the signature and semantics of
    :func:`mpnb.core.ops.layer_norm.reference_layer_norm_fwd`.

    Example::

        >>> x = torch.randn(4, 8, device="cuda", dtype=torch.bfloat16)
        >>> y, mean, invvar = layer_norm_fwd(x, [8], None, None, 1e-5)
    """
    op = "layer_norm_fwd"
    rows, cols = rows_cols(op, input, normalized_shape)
    check_norm_args(op, input, cols, weight=weight, bias=bias)
    y, mean, rstd = norm_fwd(input, weight, bias, eps, rows, cols, is_rms=False)
    return y.view(input.shape), mean, rstd


def layer_norm_bwd(
    grad_out, saved, mean, invvar, normalized_shape, weight, bias, memory_efficient=False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(grad_input, grad_weight, grad_bias)`` (empty tensors for a missing weight/bias): the
    signature and semantics of :func:`mpnb.core.ops.layer_norm.reference_layer_norm_bwd`;
    ``saved`` is the input, or the output when ``memory_efficient``."""
    op = "layer_norm_bwd"
    rows, cols = rows_cols(op, saved, normalized_shape)
    check_norm_args(op, saved, cols, weight=weight, bias=bias)
    _check_grad(op, grad_out, saved)
    dx, dw, db = norm_bwd(
        grad_out, saved, mean, invvar, weight, bias, memory_efficient, rows, cols, is_rms=False
    )
    return dx.view(saved.shape), dw, db


def _check_grad(op: str, grad_out: torch.Tensor, saved: torch.Tensor) -> None:
    if grad_out.shape != saved.shape or grad_out.device != saved.device:
        raise ValueError(
            f"{op}: grad_out is {tuple(grad_out.shape)} on {grad_out.device} but the saved "
            f"tensor is {tuple(saved.shape)} on {saved.device}; pass the gradient of the output."
        )
