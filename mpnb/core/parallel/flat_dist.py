"""Apex's flat collective helpers: one collective per dtype over a flattened bucket of tensors.

``flat_dist_call(tensors, dist.broadcast, (0,))`` and ``flat_dist_call(grads, dist.all_reduce)``
are how Apex-era code (and Apex's own ``DistributedDataParallel``) synchronizes parameters and
gradients by hand. Each (device, dtype) bucket is flattened, sent as one collective, and copied
back; an ``all_reduce`` is divided by the world size (Apex's averaging).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

__all__ = ["apply_flat_dist_call", "flat_dist_call", "split_by_type", "split_half_float_double"]


def apply_flat_dist_call(
    bucket: Sequence[torch.Tensor], call: Callable, extra_args: Sequence | None = None
) -> None:
    """Run ``call(flat, *extra_args)`` on ``bucket`` flattened, then copy the result back.

    Args:
        bucket: tensors of one device and dtype.
        call: a ``torch.distributed`` collective, e.g. ``dist.all_reduce`` or
            ``dist.broadcast``; an ``all_reduce`` result is divided by the world size.
        extra_args: positional arguments after the tensor (``(0,)`` for broadcast's source).

    Example::

        >>> apply_flat_dist_call([p.grad for p in model.parameters()], dist.all_reduce)
    """
    if not bucket:
        return
    kinds = {(t.device, t.dtype) for t in bucket}
    if len(kinds) != 1:
        raise ValueError(
            f"apply_flat_dist_call: the bucket mixes {sorted(map(str, kinds))}; pass tensors of "
            "one device and dtype, or use flat_dist_call, which splits them."
        )
    flat = _flatten_dense_tensors(list(bucket))
    call(flat, *(extra_args or ()))
    if call is dist.all_reduce:
        flat /= dist.get_world_size()
    with torch.no_grad():
        for t, synced in zip(bucket, _unflatten_dense_tensors(flat, list(bucket)), strict=True):
            t.copy_(synced)


def split_by_type(tensors: Sequence[torch.Tensor]) -> dict[str, list[torch.Tensor]]:
    """Group ``tensors`` by ``tensor.type()`` (device and dtype), keeping their order.

    Example::

        >>> sorted(split_by_type([torch.zeros(2), torch.zeros(2, dtype=torch.half)]))
        ['torch.FloatTensor', 'torch.HalfTensor']
    """
    buckets: dict[str, list[torch.Tensor]] = {}
    for t in tensors:
        buckets.setdefault(t.type(), []).append(t)
    return buckets


def split_half_float_double(tensors: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Buckets of the fp16, bf16, fp32 and fp64 tensors (in that order; empty ones dropped).

    Example::

        >>> [len(b) for b in split_half_float_double([torch.zeros(1), torch.zeros(1).half()])]
        [1, 1]
    """
    order = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
    buckets = [[t for t in tensors if t.dtype == dt] for dt in order]
    return [b for b in buckets if b]


def flat_dist_call(
    tensors: Sequence[torch.Tensor], call: Callable, extra_args: Sequence | None = None
) -> None:
    """:func:`apply_flat_dist_call` on each (device, dtype) bucket of ``tensors``.

    Example::

        >>> flat_dist_call([p.data for p in model.parameters()], dist.broadcast, (0,))
    """
    for bucket in split_by_type(tensors).values():
        apply_flat_dist_call(bucket, call, extra_args)
