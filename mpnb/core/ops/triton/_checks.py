"""Argument checks of the Triton launchers: the kernel side validates, once, before launching.

A Triton kernel reads raw addresses, so a size, dtype, layout or device mismatch must be
refused on the host; each message names the problem and the fix.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["FLOATS", "check_lists", "check_one", "check_same_device"]

FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def check_same_device(op: str, ref: torch.Tensor, **tensors: torch.Tensor | None) -> None:
    """Raise unless every given tensor lives on ``ref``'s device."""
    for name, t in tensors.items():
        if t is not None and t.device != ref.device:
            raise ValueError(
                f"{op}: {name} is on {t.device} but the data is on {ref.device}; move it to "
                f"{ref.device}."
            )


def check_one(op: str, name: str, t: torch.Tensor | None) -> None:
    """Raise unless ``t`` (a flag, a scale) is None or holds exactly one element."""
    if t is not None and t.numel() != 1:
        raise ValueError(
            f"{op}: {name} must hold one element, got shape {tuple(t.shape)}; pass a "
            "one-element tensor."
        )


def _check_list(op: str, name: str, lst: Sequence[torch.Tensor], dtypes, device) -> None:
    dtype = lst[0].dtype
    if dtype not in dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise TypeError(f"{op}: list '{name}' is {dtype}; supported dtypes are {names}.")
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
        if t.device != device:
            raise ValueError(
                f"{op}: tensor {i} of '{name}' is on {t.device} but the first list is on "
                f"{device}; put every tensor on one device."
            )


def check_lists(
    op: str,
    first: Sequence[torch.Tensor],
    dtypes: Sequence[torch.dtype] = FLOATS,
    **others: Sequence[torch.Tensor],
) -> None:
    """Raise unless the lists pair up: equal lengths and sizes, one dtype per list among
    ``dtypes``, contiguous, one device; fp64 lists are mixed only with fp64 lists."""
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
    if not n:
        return
    device = first[0].device
    lists = {"first": first, **others}
    for name, lst in lists.items():
        if lst:
            _check_list(op, name, lst, dtypes, device)
    kinds = {lst[0].dtype for lst in lists.values() if lst}
    if torch.float64 in kinds and len(kinds) > 1:
        got = ", ".join(sorted(str(k).removeprefix("torch.") for k in kinds))
        raise TypeError(f"{op}: float64 lists can only be mixed with float64 lists, got {got}.")
