"""Channels-last (and any dense dim order) tensors in the multi-tensor ops, as Apex takes them.

The multi-tensor kernels walk each tensor's memory from start to end, so they take contiguous
tensors. A tensor that is dense in another dim order (``memory_format=torch.channels_last``)
fills its memory just as well: viewed as the 1-D tensor of its memory (a view, so the kernel's
writes land in it), it pairs element by element with partners laid out the same way. Apex's
kernels take such tensors; :func:`in_memory_order` lets mpnb's wrappers do the same without a
cost to the common case: the call is tried as given, and only when the op refuses a list
(``ValueError``) are its dense tensors handed over in memory order and the call retried.
Partners laid out differently stay refused, with the op's message.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

__all__ = ["in_memory_order", "memory_view"]


def memory_view(t: torch.Tensor) -> torch.Tensor | None:
    """The 1-D view of ``t``'s memory when ``t`` is dense (in any dim order), else None."""
    if t.is_contiguous():
        return t.view(-1)
    order = sorted(range(t.dim()), key=lambda d: -t.stride(d))
    p = t.permute(order)
    return p.view(-1) if p.is_contiguous() else None


def _views(lists: Sequence[Sequence[torch.Tensor]]) -> list[list[torch.Tensor]] | None:
    out = [list(lst) for lst in lists]
    changed = False
    for i in range(len(lists[0])):
        group = [lst[i] for lst in lists if i < len(lst)]
        if all(t.is_contiguous() for t in group):
            continue
        a = group[0]
        if any(t.shape != a.shape or t.stride() != a.stride() for t in group):
            return None  # laid out unlike a partner: the kernel's own message stands
        views = [memory_view(t) for t in group]
        if any(v is None for v in views):
            return None
        for lst, v in zip(out, views, strict=False):
            lst[i] = v
        changed = True
    return out if changed else None


def in_memory_order(call: Callable, args: tuple, lists: Sequence[int]):
    """``call(*args)``; if it refuses ``args``' tensor lists (at the positions ``lists``)
    because a tensor is not contiguous, retry with each dense tensor in memory order.

    Example::

        >>> x = [torch.randn(2, 3, 4, 4).contiguous(memory_format=torch.channels_last)]
        >>> in_memory_order(op, (flag, x, x, 0.5), lists=(1, 2))    # x *= 0.5 in place
    """
    try:
        return call(*args)
    except ValueError:
        views = _views([args[i] for i in lists])
        if views is None:
            raise
    args = list(args)
    for i, v in zip(lists, views, strict=True):
        args[i] = v
    return call(*args)
