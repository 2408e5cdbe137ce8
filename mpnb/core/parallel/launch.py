"""``launch(fn, nprocs)``: run ``fn`` on N local ranks, from a script or a notebook.

Every rank joins a process group on 127.0.0.1 (a free port picked here; nothing else on the
network is touched), runs ``fn(*args)`` and sends back its return value or its exception with
the formatted traceback. The caller waits with a deadline: the first failure (an exception,
or a rank that dies without a word, e.g. killed or crashed) stops the other ranks and raises
:class:`RankError` naming the rank, with its traceback; ``timeout`` bounds the whole run.

Launch manages the ranks as a process manager does. Ranks are not daemonic, so a rank may
start processes of its own (a ``DataLoader`` with ``num_workers=2``, a ``subprocess``). Each
rank leads a process group of its own, and when launch returns or raises (a failure, the
timeout, a ``KeyboardInterrupt`` in the caller) nothing any rank started is still running:
every rank's group and every descendant get SIGTERM, then SIGKILL after 3 s. A rank whose
caller is killed outright ends its own tree within a second. Ctrl-C reaches the caller only,
which then stops the ranks; a second Ctrl-C skips the grace period.

A rank that returns from ``fn`` while another still waits for it in a
:class:`~mpnb.parallel.DistributedDataParallel` all-reduce (uneven inputs: the ranks ran
different numbers of batches) makes that rank fail within about a second, with an error
naming both ranks and the batch; ``with model.join():`` is the way to train on uneven inputs.
Ranks waiting in different collectives (one SyncBatchNorm in ``eval()``, the other training)
fail the same way, naming both collectives; a rank that raises stops the ones waiting for it.
When the timeout passes, the error names the ranks still in ``fn`` and where they are (their
stack, read with ``faulthandler``) and the ranks that had returned.

How the ranks start (the rule accelerate's ``notebook_launcher`` follows):

* ``fn`` importable (defined in a module or a script run as ``__main__``): **spawn**, fresh
  interpreters. CUDA already initialised in the caller is fine.
* ``fn`` defined in a notebook (``__main__`` without a file): spawned children cannot import
  it, so the ranks are **forked**. A forked child cannot use CUDA once the parent has
  initialised it, so then launch refuses and says how to fix it.

Under ``torchrun`` (``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` set), ``launch`` starts nothing: it
joins the group torchrun describes and runs ``fn`` in this process, so one script works both
ways (``python train.py`` and ``torchrun --nproc_per_node=2 train.py``); the checks above run
there too, through torchrun's store.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import gc
import math
import multiprocessing as mp
import os
import pickle
import re
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import wait

import torch
import torch.distributed as dist

from mpnb.core.parallel._procs import lead_own_group, stop_trees
from mpnb.core.parallel._watch import (
    PREFIX_ENV,
    STORE_ENV,
    connect_store,
    mark_failed,
    mark_returned,
)

__all__ = [
    "launch",
    "RankError",
    "end_group",
    "free_port",
    "under_torchrun",
    "cpus_available",
    "local_ranks",
    "share_cpus",
]

LOOPBACK = "127.0.0.1"
_DIAGNOSE_S = 1.0  # at most this much of the timeout goes to reading the hung ranks' stacks


class RankError(RuntimeError):
    """A rank raised or died. ``rank`` is the failing rank, ``remote_traceback`` its traceback."""

    def __init__(self, message: str, rank: int, remote_traceback: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        self.remote_traceback = remote_traceback


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def under_torchrun() -> bool:
    """True inside a rank started by torchrun (its environment describes the group)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"))


def end_group(meet: bool = True) -> None:
    """Tear down the default process group while Python still runs, as every rank must.

    A group left alive until the interpreter exits can abort the rank ("terminate called
    without an active exception"): a gloo worker thread drops its last reference to a finished
    collective lazily, that work holds Python objects (the thread-local state it captured,
    such as an active ``TorchFunctionMode``), and a thread that asks for the GIL once Python
    is finalizing is ended inside that destructor. Destroying the group joins those threads
    first. The modules that hold the group (DDP, SyncBN) often sit in reference cycles, so
    they are collected before it is destroyed.

    Args:
        meet: first wait in a barrier for every rank, so that no rank closes its connections
            while another still talks on them. Pass False after a failure (the other ranks
            may sit in a collective that a barrier would pair with) or when the ranks met.

    Example::

        >>> dist.init_process_group("gloo")
        >>> train()
        >>> end_group()
    """
    if meet:
        dist.barrier()
    gc.collect()
    dist.destroy_process_group()


@contextlib.contextmanager
def _torchrun_store(timeout: float):
    """Under torchrun: the store torchrun's group meets in, named to this rank's DDP and
    SyncBatchNorm (``STORE_ENV``) with keys of this launch call alone, so that a rank waiting
    for one that returned, or for another collective, fails naming it as under launch. The
    environment is restored after."""
    addr = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    store = connect_store(addr, timeout)
    run = os.environ.get("TORCHELASTIC_RUN_ID", "run")
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    base = f"mpnb/launch/{run}/{restart}"
    calls = store.add(f"{base}/calls/{dist.get_rank()}", 1)  # the same count on every rank
    before = {k: os.environ.get(k) for k in (STORE_ENV, PREFIX_ENV)}
    os.environ.update({STORE_ENV: addr, PREFIX_ENV: f"{base}/{calls}"})
    try:
        yield store
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _meet(store, timeout: float) -> None:
    """Mark this rank returned and wait for every rank, naming the ones that never came."""
    try:
        mark_returned(store, dist.get_rank(), dist.get_world_size(), timeout)
    except RuntimeError as e:
        raise RuntimeError(f"launch: {e}") from None


# ---- threads: several ranks on one machine share its CPUs ----------------------------------


def _cgroup_cpus() -> float | None:
    """The CPU quota of this process's cgroup (v2 ``cpu.max``), in CPUs; None when unlimited."""
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        return None


def cpus_available() -> int:
    """The CPUs this process may run on: its affinity mask (``taskset``, a job scheduler's
    binding), capped by a cgroup CPU quota (a container), not the machine's core count.

    Example::

        >>> cpus_available()        # under `taskset -c 0 python ...`: 1
        1
    """
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity API (macOS)
        n = os.cpu_count() or 1
    quota = _cgroup_cpus()
    if quota is not None:
        n = min(n, int(quota))
    return max(1, n)


def local_ranks() -> int:
    """How many ranks of this job run on this machine, from the launcher's environment:
    ``LOCAL_WORLD_SIZE`` (torchrun), else ``WORLD_SIZE`` when the master is this machine
    (``MASTER_ADDR`` a loopback address, as single-machine launch scripts set it), else 1."""
    env = os.environ
    if env.get("LOCAL_WORLD_SIZE", "").isdigit():
        return max(1, int(env["LOCAL_WORLD_SIZE"]))
    if env.get("WORLD_SIZE", "").isdigit() and env.get("MASTER_ADDR") in (
        LOOPBACK,
        "localhost",
        "::1",
    ):
        return max(1, int(env["WORLD_SIZE"]))
    return 1


def share_cpus(ranks: int) -> int:
    """Give this process its share of the CPUs when ``ranks`` processes run on them together.

    Each process of PyTorch starts one intra-op thread per core; N ranks on one machine then
    run N times as many threads as cores, and every parallel region can wait for a thread the
    OS has descheduled, most of all on a machine that other work keeps busy. This lowers
    ``torch.set_num_threads`` to ``cpus_available() // ranks`` (at least 1), and never raises
    it. ``OMP_NUM_THREADS`` set by the user wins: nothing changes.

    Args:
        ranks: processes sharing this machine's CPUs (this one included).

    Returns:
        The number of intra-op threads in effect.

    Example::

        >>> share_cpus(local_ranks())      # e.g. 2 ranks on 2 CPUs: 1 thread each
        1
    """
    if os.environ.get("OMP_NUM_THREADS"):
        return torch.get_num_threads()
    share = max(1, cpus_available() // max(1, ranks))
    if share < torch.get_num_threads():
        torch.set_num_threads(share)
    return torch.get_num_threads()


def _default_backend() -> str:
    return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"


def _interactive(fn: Callable) -> bool:
    main = sys.modules.get("__main__")
    return getattr(fn, "__module__", None) == "__main__" and not hasattr(main, "__file__")


def _start_method(fn: Callable, backend: str, start_method: str | None) -> str:
    method = start_method or ("fork" if _interactive(fn) else "spawn")
    if method == "fork" and torch.cuda.is_initialized():
        raise RuntimeError(
            "launch: CUDA was already initialised in this process, and the ranks must be "
            f"forked ({'fn is defined in a notebook' if _interactive(fn) else 'fork asked'}); "
            "a forked child cannot use CUDA then. Restart the kernel and call launch before "
            "any CUDA call (no model.cuda(), no tensors on the GPU), or move fn into a .py "
            "module and import it, so that the ranks can be spawned."
        )
    return method


def _by_value(msg) -> bytes:
    # Plain pickle copies tensor data into the message. multiprocessing's own pickler would
    # share each tensor's storage through a file descriptor that dies with the rank, so a
    # rank returning a tensor and exiting left the caller with a ConnectionResetError.
    return pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)


def _worker(rank, nprocs, fn, args, backend, port, timeout, threads, caller, conn, stacks):
    lead_own_group(caller)  # first: anything the rank starts belongs to its group
    _stack_on_request(stacks)
    os.environ.update(
        MASTER_ADDR=LOOPBACK,
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(nprocs),
        LOCAL_WORLD_SIZE=str(nprocs),
        **{STORE_ENV: f"{LOOPBACK}:{port}"},
    )
    store = None
    try:
        torch.set_num_threads(threads)
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        td = datetime.timedelta(seconds=timeout)
        store = dist.TCPStore(LOOPBACK, port, nprocs, rank == 0, timeout=td)
        dist.init_process_group(backend, store=store, rank=rank, world_size=nprocs, timeout=td)
        out = fn(*args)
        conn.send_bytes(_by_value(("returned", rank)))  # for the timeout's message
        # Meet in the store first, not in a collective: a rank still inside fn (waiting in an
        # all-reduce for this one) sees the key and fails with a clear error, where a barrier
        # would be paired with its all-reduce. Then the barrier: every rank done with the
        # group (its last asynchronous work included) before any tears it down.
        mark_returned(store, rank, nprocs)
        dist.barrier()
        conn.send_bytes(_by_value(("ok", rank, out)))
    except BaseException as e:  # noqa: BLE001 - everything goes back to the caller
        msg = ("error", rank, f"{type(e).__name__}: {e}", traceback.format_exc())
        conn.send_bytes(_by_value(msg))
        if store is not None:
            mark_failed(store, rank, e)  # the ranks waiting for this one stop waiting
    finally:
        if dist.is_initialized():
            end_group(meet=False)  # the barrier above met already, or a rank failed
        conn.close()


def _stack_on_request(path: str | None) -> None:
    """In a rank: write the Python stack of every thread to ``path`` on SIGUSR1 (the caller
    asks when the rank overstays the timeout, to say where it is stuck)."""
    if path is None or not hasattr(signal, "SIGUSR1"):
        return
    f = open(path, "w")  # noqa: SIM115 - open for the life of the rank, as faulthandler needs
    faulthandler.register(signal.SIGUSR1, file=f, all_threads=True)


def _where_all(procs, paths, hung: list[int], seconds: float) -> dict[int, str]:
    """Where each running rank of ``hung`` is now (its ``fn`` frames, outermost first; ""
    when unknown), asked of all of them at once and answered within ``seconds``: each rank's
    faulthandler writes every thread's stack on SIGUSR1 (a rank still starting writes none)."""
    asked = []
    for r in hung:
        if paths[r] is None or not hasattr(signal, "SIGUSR1") or not procs[r].is_alive():
            continue
        try:
            os.kill(procs[r].pid, signal.SIGUSR1)
            asked.append(r)
        except OSError:
            pass
    text = dict.fromkeys(asked, "")
    end = time.monotonic() + seconds
    waiting = set(asked)
    while waiting and time.monotonic() < end:  # until every dump stops growing
        time.sleep(min(0.1, max(0.0, end - time.monotonic())))
        for r in list(waiting):
            now = _read(paths[r])
            if now and now == text[r]:
                waiting.discard(r)
            text[r] = now
    return {r: _fn_frames(t) for r, t in text.items()}


def _fn_frames(text: str) -> str:
    """The frames of ``fn`` in a faulthandler dump (the thread that runs ``_worker``)."""
    for section in re.split(r"\n(?=Thread |Current thread )", text):
        frames = re.findall(r'File "([^"]+)", line (\d+) in (\S+)', section)
        names = [f[2] for f in frames]  # innermost first
        if "_worker" in names:
            inner = frames[: names.index("_worker")][::-1]  # fn's frames, outermost first
            return " > ".join(f"{os.path.basename(f)}:{n} in {fn}" for f, n, fn in inner[-4:])
    return ""


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def _timeout_error(nprocs, results, returned, procs, stacks, timeout, seconds) -> TimeoutError:
    """The timeout's error, with where each hung rank is (asked within ``seconds``)."""
    hung = [r for r in range(nprocs) if r not in results and r not in returned]
    where = _where_all(procs, stacks, hung, seconds) if stacks else {}
    lines = []
    for r in hung:
        at = where.get(r, "")
        lines.append(f"rank {r} was still in fn" + (f", at: {at}" if at else ""))
    waited = sorted(set(returned) - set(results))
    if waited:
        lines.append(f"rank(s) {', '.join(map(str, waited))} had returned and waited for it")
    return TimeoutError(
        f"launch: rank(s) {', '.join(map(str, hung)) or '-'} did not return from fn within "
        f"{timeout:.0f} s ({'; '.join(lines)}); every rank and every process they started "
        "were stopped. Raise timeout= if the work is really that long; else look at what the "
        "stuck rank waits for (a collective the others never reach, a blocking read)."
    )


def _collect(procs, conns, nprocs: int, timeout: float, stacks=None, start=None) -> list:
    """Every rank's result, in rank order; raises at the first failure, or at the deadline
    (``start`` + ``timeout``: the hung ranks' stacks are read inside it, not after it)."""
    results: dict[int, object] = {}
    returned: set[int] = set()
    deadline = (time.monotonic() if start is None else start) + timeout
    diagnose = min(_DIAGNOSE_S, max(0.25, 0.05 * timeout), 0.25 * timeout)  # where they hung
    open_ = dict(zip(conns, range(nprocs), strict=True))
    sentinels = {p.sentinel: r for r, p in enumerate(procs)}
    while len(results) < nprocs:
        left = deadline - diagnose - time.monotonic()
        if left <= 0:
            seconds = max(0.0, deadline - time.monotonic())
            raise _timeout_error(nprocs, results, returned, procs, stacks, timeout, seconds)
        ready = wait([*open_, *(s for s, r in sentinels.items() if r not in results)], left)
        for obj in ready:
            if obj in open_:
                rank = open_[obj]
                try:
                    msg = pickle.loads(obj.recv_bytes())
                except EOFError:
                    open_.pop(obj)
                    continue  # closed without a message: the sentinel reports the death
                if msg[0] == "returned":
                    returned.add(rank)
                    continue
                open_.pop(obj)
                if msg[0] == "error":
                    raise RankError(
                        f"launch: rank {msg[1]} raised {msg[2]}\n--- traceback of rank "
                        f"{msg[1]} ---\n{msg[3]}",
                        msg[1],
                        msg[3],
                    )
                results[rank] = msg[2]
            elif obj in sentinels and sentinels[obj] not in results:
                rank = sentinels[obj]
                conn = next((c for c, r in open_.items() if r == rank), None)
                if conn is not None and conn.poll(0.5):
                    continue  # its last message is still in the pipe: read it first
                procs[rank].join(1.0)  # sets exitcode
                raise RankError(
                    f"launch: rank {rank} died with exit code {procs[rank].exitcode} before "
                    "reporting (killed, out of memory, or a crash in native code); the other "
                    "ranks, and every process the ranks started, were stopped.",
                    rank,
                )
    return [results[r] for r in range(nprocs)]


def _check_timeout(timeout) -> None:
    """Refuse a timeout that bounds nothing (zero, negative, NaN, infinite, not a number)."""
    ok = isinstance(timeout, (int, float)) and not isinstance(timeout, bool)
    if not (ok and math.isfinite(timeout) and timeout > 0):
        raise ValueError(
            f"launch: timeout={timeout!r} bounds nothing; give the seconds the whole run may "
            "take (the ranks' start, fn and the report of a hung rank), a positive finite "
            "number such as timeout=300."
        )


def launch(
    fn: Callable,
    nprocs: int,
    backend: str | None = None,
    args: tuple = (),
    timeout: float = 300.0,
    start_method: str | None = None,
    threads: int | None = None,
) -> list:
    """Run ``fn(*args)`` on ``nprocs`` local ranks; return each rank's return value.

    Ranks are ordinary (not daemonic) processes, each leading its own process group, so
    ``fn`` may start processes too (``DataLoader(..., num_workers=2)``, ``subprocess``).
    When launch returns or raises, every rank and everything it started has ended: after
    success the ranks get 3 s to exit on their own, then whatever is left (e.g. a child a
    rank did not wait for) gets SIGTERM, and SIGKILL 3 s later; after a failure, the timeout
    or a ``KeyboardInterrupt`` in the caller, the same happens at once.

    Args:
        fn: the function every rank runs (after its process group is set up).
        nprocs: number of ranks.
        backend: ``"gloo"`` or ``"nccl"``; default NCCL when CUDA is available, else gloo.
        args: positional arguments for ``fn`` (must pickle).
        timeout: seconds for the whole run (a positive finite number), from this call to the
            error that names a hung rank and where it is; also the process group's
            collective timeout.
        start_method: ``"spawn"`` or ``"fork"``; default spawn, fork for notebook functions.
        threads: torch threads per rank (default: the CPUs this process may use, its
            affinity and cgroup quota, divided by ``nprocs``; see :func:`share_cpus`).

    Raises:
        RankError: a rank raised (its traceback is in the message) or died. A rank waiting
            in a DistributedDataParallel all-reduce for a rank that already returned from
            ``fn`` raises within about a second (uneven inputs: use ``model.join()``).
        TimeoutError: the ranks did not all finish within ``timeout``.
        ValueError: ``nprocs`` below 1, or a ``timeout`` that bounds nothing (0, negative,
            NaN, infinite).
        KeyboardInterrupt: passed on, after the ranks were stopped.

    Example::

        >>> def train():
        ...     return torch.distributed.get_rank()
        >>> launch(train, nprocs=2)
        [0, 1]
    """
    start = time.monotonic()
    if nprocs < 1:
        raise ValueError(f"launch: nprocs must be at least 1, got {nprocs}.")
    _check_timeout(timeout)
    backend = backend or _default_backend()
    if under_torchrun():
        if dist.is_initialized():
            return [fn(*args)]  # the caller's group: the caller tears it down
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))
        with _torchrun_store(timeout) as store:
            try:
                out = fn(*args)
            except BaseException as e:
                # The group is left alone (tearing it down while the other ranks sit in a
                # collective would hang); the store tells them, so that they stop waiting
                # and exit, which ends this rank's own pending collectives too.
                mark_failed(store, dist.get_rank(), e)
                raise
            # As under launch, meet in the store first: a rank still waiting for this one in
            # a DDP all-reduce then fails naming it (uneven inputs), where a barrier would be
            # paired with its all-reduce.
            _meet(store, timeout)
        end_group()
        return [out]
    if dist.is_initialized():
        raise RuntimeError(
            "launch: this process is already in a process group; launch starts new ranks. "
            "Call torch.distributed.destroy_process_group() first, or run fn directly."
        )
    ctx = mp.get_context(_start_method(fn, backend, start_method))
    port = free_port()
    threads = threads or max(1, cpus_available() // nprocs)
    procs, conns, finished = [], [], False
    with tempfile.TemporaryDirectory(prefix="mpnb-launch-") as tmp:
        stacks = [os.path.join(tmp, f"stack{r}.txt") for r in range(nprocs)]
        try:
            for rank in range(nprocs):
                recv, send = ctx.Pipe(duplex=False)
                p = ctx.Process(  # not daemonic: a rank may start its own workers
                    target=_worker,
                    name=f"mpnb-rank{rank}",
                    args=(
                        rank,
                        nprocs,
                        fn,
                        args,
                        backend,
                        port,
                        timeout,
                        threads,
                        os.getpid(),
                        send,
                        stacks[rank],
                    ),
                )
                procs.append(p)
                p.start()
                send.close()
                conns.append(recv)
            out = _collect(procs, conns, nprocs, timeout, stacks, start)
            finished = True
            return out
        finally:
            stop_trees(procs, finished)
