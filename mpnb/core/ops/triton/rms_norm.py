"""``rms_norm_fwd`` / ``rms_norm_bwd`` in Triton (kernels in :mod:`._norm`).

``y = x * rsqrt(mean(x**2) + eps) * weight`` with fp32 statistics (fp64 for fp64 input), half
in and out; the ``memory_efficient`` backward recomputes ``xhat = y / weight``. The launchers
take the op's arguments as ``args`` (by name), checked before the launch.
"""

from __future__ import annotations

import torch

from mpnb.core.ops._norm import rows_cols
from mpnb.core.ops.triton._norm import norm_bwd, norm_fwd

__all__ = ["rms_norm_fwd", "rms_norm_bwd"]


def rms_norm_fwd(args) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, invvar)``: the semantics of :func:`mpnb.core.ops.rms_norm.reference_rms_norm_fwd`.

    Example::

        >>> x = torch.randn(4, 8, device="cuda", dtype=torch.float16)
        >>> y, invvar = launcher("rms_norm_fwd")(x, [8], torch.ones(8, device="cuda"), 1e-6)
    """
    x = args.input
    rows, cols = rows_cols(x, args.normalized_shape)
    y, _, rstd = norm_fwd(
        input=x, weight=args.weight, bias=None, eps=args.eps, rows=rows, cols=cols, is_rms=True
    )
    return y.view(x.shape), rstd


def rms_norm_bwd(args) -> tuple[torch.Tensor, torch.Tensor]:
    """``(grad_input, grad_weight)`` (an empty tensor without weight): the semantics of
    :func:`mpnb.core.ops.rms_norm.reference_rms_norm_bwd`."""
    saved = args.saved
    rows, cols = rows_cols(saved, args.normalized_shape)
    dx, dw, _ = norm_bwd(
        grad_out=args.grad_out,
        saved=saved,
        mean=None,
        invvar=args.invvar,
        weight=args.weight,
        bias=None,
        memory_efficient=args.memory_efficient,
        rows=rows,
        cols=cols,
        is_rms=True,
    )
    return dx.view(saved.shape), dw
