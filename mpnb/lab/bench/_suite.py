"""Running a whole suite: the header, the cases one by one, the rows (printed as they come)."""

from __future__ import annotations

from dataclasses import dataclass, field

from mpnb.lab.bench._compile import inductor_settings
from mpnb.lab.bench._harness import Options, Row, run_cases
from mpnb.lab.bench._registry import load_suite
from mpnb.lab.bench._report import collect_header, format_header, format_rows
from mpnb.lab.stats import loadavg, torch_threads

__all__ = ["Result", "run_suite"]


@dataclass
class Result:
    """A suite run: the conditions (``header``) and one :class:`Row` per timed callable."""

    suite: str
    header: dict
    rows: list[Row] = field(default_factory=list)

    def table(self) -> str:
        """The rows as the printed table."""
        return format_rows(self.rows)


def run_suite(name: str, opts: Options | None = None, echo: bool = False) -> Result:
    """Run suite ``name`` and return its :class:`Result` (``echo`` prints rows as they come).

    The kernels are built (if needed) before anything is timed. ``opts.threads`` applies to
    the run only: the previous ``torch.get_num_threads()`` is restored, also on errors.

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
        result = Result(name, header)
        if echo:
            print(format_header(header))
            print(format_rows([]), flush=True)

        def printer(rows: list[Row]) -> None:
            print(format_rows(rows, title=False), flush=True)

        on_rows = printer if echo else None
        result.rows = run_cases(module.cases(opts), opts, suite=name, on_rows=on_rows)
    header["loadavg_end"] = loadavg()
    return result
