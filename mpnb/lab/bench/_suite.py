"""Running a whole suite: the header, the cases one by one, the rows (printed as they come)."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

from mpnb.lab.bench._compile import inductor_settings
from mpnb.lab.bench._harness import Options, Row, run_cases
from mpnb.lab.bench._registry import load_suite
from mpnb.lab.bench._report import collect_header, format_header, format_rows
from mpnb.lab.stats import loadavg, torch_threads

__all__ = ["Result", "run_suite"]


@dataclass
class Result:
    """A suite run: the conditions (``header``), one :class:`Row` per timed callable, the
    suite's table columns (None: the default ones) and its closing sentences (``summary``)."""

    suite: str
    header: dict
    rows: list[Row] = field(default_factory=list)
    columns: tuple[str, ...] | None = None
    summary: list[str] = field(default_factory=list)

    def table(self) -> str:
        """The rows as the printed table, then the summary lines (``# ...``)."""
        return "\n".join([format_rows(self.rows, columns=self.columns), *_footer(self.summary)])


def _footer(summary: list[str]) -> list[str]:
    return [f"# {line}" for line in summary]


class _Stopped(Exception):
    """SIGTERM arrived during a run (a time budget ran out, as ``scripts/gpu-check.sh``'s)."""


@contextlib.contextmanager
def _stop_on_sigterm() -> Iterator[None]:
    """Turn SIGTERM into :class:`_Stopped` inside the body (main thread only), so a stopped run
    keeps, and saves, the cases it finished; the previous handler is restored after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise _Stopped

    before = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


def run_suite(name: str, opts: Options | None = None, echo: bool = False) -> Result:
    """Run suite ``name`` and return its :class:`Result` (``echo`` prints rows as they come).

    A suite may name its table's columns (``COLUMNS``, titles of
    :data:`~mpnb.lab.bench._report.COLUMN_TITLES`) and close the run with sentences drawn
    from all its rows (``summary(rows) -> list[str]``), printed after the table.

    The kernels are built (if needed) before anything is timed. ``opts.threads`` applies to
    the run only: the previous ``torch.get_num_threads()`` is restored, also on errors.
    A SIGTERM during the cases ends the run with the cases finished so far (the header's
    ``"stopped"`` says so), which the caller still saves: a run stopped by a time budget loses
    only the case it was in.

    Example::

        >>> res = run_suite("multi-tensor", Options.make(quick=True))
        >>> print(res.table())
    """
    opts = opts or Options.make()
    module = load_suite(name)
    with torch_threads(opts.threads):
        header = {"suite": name, **collect_header(opts.device)}
        header.update(rounds=opts.rounds, quick=opts.quick, compile=opts.compile)
        if opts.compile:
            header["inductor"] = inductor_settings()
        if opts.scale != 1.0:
            header["scale"] = opts.scale
        cols = getattr(module, "COLUMNS", None)
        result = Result(name, header, columns=None if cols is None else tuple(cols))
        if echo:
            print(format_header(header))
            print(format_rows([], columns=result.columns), flush=True)

        done: list[Row] = []

        def collect(rows: list[Row]) -> None:
            done.extend(rows)
            if echo:
                print(format_rows(rows, title=False, columns=result.columns), flush=True)

        try:
            with _stop_on_sigterm():
                run_cases(module.cases(opts), opts, suite=name, on_rows=collect)
        except _Stopped:
            header["stopped"] = f"SIGTERM after {len({(r.case, r.workload) for r in done})} cases"
            if echo:
                print(f"# stopped: {header['stopped']}", flush=True)
        result.rows = done
        result.summary = list(getattr(module, "summary", lambda rows: [])(result.rows))
        if echo and result.summary:
            print("\n".join(_footer(result.summary)), flush=True)
    header["loadavg_end"] = loadavg()
    return result
