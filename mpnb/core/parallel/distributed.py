"""Apex's ``DistributedDataParallel`` on ``torch.distributed`` (gloo, NCCL).

Gradients are all-reduced in flat buckets while backward is still running: each parameter
has a ``register_post_accumulate_grad_hook`` that marks it ready, a full bucket is flattened
and sent with ``dist.all_reduce(async_op=True)``, and a callback queued on the autograd engine
(``Variable._execution_engine.queue_callback``, as torch's DDP and Apex do) waits for every
bucket and copies the results back before ``backward()`` returns.

Ranks with different numbers of batches train together inside ``with model.join():``
(torch's join protocol, see ``_join.py``); without it, under ``launch`` (also under torchrun),
a rank left waiting for one that has returned, or for one waiting in another collective,
fails within about a second and names both (see ``_watch.py``).
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.autograd import Variable
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from mpnb.core.parallel._buckets import FlatReduce, plan_buckets, sync_order
from mpnb.core.parallel._common import (
    broadcast_state,
    check_same_model,
    require_dist,
    unique_params,
)
from mpnb.core.parallel._join import JoinableDDP
from mpnb.core.parallel._watch import collective_watch, uneven_inputs_error
from mpnb.core.parallel.flat_dist import (
    apply_flat_dist_call,
    flat_dist_call,
    split_by_type,
    split_half_float_double,
)
from mpnb.core.parallel.reducer import Reducer

# Apex's ``apex.parallel.distributed`` module held DDP, Reducer and the flat helpers together;
# client code imports them from there, so this module lists all of them.
__all__ = [
    "DistributedDataParallel",
    "CommStats",
    "Reducer",
    "apply_flat_dist_call",
    "flat_dist_call",
    "split_by_type",
    "split_half_float_double",
]


@dataclass
class CommStats:
    """Communication timing of the last backwards (host clock, for benchmarks and diagnosis).

    Attributes:
        backwards: reduced backward passes.
        early_buckets: buckets launched while backward was still computing.
        total_buckets: buckets launched.
        exposed_s: seconds spent in the end-of-backward callback (waits, late launches,
            copy-back): the communication that was NOT hidden behind backward.
    """

    backwards: int = 0
    early_buckets: int = 0
    total_buckets: int = 0
    exposed_s: float = 0.0

    def reset(self) -> None:
        """Zero every counter."""
        self.backwards = self.early_buckets = self.total_buckets = 0
        self.exposed_s = 0.0


class DistributedDataParallel(torch.nn.Module, JoinableDDP):
    """Data-parallel wrapper: gradients all-reduced in buckets, overlapped with backward.

    Parameters are broadcast from rank 0 at construction. The first backward records the
    order in which gradients become ready (rank 0's order is shared with every rank) and
    reduces everything at its end; later backwards launch each bucket as soon as all its
    gradients are ready, in bucket order. Parameters without a gradient in a backward get a
    zero gradient at its end (a parameter unused on every rank ends with a zero gradient,
    not ``None``), so every rank reduces the same buckets and nothing hangs.

    Every rank must run the same number of backwards, or the ones with more batches wait in
    an all-reduce for the others. Wrap the training loop in :meth:`join` when the numbers
    differ. Without it, ranks started by :func:`~mpnb.parallel.launch` (gloo) do not hang:
    a rank waiting for a rank that has already returned from the launched function raises
    within about a second, naming both ranks and its batch; elsewhere it waits for the
    process group's timeout, as torch's DDP does.

    Args:
        module: the model (the same on every rank), not already wrapped by a DDP or sharded
            by FSDP2 (``ValueError``).
        message_size: elements per bucket (Apex's default 1e7).
        delay_allreduce: reduce everything at the end of backward (no overlap).
        shared_param: removed in Apex; passing it raises.
        allreduce_trigger_params: parameters that each close a bucket (``message_size`` is
            then ignored).
        retain_allreduce_buffers: keep the flat reduced buffers in ``allreduce_buffers``.
        allreduce_always_fp32: reduce fp16/bf16 gradients in fp32 buffers.
        num_allreduce_streams: buckets go round-robin over this many process groups (made
            with ``dist.new_group`` unless ``allreduce_communicators`` are given).
        allreduce_communicators: the process groups to use (default: the world).
        gradient_average: divide the sum by the world size.
        gradient_predivide_factor: divide by this before the all-reduce, multiply the result
            by ``factor / world_size`` after (avoids fp16 overflow on large worlds).
        gradient_average_split_factor: deprecated alias of ``gradient_predivide_factor``.
        prof: label launches and waits for ``torch.profiler`` (``record_function``).

    Example::

        >>> model = DistributedDataParallel(model, message_size=2**20)
        >>> loss = model(x).sum(); loss.backward()   # grads averaged over ranks here
        >>> with model.no_sync():                     # accumulate locally
        ...     model(x).sum().backward()
        >>> with model.join():                        # ranks may have different batch counts
        ...     for x in my_batches:
        ...         model(x).sum().backward(); opt.step(); opt.zero_grad()
    """

    def __init__(
        self,
        module: torch.nn.Module,
        message_size: int = 10000000,
        delay_allreduce: bool = False,
        shared_param=None,
        allreduce_trigger_params=None,
        retain_allreduce_buffers: bool = False,
        allreduce_always_fp32: bool = False,
        num_allreduce_streams: int = 1,
        allreduce_communicators=None,
        gradient_average: bool = True,
        gradient_predivide_factor: float = 1.0,
        gradient_average_split_factor: float | None = None,
        prof: bool = False,
    ) -> None:
        super().__init__()
        JoinableDDP.__init__(self)
        require_dist("DistributedDataParallel")
        already = wrapped_by(module)
        if already:
            raise ValueError(
                f"DistributedDataParallel: the module is already wrapped by {already}; wrap "
                "the plain model once. Build a fresh model (or train the wrapped one as it is)."
            )
        if shared_param is not None:
            raise ValueError(
                "DistributedDataParallel: shared_param is no longer supported (as in Apex): "
                "shared parameters are handled anyway. Use delay_allreduce=True to reduce "
                "only at the end of backward."
            )
        if gradient_average_split_factor is not None:
            warnings.warn(
                "gradient_average_split_factor is deprecated; use gradient_predivide_factor "
                "(the value is used as the predivide factor).",
                FutureWarning,
                stacklevel=2,
            )
            gradient_predivide_factor = gradient_average_split_factor
        if message_size <= 0 or gradient_predivide_factor <= 0:
            raise ValueError(
                "DistributedDataParallel: message_size and gradient_predivide_factor must be "
                f"positive, got {message_size} and {gradient_predivide_factor}."
            )
        self.module = module
        self.message_size = message_size
        self.delay_allreduce = delay_allreduce
        self.retain_allreduce_buffers = retain_allreduce_buffers
        self.allreduce_always_fp32 = allreduce_always_fp32
        self.gradient_average = gradient_average
        self.gradient_predivide_factor = float(gradient_predivide_factor)
        self.prof = prof
        self.groups = self._make_groups(num_allreduce_streams, allreduce_communicators)
        self._triggers = allreduce_trigger_params
        self.allreduce_buffers: list[torch.Tensor] = []
        self.stats = CommStats()
        self._sync = True
        self._handles: list = []
        self._reduced = 0  # backwards that reduced: the batch count named in errors
        # under launch, on gloo: number this DDP's collectives per group, so that a long wait
        # can tell a peer that returned or waits in another collective (see _watch.py)
        self._cws = [collective_watch(g) for g in self.groups]
        self._seqs: dict[int, int] = {}
        state = list(module.parameters()) + list(module.buffers())
        check_same_model(state, self.groups[0], "DistributedDataParallel")
        broadcast_state(state, self.groups[0])
        self._setup()

    # ---- structure ---------------------------------------------------------------------
    @staticmethod
    def _make_groups(n: int, comms) -> list:
        if comms is not None:
            if len(comms) != n:
                raise ValueError(
                    f"DistributedDataParallel: {len(comms)} allreduce_communicators for "
                    f"num_allreduce_streams={n}; pass one process group per stream."
                )
            return list(comms)
        if n < 1:
            raise ValueError(f"num_allreduce_streams must be at least 1, got {n}.")
        return [None] if n == 1 else [dist.new_group() for _ in range(n)]

    def _setup(self) -> None:
        for h in self._handles:
            h.remove()
        self.params = unique_params(self.module)
        self._key = tuple(id(p) for p in self.params)
        ids = {id(p): i for i, p in enumerate(self.params)}
        trig = self._triggers or []
        self._trigger_idx = frozenset(ids[id(p)] for p in trig if id(p) in ids)
        self._handles = [
            p.register_post_accumulate_grad_hook(lambda _p, i=i: self._ready(i))
            for i, p in enumerate(self.params)
        ]
        self._plan = None
        if self.delay_allreduce:  # one bucket per (device, dtype), reduced at the end
            order = list(reversed(range(len(self.params))))
            self._use_plan(plan_buckets(self.params, order, float("inf")))
        self._reset_iteration()

    def _use_plan(self, plan) -> None:
        self._plan = plan
        self._reducers = []
        for b, idx in enumerate(plan.buckets):
            ps = [self.params[i] for i in idx]
            self._reducers.append(
                FlatReduce(
                    [p.numel() for p in ps],
                    ps[0].dtype,
                    ps[0].device,
                    self.allreduce_always_fp32,
                    self.gradient_predivide_factor,
                    self.gradient_average,
                    self.groups[b % len(self.groups)],
                )
            )

    def _reset_iteration(self) -> None:
        self._queued = False
        self._order: list[int] = []
        self._got = [False] * len(self.params)
        self._next = 0
        n = len(self._plan.buckets) if self._plan else 0
        self._pending = [len(b) for b in self._plan.buckets] if self._plan else []
        self._launched = [False] * n

    # ---- public --------------------------------------------------------------------------
    def forward(self, *inputs, **kwargs):
        """Run the wrapped module (re-plans the buckets if its parameters changed)."""
        if tuple(id(p) for p in unique_params(self.module)) != self._key:
            self._setup()
        if self._join_config.enable:
            self._announce()
        return self.module(*inputs, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards inside accumulate gradients locally; the next one outside reduces them."""
        before, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = before

    # ---- backward machinery --------------------------------------------------------------
    def _gone_error(self, gone: list[int]) -> RuntimeError:
        return uneven_inputs_error(dist.get_rank(), self._reduced, gone)

    def _issued(self, b: int) -> None:
        """Count bucket ``b``'s all-reduce, just launched, among its group's collectives."""
        cw = self._cws[b % len(self._cws)]
        self._seqs[b] = cw.issue() if cw is not None else 0

    def _bucket_watch(self, b: int):
        cw = self._cws[b % len(self._cws)]
        if cw is None:
            return None
        what = "DistributedDataParallel's gradient all-reduce (a backward)"
        return cw.watch(self._seqs[b], what, self._gone_error)

    def _ready(self, i: int) -> None:
        if not self._sync:
            return
        if not self._queued:
            if self._join_config.enable:
                self._check_join_protocol()
            self._queued = True
            Variable._execution_engine.queue_callback(self._end_of_backward)
        self._got[i] = True
        if self._plan is None:
            self._order.append(i)
            return
        if self.delay_allreduce:
            return
        b = self._plan.bucket_of[i]
        self._pending[b] -= 1
        if self._pending[b] == 0:
            self._launch_ready()

    def _launch(self, b: int) -> None:
        grads = []
        for i in self._plan.buckets[b]:
            p = self.params[i]
            if p.grad is None:  # unused in this backward: every rank must reduce the bucket
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        ctx = torch.profiler.record_function(f"mpnb.ddp.allreduce_bucket_{b}")
        with ctx if self.prof else contextlib.nullcontext():
            self._reducers[b].launch(grads)
        self._issued(b)
        self._launched[b] = True
        self.stats.total_buckets += 1

    def _launch_ready(self) -> None:
        # In bucket order only: the collectives must be issued in the same order everywhere.
        while self._next < len(self._pending) and self._pending[self._next] == 0:
            self._launch(self._next)
            self.stats.early_buckets += 1
            self._next += 1

    def _ensure_plan(self) -> None:
        # The first backward plans the buckets (rank 0's order; a collective) on every rank,
        # joined ones included.
        if self._plan is not None:
            return
        cw, watch = self._cws[0], None
        if cw is not None:
            what = "DistributedDataParallel's bucket plan broadcast (its first backward)"
            watch = cw.watch(cw.issue(), what, self._gone_error)
        order = sync_order(self._order, len(self.params), self.groups[0], watch)
        self._use_plan(plan_buckets(self.params, order, self.message_size, self._trigger_idx))
        self._pending = [len(b) for b in self._plan.buckets]
        self._launched = [False] * len(self._pending)

    def _end_of_backward(self) -> None:
        t0 = time.perf_counter()
        ctx = torch.profiler.record_function("mpnb.ddp.end_of_backward")
        with ctx if self.prof else contextlib.nullcontext():
            self._ensure_plan()
            for b in range(len(self._plan.buckets)):
                if not self._launched[b]:
                    self._launch(b)
            divisor = None
            if self._announced is not None and not self._divide_by_initial_world_size:
                divisor = self._ranks_still_training()
            for b, r in enumerate(self._reducers):
                r.finish(divisor, self._bucket_watch(b))
            if self.retain_allreduce_buffers:
                self.allreduce_buffers = [r.buffer for r in self._reducers]
        self.stats.backwards += 1
        self.stats.exposed_s += time.perf_counter() - t0
        self._reduced += 1
        self._announced = None
        self._reset_iteration()


def wrapped_by(model: torch.nn.Module) -> str:
    """What already replicates or shards ``model`` (``""``: nothing): torch's or mpnb's
    ``DistributedDataParallel``, or FSDP2's ``fully_shard`` (named with the first module it
    sharded), or DTensor parameters of another sharding."""
    # DTensor is imported when asked: `import torch.distributed.tensor` costs about 1 s
    from torch.distributed.tensor import DTensor

    if isinstance(model, TorchDDP):
        return "torch.nn.parallel.DistributedDataParallel"
    if isinstance(model, DistributedDataParallel):
        return "mpnb.parallel.DistributedDataParallel"
    for name, m in model.named_modules():
        if _is_fsdp2(m):
            return f"FSDP2 (fully_shard on {name or 'the root'}: {type(m).__name__})"
    if any(isinstance(p, DTensor) for p in model.parameters()):
        return "DTensor parameters (a sharded model)"
    return ""


def _is_fsdp2(module: torch.nn.Module) -> bool:
    try:  # imported when asked: about 100 ms, and a torch without FSDP2 lacks it
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2 shards nothing with it
        return False
    return isinstance(module, FSDPModule)
