"""Which ranks have returned from the launched function: the signal that ends a silent hang.

A rank that runs out of batches returns from ``fn`` while the others wait in an all-reduce
that it will never join: without help they wait for the process group's timeout. Under
:func:`~mpnb.parallel.launch` every rank writes ``mpnb/launch/returned/<rank>`` into the
launch's TCP store as ``fn`` returns (:func:`mark_returned`); a gloo wait that lasts longer
than :data:`POLL_S` looks at those keys (:class:`ReturnedRanks`) and can then fail at once,
naming the ranks. Outside launch (torchrun, your own ``init_process_group``) nothing writes
the keys and a wait is a plain wait.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable

import torch.distributed as dist

__all__ = [
    "STORE_ENV",
    "POLL_S",
    "mark_returned",
    "ReturnedRanks",
    "wait_watched",
    "uneven_inputs_error",
]

STORE_ENV = "MPNB_LAUNCH_STORE"  # "host:port" of the launch's store, set in every rank
POLL_S = 1.0  # a wait this long asks the store; a reduction normally takes far less


def _key(rank: int) -> str:
    return f"mpnb/launch/returned/{rank}"


def mark_returned(store, rank: int, nprocs: int) -> None:
    """Say that ``rank`` returned from ``fn``, then wait until every rank has."""
    store.set(_key(rank), "1")
    store.wait([_key(r) for r in range(nprocs)])


class ReturnedRanks:
    """Callable: which of ``ranks`` have returned from the launched function (global ranks).

    Connects to the launch's store on the first call only (a wait that is already long);
    outside launch, or when the store cannot be reached, it answers ``[]``.
    """

    def __init__(self, ranks: list[int]) -> None:
        self.ranks = ranks
        self.address = os.environ.get(STORE_ENV)
        self._store = None

    def __bool__(self) -> bool:
        return self.address is not None

    def __call__(self) -> list[int]:
        if self.address is None:
            return []
        try:
            if self._store is None:
                host, port = self.address.rsplit(":", 1)
                self._store = dist.TCPStore(host, int(port), timeout=datetime.timedelta(seconds=5))
            return [r for r in self.ranks if self._store.check([_key(r)])]
        except (RuntimeError, OSError):  # the store's rank is gone: launch reports that
            return []


def wait_watched(work, watch: Callable[[], None] | None) -> None:
    """``work.wait()``, calling ``watch()`` every :data:`POLL_S` seconds while it lasts.

    Only for gloo: a gloo wait that times out leaves the operation running (an NCCL one may
    abort the communicator), so ``watch`` must be ``None`` for NCCL. ``watch`` raises to give
    up the wait.
    """
    if watch is None:
        work.wait()
        return
    while True:
        try:
            work.wait(timeout=datetime.timedelta(seconds=POLL_S))
            return
        except RuntimeError:
            if work.is_completed():  # it failed, or finished as the wait timed out
                work.wait()
                return
        watch()


def uneven_inputs_error(rank: int, reduced: int, gone: list[int]) -> RuntimeError:
    """The error of a DDP rank that waits for ranks which returned from ``fn`` already."""
    return RuntimeError(
        f"DistributedDataParallel: uneven inputs: rank {rank} waits in the gradient all-reduce "
        f"of its batch {reduced + 1}, but rank(s) {', '.join(map(str, gone))} already returned "
        f"from the launched function, after the {reduced} batch(es) reduced together with rank "
        f"{rank}: the ranks ran different numbers of batches. Wrap the training loop in "
        "`with model.join():` (ranks out of batches then shadow the others' all-reduces, as "
        "with torch's DDP), or give every rank the same number of batches (e.g. "
        "DistributedSampler(..., drop_last=True))."
    )
