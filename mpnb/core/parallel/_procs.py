"""The process trees of launched ranks: started as a unit, stopped as a unit.

Each rank leads a session of its own (``os.setsid`` as it starts), so everything it starts
(``DataLoader`` workers, ``subprocess`` children and their children) shares its process
group and can be signalled at once. Stopping a launch signals every rank's group, and also
every descendant found under ``/proc`` (a child may have left the group with a session of its
own): SIGTERM first, SIGKILL after a short grace. A rank whose caller disappears (killed,
so no ``finally`` ran in it) notices within half a second and ends its own tree.
"""

from __future__ import annotations

import os
import signal
import threading
import time

__all__ = ["lead_own_group", "stop_trees"]

_POLL = 0.05
_GROUPS = hasattr(os, "setsid")  # POSIX; elsewhere only the ranks themselves are signalled
_KILL = getattr(signal, "SIGKILL", signal.SIGTERM)  # Windows: both end the process at once


def lead_own_group(caller: int) -> None:
    """In a rank: lead a new session, and end the whole tree if ``caller`` goes away."""
    try:
        if _GROUPS:
            os.setsid()
    except OSError:  # already a group leader: its group is its own already
        pass
    threading.Thread(
        target=_orphan_watchdog, args=(caller,), name="mpnb-orphan-watchdog", daemon=True
    ).start()


def _orphan_watchdog(caller: int) -> None:
    # A rank outliving its caller would hold the CPU (and a GPU) forever: nobody waits for
    # its result any more. Reparenting shows in getppid().
    while os.getppid() == caller:
        time.sleep(0.5)
    me = os.getpid()
    _signal_pids(_descendants([me]), _KILL)
    if _GROUPS and os.getpgrp() == me:
        os.killpg(me, _KILL)
    os.kill(me, _KILL)


def _stat(pid: int | str) -> tuple[int, int, str] | None:
    """(parent pid, start time, state) of ``pid``, or None when it is gone (or no ``/proc``)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # the command name (field 2) may hold spaces and parentheses: split after the last ')'
    rest = stat[stat.rindex(b")") + 2 :].split()
    return int(rest[1]), int(rest[19]), rest[0].decode()


def _proc_table() -> dict[int, tuple[int, int, str]]:
    """pid -> :func:`_stat` of every process; empty without ``/proc``."""
    try:
        names = os.listdir("/proc")
    except OSError:
        return {}
    table = {int(n): _stat(n) for n in names if n.isdigit()}
    return {pid: st for pid, st in table.items() if st is not None}


def _descendants(roots: list[int]) -> dict[int, int]:
    """Every living descendant of ``roots`` (not the roots): pid -> start time."""
    table = _proc_table()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found: dict[int, int] = {}
    todo = list(roots)
    while todo:
        for kid in children.get(todo.pop(), []):
            if kid not in found:
                found[kid] = table[kid][1]
                todo.append(kid)
    return found


def _running(pids: dict[int, int]) -> dict[int, int]:
    """The ``pids`` still running as the same process (same start time, not a zombie)."""
    out = {}
    for pid, start in pids.items():
        st = _stat(pid)
        if st is not None and st[1] == start and st[2] != "Z":
            out[pid] = start
    return out


def _signal_pids(pids: dict[int, int], sig: int) -> None:
    for pid in _running(pids):  # the start time guards against a recycled pid
        try:
            os.kill(pid, sig)
        except OSError:
            pass


def _signal_trees(procs, tree: dict[int, int], sig: int) -> None:
    for p in procs:
        if p.pid is None:
            continue
        try:
            if _GROUPS:
                os.killpg(p.pid, sig)  # the rank and all it started (once it led its group)
        except OSError:
            pass  # no such group: the rank never got to setsid, or all of it is gone
        (p.terminate if sig == signal.SIGTERM else p.kill)()  # no-op once reaped
    _signal_pids(tree, sig)


def _all_gone(procs, tree: dict[int, int]) -> bool:
    return not any(p.is_alive() for p in procs) and not _running(tree)


def _wait(procs, tree: dict[int, int], seconds: float) -> None:
    end = time.monotonic() + seconds
    while not _all_gone(procs, tree) and time.monotonic() < end:
        time.sleep(_POLL)


def stop_trees(procs, finished: bool, grace: float = 3.0) -> None:
    """End every rank in ``procs`` and everything each one started; return when all are gone.

    Args:
        procs: the ranks (``multiprocessing.Process``), started or not.
        finished: the ranks all reported: give them ``grace`` seconds to exit on their own
            before anything is signalled.
        grace: seconds between SIGTERM and SIGKILL (and of the wait above).

    A second ``KeyboardInterrupt`` while this waits skips straight to SIGKILL.
    """
    tree = _descendants([p.pid for p in procs if p.pid is not None])  # before any dies
    try:
        if finished:  # only the ranks: what they left running is stopped below
            _wait(procs, {}, grace)
        _signal_trees(procs, tree, signal.SIGTERM)
        _wait(procs, tree, grace)
    finally:
        if not _all_gone(procs, tree):
            _signal_trees(procs, tree, _KILL)
        # also what started after the snapshot, in the ranks' groups
        _signal_trees([p for p in procs if p.pid is not None], {}, _KILL)
        for p in procs:
            if p.pid is not None:
                p.join(1.0)
