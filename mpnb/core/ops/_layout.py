"""Channels-last (and any dense dim order) tensors in the multi-tensor ops, as Apex takes them.

The multi-tensor kernels walk each tensor's memory from start to end, so they take contiguous
tensors. A tensor that is dense in another dim order (``memory_format=torch.channels_last``)
fills its memory just as well: viewed as the 1-D tensor of its memory (a view, so the kernel's
writes land in it), it pairs element by element with partners laid out the same way. Apex's
kernels take such tensors; an op defined with ``memory_order=`` (:func:`~mpnb.core.ops._library
.define`) does the same without a cost to the common case: the call is tried as given, and
only when the op refuses it are the dense tensors of those lists handed over in memory order
(:func:`memory_order_views`) and the call retried. Partners laid out differently stay refused,
with the op's message.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["memory_order_views", "memory_view"]


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
            return None  # laid out unlike a partner: the op's own message stands
        views = [memory_view(t) for t in group]
        if any(v is None for v in views):
            return None
        for lst, v in zip(out, views, strict=False):
            lst[i] = v
        changed = True
    return out if changed else None


def memory_order_views(args: Any, names: Sequence[str]) -> Any | None:
    """``args`` (an op's named tuple of arguments) with the tensors of the lists ``names``
    in memory order, or None when that changes nothing or cannot pair them.

    Example::

        >>> x = [torch.randn(2, 3, 4, 4).contiguous(memory_format=torch.channels_last)]
        >>> memory_order_views(op.args(flag, x, x, 0.5), ("src", "dst")).src[0].shape
        torch.Size([96])
    """
    views = _views([getattr(args, n) for n in names])
    if views is None:
        return None
    return args._replace(**dict(zip(names, views, strict=True)))
