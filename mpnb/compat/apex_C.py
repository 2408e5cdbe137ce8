"""Apex's ``apex_C`` extension: ``flatten`` and ``unflatten``, on torch's own helpers.

Example::

    >>> import apex_C                      # under mpnb's Apex alias
    >>> flat = apex_C.flatten([torch.ones(2), torch.zeros(3)])
    >>> [t.shape for t in apex_C.unflatten(flat, [torch.empty(2), torch.empty(3)])]
    [torch.Size([2]), torch.Size([3])]
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

__all__ = ["flatten", "unflatten"]


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One 1-D tensor holding ``tensors`` back to back (one dtype and device)."""
    return _flatten_dense_tensors(list(tensors))


def unflatten(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Views of ``flat`` shaped like ``tensors`` (the inverse of :func:`flatten`)."""
    return _unflatten_dense_tensors(flat, list(tensors))
