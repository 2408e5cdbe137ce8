"""Bytes on the wire, counted at the collectives.

:class:`CollectiveCounter` is a ``TorchDispatchMode``: every c10d collective goes through
PyTorch's dispatcher as a ``c10d::*`` op (``ProcessGroup`` methods call the ops), including the
ones issued from C++ (DDP's reducer, its comm hooks, FSDP2's all-gathers and reduce-scatters),
and a dispatch mode sees them on the thread that issues them and on the autograd threads that
inherit it. Each op's tensors give its payload; the bytes a rank sends and receives are the
ring algorithm's, per rank, for a world of ``N``:

==================  ==========================  ===============================================
op                  payload ``S``               bytes sent (= received) per rank
==================  ==========================  ===============================================
all_reduce          the reduced tensor          ``2 (N-1)/N * S`` (reduce-scatter + all-gather)
all_gather          the gathered output         ``(N-1)/N * S`` (its own shard stays)
reduce_scatter      the input (all shards)      ``(N-1)/N * S``
broadcast           the tensor                  ``(N-1)/N * S`` (mean over ranks, pipelined)
others              every tensor argument       ``(N-1)/N * S``
==================  ==========================  ===============================================

So on 2 ranks a DDP fp32 all-reduce of P parameters sends ``4 P`` bytes per step, bf16
compression half that. The payload is what the collective really carries: FSDP2 pads each
parameter's first dimension to a multiple of N, and the padding travels too. The time each
collective is in flight (issue to completion of its ``Work``) is recorded too; ``comm_s`` is
the union of those intervals in a step.
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["CollectiveCounter", "ring_bytes", "OP_NAMES"]

#: c10d op name -> the collective's name in the rows
OP_NAMES = {
    "allreduce_": "all_reduce",
    "allreduce_coalesced_": "all_reduce",
    "allgather_": "all_gather",
    "_allgather_base_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "allgather_coalesced_": "all_gather",
    "reduce_scatter_": "reduce_scatter",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "broadcast_": "broadcast",
    "alltoall_": "all_to_all",
    "alltoall_base_": "all_to_all",
    "gather_": "gather",
    "scatter_": "scatter",
    "reduce_": "reduce",
    "send": "send",
    "recv_": "recv",
    "barrier": "barrier",
}


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(v) for v in x)
    return 0


def _payload(op: str, args) -> int:
    """The collective's payload ``S`` from its schema's arguments (the first one or two)."""
    if op in ("all_gather", "reduce_scatter"):
        # (output, input, ...): all_gather's S is its output, reduce_scatter's its input
        out, inp = _nbytes(args[0]), _nbytes(args[1])
        return out if op == "all_gather" else inp
    return _nbytes(args[0])


def ring_bytes(op: str, payload: int, world: int) -> int:
    """Bytes one rank sends (and receives) for ``op`` of ``payload`` bytes on ``world`` ranks,
    as the ring algorithm moves them (see the module's table)."""
    if world <= 1:
        return 0
    share = payload * (world - 1) / world
    return int(round(2 * share if op == "all_reduce" else share))


class CollectiveCounter(TorchDispatchMode):
    """Counts every c10d collective run while it is active: bytes by op and time in flight.

    Use one per policy and step (``with counter: step()``), then read :attr:`by_op`
    (collective name -> bytes sent per rank), :attr:`calls` and :meth:`comm_seconds`.

    Example::

        >>> with CollectiveCounter(world=2) as c:
        ...     ddp_model(x).sum().backward()
        >>> c.by_op
        {'all_reduce': 2704}
    """

    def __init__(self, world: int) -> None:
        super().__init__()
        self.world = world
        self.by_op: dict[str, int] = defaultdict(int)
        self.payload: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)
        self._spans: list[list[float]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace != "c10d":
            return func(*args, **kwargs)
        op = OP_NAMES.get(func._opname, func._opname)
        t0 = time.perf_counter()
        out = func(*args, **kwargs)
        span = [t0, time.perf_counter()]
        self._spans.append(span)
        work = _work_of(out)
        if work is not None:  # asynchronous: in flight until its Work completes
            try:
                work.get_future().add_done_callback(
                    lambda _f, s=span: s.__setitem__(1, time.perf_counter())
                )
            except RuntimeError:  # a backend without futures: the issue time only
                pass
        if op != "barrier":
            s = _payload(op, args)
            self.payload[op] += s
            self.by_op[op] += ring_bytes(op, s, self.world)
            self.calls[op] += 1
        return out

    @property
    def sent(self) -> int:
        """Bytes this rank sent (= received, ring) in the counted collectives."""
        return sum(self.by_op.values())

    def comm_seconds(self) -> float:
        """Wall seconds during which at least one counted collective was in flight."""
        total, end = 0.0, -1.0
        for a, b in sorted(self._spans):
            if b <= end:
                continue
            total += b - max(a, end)
            end = b
        return total


def _work_of(out):
    """The ``Work`` a c10d op returned (as a ScriptObject inside its outputs), or None."""
    items = out if isinstance(out, (list, tuple)) else (out,)
    for item in items:
        if isinstance(item, torch.ScriptObject):
            try:
                return torch._C._distributed_c10d.Work.unbox(item)
            except (AttributeError, RuntimeError):
                return None
    return None
