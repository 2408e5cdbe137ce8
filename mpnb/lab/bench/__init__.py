"""``mpnb bench``: our kernels against PyTorch's own, side by side, in one process.

A suite is a module ``mpnb/lab/bench/<name>.py`` (suite ``multi-tensor`` is module
``multi_tensor``) whose docstring's first line describes it and which defines::

    def cases(opts: Options) -> Iterable[Case]:
        ...  # yield one Case per comparison, baseline (PyTorch) candidate first

Suites are found on disk and imported only when run, so ``mpnb bench --list`` is fast. The
method (round-robin rounds, median of per-round ratios, same-run bandwidth baselines) is in
:mod:`mpnb.lab.bench._harness`; see there before writing a suite.

Example::

    from mpnb.lab.bench import Candidate, Case, READ

    def cases(opts):
        x = torch.randn(int(1e6 * opts.scale))
        yield Case("sum", "1M fp32", [
            Candidate("torch.sum", x.sum, bytes=4 * x.numel(), access=READ),
            Candidate("mpnb sum", lambda: my_sum(x), bytes=4 * x.numel(), access=READ,
                      target=1.2),
        ], bandwidth_numel=x.numel())
"""

from __future__ import annotations

import argparse
import ast
import importlib
import pkgutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

from mpnb.lab.bench._harness import (
    READ,
    RMW,
    Candidate,
    Case,
    Options,
    Row,
    iqr,
    median,
    per_round_ratios,
    ratio_summary,
    run_case,
    run_cases,
)
from mpnb.lab.bench._report import (
    collect_header,
    format_header,
    format_rows,
    loadavg,
    write_json,
)

__all__ = [
    "READ",
    "RMW",
    "Candidate",
    "Case",
    "Options",
    "Row",
    "Result",
    "iqr",
    "median",
    "per_round_ratios",
    "ratio_summary",
    "run_case",
    "run_cases",
    "suites",
    "run_suite",
    "main",
]


def suites() -> dict[str, str]:
    """``{suite name: one-line description}`` for every suite module, without importing any."""
    here = Path(__file__).parent
    out = {}
    for mod in sorted(pkgutil.iter_modules([str(here)]), key=lambda m: m.name):
        if mod.name.startswith("_") or mod.ispkg:
            continue
        try:
            doc = ast.get_docstring(ast.parse((here / f"{mod.name}.py").read_text())) or ""
        except (OSError, SyntaxError):
            doc = ""
        out[mod.name.replace("_", "-")] = (doc.strip().splitlines() or [""])[0]
    return out


def _load(name: str):
    if name not in suites():
        known = ", ".join(suites()) or "none"
        raise KeyError(f"no benchmark suite {name!r}; known suites: {known}.")
    return importlib.import_module(f"{__name__}.{name.replace('-', '_')}")


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

    Example::

        >>> res = run_suite("multi-tensor", Options.make(quick=True))
        >>> [r.status for r in res.rows if r.status]
    """
    opts = opts or Options.make()
    module = _load(name)
    header = {
        "suite": name,
        **collect_header(opts.device),
        "rounds": opts.rounds,
        "quick": opts.quick,
    }
    if opts.scale != 1.0:
        header["scale"] = opts.scale
    result = Result(name, header)
    if echo:
        print(format_header(header))
        print(format_rows([]), flush=True)
    printer = (lambda rows: print(format_rows(rows, title=False), flush=True)) if echo else None
    result.rows = run_cases(module.cases(opts), opts, suite=name, on_rows=printer)
    header["loadavg_end"] = loadavg()
    return result


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mpnb bench", description="Benchmarks of mpnb's kernels against PyTorch's own."
    )
    p.add_argument("suite", nargs="?", help="the suite to run (see --list)")
    p.add_argument("--list", action="store_true", help="list the suites and exit")
    p.add_argument("--json", metavar="PATH", help="also write the header and rows to PATH")
    p.add_argument("--rounds", type=int, help="timed rounds per case (default 15; 5 with --quick)")
    p.add_argument("--quick", action="store_true", help="a rough run in seconds")
    p.add_argument(
        "--filter",
        default="",
        metavar="SUBSTR",
        help="only cases whose 'case [workload]' contains SUBSTR",
    )
    p.add_argument(
        "--scale",
        type=float,
        default=1.0,
        help="multiply workload sizes (smoke tests use tiny ones)",
    )
    p.add_argument("--device", default="cpu", help="device for the suite's tensors")
    return p


def main(argv: list[str] | None = None) -> int:
    """``mpnb bench <suite> [--json PATH] [--rounds N] [--quick] [--filter S]``; ``--list``."""
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    if args.list or not args.suite:
        for name, doc in suites().items():
            print(f"{name:16} {doc}")
        return 0 if args.list else 2
    try:  # bad input is reported before anything runs; a suite's own errors keep their traceback
        opts = Options.make(
            quick=args.quick,
            rounds=args.rounds,
            scale=args.scale,
            filter=args.filter,
            device=args.device,
        )
        _load(args.suite)
    except (KeyError, ValueError) as e:
        print(f"mpnb bench: {e.args[0] if e.args else e}", file=sys.stderr)
        return 2
    result = run_suite(args.suite, opts, echo=True)
    if not result.rows:
        print(f"mpnb bench: no case matched --filter {args.filter!r}.", file=sys.stderr)
    if args.json:
        write_json(args.json, result.header, result.rows)
        print(f"# wrote {args.json}")
    return 0
