"""Argument checks of the pure-PyTorch references (the C++ kernels check the same in C++).

Each implementation of an op validates its own arguments once: the references with these
helpers, the kernels with ``csrc/cpu/multi_tensor_apply.h`` and ``norm_common.h``. The
wrappers validate nothing. Messages name the problem and the fix.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = [
    "SUPPORTED",
    "acc_dtype",
    "any_nonfinite",
    "check_float",
    "check_lists",
    "check_param",
    "norm_rows",
    "raise_flag_if",
]

SUPPORTED = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def check_lists(op: str, first: Sequence[torch.Tensor], **others: Sequence[torch.Tensor]) -> None:
    """Equal lengths and sizes, one supported dtype per list, contiguous tensors (as the
    kernels' ``check_list``); fp64 lists only beside fp64 lists."""
    n = len(first)
    for name, lst in others.items():
        if len(lst) != n:
            raise ValueError(
                f"{op}: list '{name}' has {len(lst)} tensors but the first list has {n}; "
                "pass lists of equal length."
            )
        for i, (a, b) in enumerate(zip(first, lst, strict=True)):
            if a.numel() != b.numel():
                raise ValueError(
                    f"{op}: tensor {i} of '{name}' has {b.numel()} elements but its partner has "
                    f"{a.numel()}; pair tensors of the same size."
                )
    for name, lst in {"first": first, **others}.items():
        if not lst:
            continue
        dtype = lst[0].dtype
        if dtype not in SUPPORTED:
            raise TypeError(
                f"{op}: list '{name}' is {dtype}; supported dtypes are float32, float16, "
                "bfloat16 and float64."
            )
        for i, t in enumerate(lst):
            if t.dtype != dtype:
                raise TypeError(
                    f"{op}: tensor {i} of '{name}' is {t.dtype} but tensor 0 is {dtype}; every "
                    "tensor of one list must share a dtype."
                )
            if not t.is_contiguous():
                raise ValueError(
                    f"{op}: tensor {i} of '{name}' is not contiguous; call .contiguous() first."
                )
    dtypes = {lst[0].dtype for lst in (first, *others.values()) if lst}
    if torch.float64 in dtypes and len(dtypes) > 1:
        raise TypeError(f"{op}: float64 lists can only be mixed with float64 lists, got {dtypes}.")


def raise_flag_if(flag: torch.Tensor, bad: torch.Tensor) -> None:
    """``flag = max(flag, bad)`` on the device (no host sync); flags are never cleared."""
    flag.copy_(torch.maximum(flag, bad.to(flag.dtype).reshape(flag.shape)))


def any_nonfinite(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """A boolean 0-dim tensor: does any of ``tensors`` hold inf or NaN (no host sync)."""
    if not tensors:
        return torch.zeros((), dtype=torch.bool, device=device)
    return torch.stack([~torch.isfinite(t).all() for t in tensors]).any()


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
