"""How ``compare`` stops: Ctrl-C and SIGTERM end a run as Stop does, in one process or isolated.

In one process, Ctrl-C raises ``KeyboardInterrupt`` in the middle of a step and the runner
keeps the steps finished before it; SIGTERM (a job scheduler's time limit, ``kill``) raises
:class:`Terminated`, a ``KeyboardInterrupt``, the same way (:func:`sigterm_interrupts`).

With ``isolate=True`` each configuration trains in a spawned subprocess that ignores SIGINT
(a Ctrl-C at a terminal reaches the whole process group) and treats SIGTERM as a stop request.
The parent catches both signals while it waits (:class:`StopSignals`) and asks the subprocess,
through the pipe it reads the steps from, to stop after the step in progress; the subprocess
then returns its measured row as an in-process run does. A second Ctrl-C ends the subprocess
at once (nothing of that configuration is kept).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import pickle
import signal
import threading
from collections.abc import Callable, Iterator
from multiprocessing.connection import wait

import torch

from mpnb.lab import workloads as _workloads
from mpnb.lab._errors import describe_error
from mpnb.lab._train import RunResult, run_config

__all__ = ["Terminated", "stop_label", "sigterm_interrupts", "StopSignals", "run_isolated"]

_POLL_S = 0.2  # how often the parent looks at Stop and at the signals while a child trains


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived during :func:`mpnb.lab.compare`: the run ends as a Ctrl-C ends it."""


def stop_label(e: KeyboardInterrupt) -> str:
    """What stopped a run, as the rows say it: ``"SIGTERM"`` or ``"Ctrl-C"``."""
    return "SIGTERM" if isinstance(e, Terminated) else "Ctrl-C"


def _can_take(signum: int) -> bool:
    # Signal handlers belong to the main thread; a handler somebody else installed (a
    # framework's, the user's) is theirs to keep.
    return threading.current_thread() is threading.main_thread() and signal.getsignal(signum) in (
        signal.SIG_DFL,
        signal.default_int_handler,
    )


@contextlib.contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """Within the body, SIGTERM raises :class:`Terminated` (once; later ones are ignored while
    the run writes its rows). The previous handler is restored after, also on errors.

    Only in the main thread and only over Python's default handler.
    """
    if not _can_take(signal.SIGTERM):
        yield
        return
    seen = []

    def handler(signum, frame):
        if not seen:
            seen.append(signum)
            raise Terminated()

    before = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


class StopSignals:
    """While active (a context manager), Ctrl-C and SIGTERM are recorded instead of raised.

    ``asked`` is the first one's label (``"Ctrl-C"``/``"SIGTERM"``, "" when none came) and
    ``count`` how many arrived. Handlers are installed only in the main thread, over Python's
    defaults, and restored on exit.
    """

    def __init__(self) -> None:
        self.asked, self.count = "", 0
        self._before: dict[int, object] = {}

    def _handler(self, signum, frame) -> None:
        self.count += 1
        self.asked = self.asked or ("SIGTERM" if signum == signal.SIGTERM else "Ctrl-C")

    def __enter__(self) -> StopSignals:
        for s in (signal.SIGINT, signal.SIGTERM):
            if _can_take(s):
                self._before[s] = signal.signal(s, self._handler)
        return self

    def __exit__(self, *exc) -> None:
        for s, h in self._before.items():
            signal.signal(s, h)
        self._before.clear()


def _child(cfg, spec, threads: int | None, conn) -> None:
    """The subprocess: train ``cfg`` step by step, reporting each step; stop when asked."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent asks for the stop, by the pipe
    asked: list[str] = []
    signal.signal(signal.SIGTERM, lambda *_: asked.append("SIGTERM"))
    if threads is not None:
        torch.set_num_threads(threads)  # a fresh process of its own: nothing to restore

    def stop() -> str:
        while conn.poll():
            asked.append(conn.recv())
        return asked[0] if asked else ""

    name, size = spec if isinstance(spec, tuple) else (spec, None)
    w = _workloads.get(name, size, cfg.device)
    res = run_config(cfg, w, on_step=lambda i: _send(conn, ("step", i)), should_stop=stop)
    _send(conn, ("done", res))
    conn.close()


def _send(conn, msg) -> None:
    # Plain pickle copies tensor data into the message; multiprocessing's pickler would share
    # each tensor's storage through a file descriptor that dies with this process, which
    # exits as soon as it has sent its result.
    conn.send_bytes(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))


def _died(cfg, p) -> RunResult:
    p.join(1.0)
    return RunResult(
        cfg,
        error=f"{cfg.label}: its subprocess died with exit code {p.exitcode} before reporting "
        "(killed, out of memory, or a crash in native code); run it alone (isolate=False) to "
        "see the failure.",
    )


def run_isolated(
    cfg,
    spec,
    threads: int | None,
    on_step: Callable[[int], None],
    signals: StopSignals,
    should_stop: Callable[[], bool] | None,
) -> RunResult:
    """Train ``cfg`` in a spawned subprocess; returns its row's :class:`RunResult`.

    ``on_step(i)`` runs in this process as the subprocess finishes step ``i``. A Stop
    (``should_stop()``) or a signal recorded by ``signals`` asks the subprocess to stop after
    its step; a second signal ends it at once.
    """
    try:
        pickle.dumps(spec)
    except (pickle.PicklingError, AttributeError, TypeError) as e:
        msg = (
            "isolate=True needs a picklable workload (model_fn, loss_fn, metric_fn defined at "
            "module level, not lambdas): " + describe_error(e)
        )
        return RunResult(cfg, error=f"{cfg.label}: {msg}")
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    p = ctx.Process(target=_child, args=(cfg, spec, threads, there), name="mpnb-compare")
    p.start()
    there.close()
    sent = ""
    try:
        while True:
            if not sent:
                stop = should_stop is not None and should_stop()
                sent = signals.asked or ("Stop" if stop else "")
                if sent:
                    here.send(sent)
            elif signals.count >= 2:
                return RunResult(
                    cfg,
                    interrupted=f"interrupted ({signals.asked} twice) in its subprocess, which "
                    "was ended at once: nothing measured",
                )
            for obj in wait([here, p.sentinel], _POLL_S):
                if obj is p.sentinel and not here.poll():
                    return _died(cfg, p)
                try:
                    kind, value = pickle.loads(here.recv_bytes())
                except EOFError:
                    return _died(cfg, p)
                if kind == "done":
                    return value
                on_step(value)
    finally:
        if p.is_alive():
            p.join(5.0 if not signals.count >= 2 else 0.0)
        if p.is_alive():
            p.kill()
            p.join()
        here.close()
