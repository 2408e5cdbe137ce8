"""Uneven inputs for :class:`~mpnb.parallel.DistributedDataParallel`: torch's join protocol.

Torch's :class:`~torch.distributed.algorithms.Join` context manager drives the protocol; this
module holds the DDP side of it. Every iteration of a rank that still trains is a forward
followed by one backward:

* forward: ``Join.notify_join_context`` (an all-reduce of 1: "still training"), then
  :meth:`JoinableDDP._announce` (an all-reduce of 1 when this iteration's backward reduces
  gradients, 0 under ``no_sync()`` or without grad);
* backward: one all-reduce per gradient bucket, in bucket order.

A rank that has run out of batches sits in ``Join.__exit__``: per iteration of the others it
all-reduces 0 (the count of ranks still training), then :meth:`DDPJoinHook.main_hook`
all-reduces 0 to match ``_announce`` and, when that iteration reduces, zeros for every
bucket. The averages therefore see zeros from the ranks that have joined: the sum is divided
by the initial world size, or by the number of ranks still training (the result of
``_announce``) with ``divide_by_initial_world_size=False``. When every rank has joined, the
last one to join broadcasts its parameters and buffers to all (``post_hook``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

from mpnb.core.parallel._common import broadcast_state

__all__ = ["JoinableDDP", "DDPJoinHook"]


class JoinableDDP(Joinable):
    """The join side of DistributedDataParallel (torch's ``Joinable`` API).

    The class using it provides ``groups``, ``module``, ``_sync``, ``_reducers`` and
    ``_ensure_plan()``.
    """

    def __init__(self) -> None:
        super().__init__()
        self._announced = None  # (reduces, flag, work) of this iteration, inside join()
        self._divide_by_initial_world_size = True

    @contextlib.contextmanager
    def join(
        self,
        divide_by_initial_world_size: bool = True,
        enable: bool = True,
        throw_on_early_termination: bool = False,
    ) -> Iterator[Join]:
        """Train on uneven inputs: ranks out of batches shadow the others until all are done.

        torch's ``DistributedDataParallel.join`` semantics. A rank that leaves the loop
        inside waits at the end of the ``with`` block and, for every iteration the other
        ranks still run, takes part in their all-reduces with zero gradients; when every
        rank is done, all take the parameters and buffers of the last rank to finish. Each
        iteration inside must be one forward followed by one backward (forwards that no
        backward follows go under ``torch.no_grad()``; ``no_sync()`` must wrap the forward
        too); a break of that rule raises, naming it. Collectives of your own inside the loop
        (e.g. SyncBatchNorm) are not shadowed: use ``throw_on_early_termination=True`` then.
        The model also works in torch's ``Join([model, optimizer])``.

        Args:
            divide_by_initial_world_size: divide the summed gradients by the world size
                (every sample weighs the same); ``False``: by the ranks still training.
            enable: ``False`` turns the context manager (and its per-iteration all-reduces)
                off, for inputs known to be even.
            throw_on_early_termination: every rank raises as soon as one runs out of batches.

        Example::

            >>> with model.join():
            ...     for x, y in loader:              # 5 batches on rank 0, 3 on rank 1
            ...         loss_fn(model(x), y).backward()
            ...         opt.step(); opt.zero_grad()
        """
        before = self._join_config
        try:
            with Join(
                [self],
                enable,
                throw_on_early_termination,
                divide_by_initial_world_size=divide_by_initial_world_size,
            ) as j:
                yield j
        finally:  # torch's Join leaves its config on the joinable: forwards after the
            self._join_config = before  # block would go on announcing
            self._announced = None

    def join_hook(self, **kwargs) -> DDPJoinHook:
        """The hook torch's ``Join`` runs on a rank that has joined (``Joinable`` API)."""
        return DDPJoinHook(self, kwargs.get("divide_by_initial_world_size", True))

    @property
    def join_device(self) -> torch.device:
        """Where the join protocol's flags live (``Joinable`` API): CPU for gloo."""
        if dist.get_backend(self.groups[0]) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    @property
    def join_process_group(self):
        """The group of the join protocol (``Joinable`` API): the first communicator."""
        return self.groups[0]

    # ---- the active rank's side ------------------------------------------------------------
    def _announce(self) -> None:
        """In forward: tell the joined ranks whether this iteration's backward reduces."""
        Join.notify_join_context(self)
        if self._announced is not None and self._announced[0]:
            raise RuntimeError(
                f"DistributedDataParallel.join: rank {dist.get_rank()} ran a forward (with "
                "gradients, outside no_sync()) and then another forward without a backward "
                "in between. Inside join(), each such forward must be followed by exactly one "
                "backward: the ranks that ran out of batches shadow that backward's "
                "all-reduces. Run forwards that no backward follows (evaluation, logging) "
                "under torch.no_grad()."
            )
        sync = torch.is_grad_enabled() and self._sync
        flag = torch.tensor([float(sync)], device=self.join_device)
        work = dist.all_reduce(flag, group=self.join_process_group, async_op=True)
        self._announced = (sync, flag, work)

    def _check_join_protocol(self) -> None:
        """In the first gradient hook of a reducing backward inside join()."""
        announced = self._announced[0] if self._announced else None
        if announced is not True:
            how = "ran inside no_sync()" if announced is False else "did not run inside join()"
            raise RuntimeError(
                f"DistributedDataParallel.join: rank {dist.get_rank()} reduces gradients in "
                f"a backward whose forward {how}, so the ranks that ran out of batches do not "
                "expect it. Inside join(), run each forward and its backward both inside "
                "no_sync() or both outside, and one backward per forward."
            )

    def _ranks_still_training(self) -> int:
        """At the end of a backward: how many ranks announced a reducing iteration."""
        _, flag, work = self._announced
        work.wait()
        return int(flag.item())


class DDPJoinHook(JoinHook):
    """Shadows an active rank's iteration on a rank with no batch left; syncs the model at
    the end (torch's ``JoinHook`` protocol)."""

    def __init__(self, ddp: JoinableDDP, divide_by_initial_world_size: bool) -> None:
        self.ddp = ddp
        ddp._divide_by_initial_world_size = divide_by_initial_world_size

    def main_hook(self) -> None:
        ddp = self.ddp
        flag = torch.zeros(1, device=ddp.join_device)
        dist.all_reduce(flag, group=ddp.join_process_group)  # matches _announce()
        if flag.item() == 0:  # the others are inside no_sync(), or ran without grad
            return
        ddp._ensure_plan()  # a rank that joined before its first backward plans here
        for b, r in enumerate(ddp._reducers):  # bucket order, as the active ranks launch them
            r.launch_zeros()
            ddp._issued(b)  # counted as the active ranks count theirs
        for r in ddp._reducers:
            r.finish()

    def post_hook(self, is_last_joiner: bool) -> None:
        ddp = self.ddp
        group = ddp.join_process_group
        me = dist.get_rank(group)
        src = torch.tensor([me if is_last_joiner else -1], device=ddp.join_device)
        dist.all_reduce(src, op=dist.ReduceOp.MAX, group=group)  # ties: the highest rank
        state = list(ddp.module.parameters()) + list(ddp.module.buffers())
        broadcast_state(state, group, src=int(src.item()))
