"""``layer_norm_fwd`` / ``layer_norm_bwd`` in Triton (kernels in :mod:`._norm`).

Statistics in fp32 (fp64 for fp64 input), half in and out, ``memory_efficient`` backward
recomputing ``xhat = (y - bias) / weight`` from the saved output, as Apex does. The launchers
take the op's arguments as ``args`` (by name), checked before the launch.
"""

from __future__ import annotations

import torch

from mpnb.core.ops._norm import rows_cols
from mpnb.core.ops.triton._norm import norm_bwd, norm_fwd

__all__ = ["layer_norm_fwd", "layer_norm_bwd"]


def layer_norm_fwd(args) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(y, mean, invvar)``: the semantics of
    :func:`mpnb.core.ops.layer_norm.reference_layer_norm_fwd`.

    Example::

        >>> x = torch.randn(4, 8, device="cuda", dtype=torch.bfloat16)
        >>> y, mean, invvar = launcher("layer_norm_fwd")(x, [8], None, None, 1e-5)
    """
    x = args.input
    rows, cols = rows_cols(x, args.normalized_shape)
    y, mean, rstd = norm_fwd(
        input=x,
        weight=args.weight,
        bias=args.bias,
        eps=args.eps,
        rows=rows,
        cols=cols,
        is_rms=False,
    )
    return y.view(x.shape), mean, rstd


def layer_norm_bwd(args) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(grad_input, grad_weight, grad_bias)`` (empty tensors for a missing weight/bias): the
    semantics of :func:`mpnb.core.ops.layer_norm.reference_layer_norm_bwd`; ``saved`` is the
    input, or the output when ``memory_efficient``."""
    saved = args.saved
    rows, cols = rows_cols(saved, args.normalized_shape)
    dx, dw, db = norm_bwd(
        grad_out=args.grad_out,
        saved=saved,
        mean=args.mean,
        invvar=args.invvar,
        weight=args.weight,
        bias=args.bias,
        memory_efficient=args.memory_efficient,
        rows=rows,
        cols=cols,
        is_rms=False,
    )
    return dx.view(saved.shape), dw, db
