"""Helpers shared by the layer op families (norms, softmax, RoPE): checks and autograd set-up.

Every check raises from Python with the problem and the fix, before any C++ kernel runs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["acc_dtype", "check_float", "check_param", "norm_rows"]

SUPPORTED = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def acc_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a kernel computes in: fp64 for fp64 data, fp32 otherwise."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def check_float(op: str, x: torch.Tensor, what: str = "input") -> None:
    """Raise ``TypeError`` unless ``x`` is a tensor of a supported floating dtype."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: {what} must be a torch.Tensor, got {type(x).__name__}.")
    if x.dtype not in SUPPORTED:
        raise TypeError(
            f"{op}: {what} is {x.dtype}; supported dtypes are float32, float16, bfloat16 and "
            f"float64 (convert with .float() or .to(torch.bfloat16))."
        )


def norm_rows(op: str, x: torch.Tensor, shape: Sequence[int]) -> tuple[int, int]:
    """``(rows, cols)`` of ``x`` normalized over its trailing ``shape``; raise on a mismatch."""
    shape = tuple(int(s) for s in shape)
    k = len(shape)
    if k == 0 or x.dim() < k or tuple(x.shape[x.dim() - k :]) != shape:
        raise ValueError(
            f"{op}: input of shape {tuple(x.shape)} does not end with normalized_shape {shape}; "
            "normalized_shape must be the input's trailing dims (e.g. [hidden] for (batch, "
            "seq, hidden))."
        )
    cols = 1
    for s in shape:
        cols *= s
    return (x.numel() // cols if cols else 0), cols


def check_param(op: str, x: torch.Tensor, p: torch.Tensor | None, cols: int, what: str) -> None:
    """Raise unless the affine parameter ``p`` (or None) fits an input normalized over ``cols``."""
    if p is None:
        return
    if p.device != x.device:
        raise ValueError(
            f"{op}: {what} is on {p.device} but the input is on {x.device}; move both "
            "to one device."
        )
    if p.numel() != cols:
        raise ValueError(
            f"{op}: {what} has {p.numel()} elements but normalized_shape holds {cols}; "
            f"pass a {what} of shape normalized_shape."
        )
    mixed_ok = p.dtype == torch.float32 and x.dtype != torch.float64
    if p.dtype != x.dtype and not mixed_ok:
        raise TypeError(
            f"{op}: {what} is {p.dtype} but the input is {x.dtype}; use the input's "
            "dtype, or float32 weights with a half input (the mixed layers)."
        )
