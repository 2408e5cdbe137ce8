"""What the other ranks are doing while this one waits: the signals that end a silent hang.

A rank that runs out of batches returns from ``fn`` while the others wait in an all-reduce
that it will never join: without help they wait for the process group's timeout. Under
:func:`~mpnb.parallel.launch` (also when launch runs under torchrun) every rank writes
``<prefix>/returned/<rank>`` into a TCP store as ``fn`` returns (:func:`mark_returned`); a
gloo wait that lasts longer than :data:`POLL_S` looks at those keys (:class:`ReturnedRanks`)
and can then fail at once, naming the ranks.

Ranks that wait in *different* collectives wait forever too (one rank's SyncBatchNorm in
``eval()`` runs no collective while the other's gathers statistics). :class:`CollectiveWatch`
numbers the collectives mpnb issues on a group (DDP's bucket all-reduces and plan broadcast,
SyncBatchNorm's channel check, statistics and gradients), and a long wait writes
``<prefix>/waiting/<group>/<rank>`` = its number and kind: a peer waiting at the same number
in another kind of collective is a mismatch, named on both ranks. Outside launch (your own
``init_process_group``) nothing writes the keys and a wait is a plain wait.
"""

from __future__ import annotations

import datetime
import os
import time
from collections.abc import Callable

import torch.distributed as dist

__all__ = [
    "STORE_ENV",
    "PREFIX_ENV",
    "POLL_S",
    "mark_returned",
    "mark_failed",
    "failed_ranks",
    "ReturnedRanks",
    "CollectiveWatch",
    "collective_watch",
    "wait_watched",
    "uneven_inputs_error",
]

STORE_ENV = "MPNB_LAUNCH_STORE"  # "host:port" of the launch's store, set in every rank
PREFIX_ENV = "MPNB_LAUNCH_KEYS"  # the keys' prefix (torchrun: one per run and restart)
POLL_S = 1.0  # a wait this long asks the store; a reduction normally takes far less


def _prefix() -> str:
    return os.environ.get(PREFIX_ENV, "mpnb/launch")


def _key(rank: int) -> str:
    return f"{_prefix()}/returned/{rank}"


def _failed_key(rank: int) -> str:
    return f"{_prefix()}/failed/{rank}"


def mark_failed(store, rank: int, error: BaseException) -> None:
    """Say that ``rank`` raised ``error`` in ``fn``: the ranks waiting for it stop waiting."""
    try:
        store.set(_failed_key(rank), f"{type(error).__name__}: {error}".splitlines()[0][:300])
    except (RuntimeError, OSError):  # the store is gone too: nothing waits in it
        pass


def failed_ranks(store, ranks) -> dict[int, str]:
    """The ranks among ``ranks`` that marked a failure, with their errors' first lines."""
    return {r: store.get(_failed_key(r)).decode() for r in ranks if store.check([_failed_key(r)])}


def mark_returned(store, rank: int, nprocs: int, timeout: float | None = None) -> None:
    """Say that ``rank`` returned from ``fn``, then wait until every rank has.

    Raises RuntimeError when a rank marks a failure (:func:`mark_failed`) while this one
    waits, and when ``timeout`` seconds pass first (None: no limit, as under launch, whose
    caller keeps the deadline), naming
    the ranks.
    """
    store.set(_key(rank), "1")
    keys = [_key(r) for r in range(nprocs)]
    end = None if timeout is None else time.monotonic() + timeout
    while not store.check(keys):  # polled: a timed-out store.wait logs a warning each time
        time.sleep(0.05)
        failed = failed_ranks(store, range(nprocs))
        if failed:
            r, text = next(iter(failed.items()))
            raise RuntimeError(
                f"rank {r} raised in fn ({text}); rank {rank} had returned from fn and stops "
                f"waiting for it: see rank {r}'s error."
            )
        if end is not None and time.monotonic() > end:
            late = [r for r in range(nprocs) if not store.check([_key(r)])]
            raise RuntimeError(
                f"rank {rank} returned from fn, but rank(s) {', '.join(map(str, late))} did "
                f"not within {timeout:.0f} s (stuck in a collective the others never reach, or "
                "still working); raise the timeout if the work is that long."
            )


def connect_store(address: str, timeout: float = 5.0):
    """A client of the TCP store at ``address`` (``"host:port"``)."""
    host, port = address.rsplit(":", 1)
    return dist.TCPStore(host, int(port), timeout=datetime.timedelta(seconds=timeout))


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

    def store(self):
        """The store (connected on first use), or None outside launch or when unreachable."""
        if self.address is None:
            return None
        if self._store is None:
            try:
                self._store = connect_store(self.address)
            except (RuntimeError, OSError):  # the store's rank is gone: launch reports that
                return None
        return self._store

    def __call__(self) -> list[int]:
        store = self.store()
        if store is None:
            return []
        try:
            return [r for r in self.ranks if store.check([_key(r)])]
        except (RuntimeError, OSError):
            return []


class _Waiting:
    """The ``watch`` of one wait (see :meth:`CollectiveWatch.watch`)."""

    def __init__(self, owner: CollectiveWatch, seq: int, what: str, gone_error) -> None:
        self.owner, self.seq, self.what, self.gone_error = owner, seq, what, gone_error
        self.published = False

    def __call__(self) -> None:
        o = self.owner
        gone = o.returned()
        if gone:
            raise self.gone_error(gone)
        store = o.returned.store()
        if store is None:
            return
        try:
            failed = failed_ranks(store, [r for r in o.ranks if r != o.rank])
        except (RuntimeError, OSError):
            return
        if failed:  # raised outside the try: it must not read as a store error and vanish
            r, text = next(iter(failed.items()))
            raise RuntimeError(
                f"rank {r} raised in fn ({text}) while rank {o.rank} waited for it in "
                f"{self.what}: see rank {r}'s error."
            )
        try:
            if not self.published:
                store.set(o.key(o.rank), f"{self.seq}\t{self.what}")
                self.published = True
            peers = [r for r in o.ranks if r != o.rank and store.check([o.key(r)])]
            entries = {r: store.get(o.key(r)).decode() for r in peers}
        except (RuntimeError, OSError):
            return
        for r, entry in entries.items():
            # A peer whose wait ended between the check and the get took its entry back, and
            # the store answers an empty value: that peer is not waiting, nothing to compare.
            seq, tab, what = entry.partition("\t")
            if tab and int(seq) == self.seq and what != self.what:
                raise mismatch_error(o.rank, self.what, r, what, self.seq)

    def done(self) -> None:
        """The wait finished: take this rank's entry back."""
        if self.published:
            try:
                self.owner.returned.store().delete_key(self.owner.key(self.owner.rank))
            except (RuntimeError, OSError, AttributeError):
                pass


class CollectiveWatch:
    """The collectives mpnb issues on one process group, numbered in issue order, and the
    watch of a long wait for one of them (see the module docstring).

    Every rank of the group issues the same collectives in the same order, so the same number
    names the same collective everywhere; the numbering is per process and per group (one
    object per group: :func:`collective_watch`).
    """

    def __init__(self, group) -> None:
        self.ranks = list(dist.get_process_group_ranks(group or dist.group.WORLD))
        self.rank = dist.get_rank()
        self.tag = "-".join(map(str, self.ranks))
        self.seq = 0
        self.returned = ReturnedRanks([r for r in self.ranks if r != self.rank])

    def key(self, rank: int) -> str:
        """The store key of ``rank``'s long wait on this group."""
        return f"{_prefix()}/waiting/{self.tag}/{rank}"

    def issue(self) -> int:
        """Count one collective issued on the group; returns its number."""
        self.seq += 1
        return self.seq

    def watch(self, seq: int, what: str, gone_error: Callable[[list[int]], Exception]):
        """The ``watch`` for :func:`wait_watched` of collective ``seq`` (``what``: its kind, in
        words): raises ``gone_error(ranks)`` when peers returned from the launched function,
        and a mismatch error when a peer waits at the same number in another kind."""
        return _Waiting(self, seq, what, gone_error)


_WATCHES: dict[tuple, CollectiveWatch] = {}  # per process: one numbering per group


def collective_watch(group) -> CollectiveWatch | None:
    """The :class:`CollectiveWatch` of ``group`` in this process, or None where it cannot
    help: outside launch (no store to compare in) or on NCCL (see :func:`wait_watched`)."""
    if os.environ.get(STORE_ENV) is None or dist.get_backend(group) != "gloo":
        return None
    ranks = tuple(dist.get_process_group_ranks(group or dist.group.WORLD))
    key = (_prefix(), dist.get_rank(), ranks)
    if key not in _WATCHES:
        _WATCHES[key] = CollectiveWatch(group)
    return _WATCHES[key]


def wait_watched(work, watch: Callable[[], None] | None) -> None:
    """``work.wait()``, calling ``watch()`` every :data:`POLL_S` seconds while it lasts.

    Only for gloo: a gloo wait that times out leaves the operation running (an NCCL one may
    abort the communicator), so ``watch`` must be ``None`` for NCCL. ``watch`` raises to give
    up the wait; its ``done()``, if it has one, runs when the wait ends.
    """
    if watch is None:
        work.wait()
        return
    try:
        while True:
            try:
                work.wait(timeout=datetime.timedelta(seconds=POLL_S))
                return
            except RuntimeError:
                if work.is_completed():  # it failed, or finished as the wait timed out
                    work.wait()
                    return
            watch()
    finally:
        getattr(watch, "done", lambda: None)()


def mismatch_error(rank: int, what: str, peer: int, peer_what: str, seq: int) -> RuntimeError:
    """The error of ranks that wait in different collectives at the same point."""
    syncbn = "SyncBatchNorm" in what or "SyncBatchNorm" in peer_what
    hint = (
        "A SyncBatchNorm in eval() mode runs no collective while one in train() mode gathers "
        "statistics: call model.train() or model.eval() on every rank alike"
        if syncbn
        else "Every rank must run the same forwards and backwards, in the same order"
    )
    return RuntimeError(
        f"collective mismatch: rank {rank} waits in {what}, while rank {peer} waits in "
        f"{peer_what}, both as the group's collective #{seq}: the ranks issued different "
        f"collectives and would wait for each other forever. {hint}."
    )


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
