"""Gradient buckets: the plan (which params reduce together) and one flat all-reduce per bucket.

A :class:`BucketPlan` is built from an order of parameter indices (the order their gradients
became ready on rank 0 in the first backward, or the reverse registration order): parameters
are appended to the open bucket of their (device, dtype) and a bucket closes once it holds
``message_size`` elements (or at a trigger parameter). Buckets are numbered in the order they
close, and every rank launches them in that order, so collectives always match across ranks
even when gradients become ready in a different order on different ranks.

:class:`FlatReduce` owns one persistent flat buffer per bucket (fp32 when asked) and does
copy-in, ``all_reduce(async_op=True)``, and scale + copy-out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from mpnb.core.parallel._watch import wait_watched

__all__ = ["BucketPlan", "FlatReduce", "plan_buckets", "sync_order"]


@dataclass
class BucketPlan:
    """Buckets of parameter indices and, for each parameter, its bucket."""

    buckets: list[list[int]]
    bucket_of: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.bucket_of = {i: b for b, idx in enumerate(self.buckets) for i in idx}


def plan_buckets(
    params: Sequence[torch.Tensor],
    order: Sequence[int],
    message_size: float,
    triggers: frozenset[int] = frozenset(),
) -> BucketPlan:
    """Bucket ``params`` (indices in ``order``) by (device, dtype), closing at ``message_size``.

    Args:
        params: the parameters; ``order`` indexes them.
        order: every index once, in the order gradients are expected to become ready.
        message_size: elements after which a bucket closes (``inf``: one bucket per dtype).
        triggers: indices that close their bucket (``allreduce_trigger_params``); when given,
            ``message_size`` is ignored.

    Example::

        >>> ps = [torch.zeros(3), torch.zeros(5)]
        >>> plan_buckets(ps, [1, 0], message_size=4).buckets
        [[1], [0]]
    """
    open_: dict[tuple, list[int]] = {}
    size: dict[tuple, int] = {}
    closed: list[list[int]] = []
    for i in order:
        p = params[i]
        key = (p.device, p.dtype)
        open_.setdefault(key, []).append(i)
        size[key] = size.get(key, 0) + p.numel()
        full = i in triggers if triggers else size[key] >= message_size
        if full:
            closed.append(open_.pop(key))
            size[key] = 0
    closed.extend(b for b in open_.values() if b)
    return BucketPlan(closed)


def sync_order(order: list[int], n: int, group, watch=None) -> list[int]:
    """Rank 0's ``order`` (completed with the missing indices, last first) on every rank.

    One broadcast of ``n`` int64 values: the bucket structure must be the same everywhere.
    ``watch`` is called while the broadcast waits (see :func:`wait_watched`).
    """
    seen = set(order)
    full = list(order) + [i for i in reversed(range(n)) if i not in seen]
    t = torch.tensor(full, dtype=torch.int64)
    backend = dist.get_backend(group)
    if backend == "nccl":
        t = t.cuda()
    src = dist.get_global_rank(group, 0) if group is not None else 0
    wait_watched(dist.broadcast(t, src=src, group=group, async_op=True), watch)
    return t.cpu().tolist()


class FlatReduce:
    """All-reduce of one bucket of gradients through a persistent flat buffer.

    Args:
        numels: elements of each gradient of the bucket, in bucket order.
        dtype / device: the gradients' dtype and device.
        fp32: reduce in a float32 buffer (``allreduce_always_fp32``).
        predivide: divide by this before the all-reduce (``gradient_predivide_factor``).
        average: divide the sum by the world size (``gradient_average``; Apex's arithmetic:
            ``* predivide / world_size`` after the reduction).
        group: the process group of this bucket.
    """

    def __init__(self, numels, dtype, device, fp32, predivide, average, group) -> None:
        buf_dtype = torch.float32 if fp32 and dtype in (torch.float16, torch.bfloat16) else dtype
        self.buffer = torch.empty(sum(numels), dtype=buf_dtype, device=device)
        self.views = list(self.buffer.split(list(numels)))
        self.group = group
        self.predivide = float(predivide)
        self.average = average
        self.world = dist.get_world_size(group)
        self.work = None
        self.grads: list[torch.Tensor] = []

    def _shaped(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        # views of the buffer in each grad's shape: copies work for any grad layout
        return [v.view(g.shape) for v, g in zip(self.views, grads, strict=True)]

    def launch(self, grads: list[torch.Tensor]) -> None:
        """Copy ``grads`` in, (pre)scale and start the asynchronous all-reduce."""
        self.grads = grads
        torch._foreach_copy_(self._shaped(grads), grads)
        if self.predivide != 1.0:
            self.buffer.mul_(1.0 / self.predivide)
        self.work = dist.all_reduce(self.buffer, group=self.group, async_op=True)

    def launch_zeros(self) -> None:
        """Start an all-reduce of zeros: a rank with no batch left shadows the others' one."""
        self.grads = []
        self.buffer.zero_()
        self.work = dist.all_reduce(self.buffer, group=self.group, async_op=True)

    def finish(self, divisor: int | None = None, watch=None) -> None:
        """Wait for the all-reduce, scale, and copy the result back into the gradients.

        Args:
            divisor: ranks to average over (default: the group's size; ``join`` passes the
                number of ranks still training when asked to).
            watch: called while the wait lasts (see :func:`wait_watched`).
        """
        if self.work is None:
            return
        work, self.work = self.work, None
        wait_watched(work, watch)
        grads, self.grads = self.grads, []
        if not grads:  # launch_zeros: nothing to copy back
            return
        post = self.predivide / (divisor or self.world) if self.average else 1.0
        if post != 1.0:
            self.buffer.mul_(post)
        torch._foreach_copy_(grads, self._shaped(grads))
