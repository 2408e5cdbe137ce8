"""``mpnb bench``: our kernels against PyTorch's own, side by side, in one process.

A suite is a module ``mpnb/lab/bench/<name>.py`` (suite ``multi-tensor`` is module
``multi_tensor``) whose docstring's first line describes it and which defines::

    def cases(opts: Options) -> Iterable[Case]:
        ...  # yield one Case per comparison, baseline (PyTorch) candidate first

A suite that cannot run everywhere also defines ``unavailable(opts) -> str | None``: the
reason it cannot run with ``opts`` here, which ``mpnb bench`` prints instead of running it
(suite ``cuda``, the Triton kernels, needs a GPU; ``mpnb bench --device cuda`` runs it).
Every suite runs on the device ``--device`` names (``mpnb bench fp8 --device cuda``).

A suite may also name its table's columns (``COLUMNS``: titles from
``_report.COLUMN_TITLES``, such as ``"TFLOP/s"`` and ``"95% CI"``) and define
``summary(rows) -> list[str]``: sentences drawn from all its rows, printed after the table
and saved as the JSON's ``"summary"`` (suite ``fp8``: where each recipe starts to pay).

Suites are found on disk and imported only when run, so ``mpnb bench --list`` is fast. The
method (round-robin rounds, median of per-round ratios, same-run bandwidth baselines) is in
:mod:`mpnb.lab.bench._harness`; see there before writing a suite. A case's ``torch.compile``
candidate is made with :func:`compiled`; its compile time is reported apart from its
steady-state ratio, and ``--no-compile`` (the default with ``--quick``) leaves it out.

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
import importlib
import sys

from mpnb.lab.bench._registry import load_suite, suites

# Public names and the private module that defines each; imported on first use (PEP 562), so
# that `mpnb bench --list` does not import torch.
_LAZY = {
    "READ": "_harness",
    "COPY": "_harness",
    "Enough": "_harness",
    "RMW": "_harness",
    "Candidate": "_harness",
    "Case": "_harness",
    "Options": "_harness",
    "Row": "_harness",
    "compiled": "_harness",
    "run_case": "_harness",
    "run_cases": "_harness",
    "iqr": "mpnb.lab.stats",
    "median": "mpnb.lab.stats",
    "per_round_ratios": "mpnb.lab.stats",
    "ratio_summary": "mpnb.lab.stats",
    "Result": "_suite",
    "run_suite": "_suite",
}

__all__ = [*_LAZY, "suites", "load_suite", "main"]


def __getattr__(name: str):
    if name in _LAZY:
        mod = _LAZY[name] if "." in _LAZY[name] else f"{__name__}.{_LAZY[name]}"
        value = getattr(importlib.import_module(mod), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mpnb bench", description="Benchmarks of mpnb's kernels against PyTorch's own."
    )
    p.add_argument("suite", nargs="?", help="the suite to run (see --list)")
    p.add_argument("--list", action="store_true", help="list the suites and exit")
    p.add_argument("--json", metavar="PATH", help="also write the header and rows to PATH")
    p.add_argument("--rounds", type=int, help="timed rounds per case (default 15; 5 with --quick)")
    p.add_argument(
        "--quick", action="store_true", help="a rough run in seconds (implies --no-compile)"
    )
    p.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="time each case's torch.compile candidate, its compile time (tens of seconds "
        "each on a CPU) reported apart; default: on, off with --quick",
    )
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
    p.add_argument(
        "--device",
        default="cpu",
        help="device for the suite's tensors; `--device cuda` alone runs the GPU suite `cuda`",
    )
    p.add_argument("--threads", type=int, help="torch threads for the run (default: unchanged)")
    return p


def main(argv: list[str] | None = None) -> int:
    """``mpnb bench <suite> [--json PATH] [--rounds N] [--quick] [--[no-]compile] [--filter S]``;
    ``--list``.

    ``mpnb bench --device cuda`` without a suite runs suite ``cuda``. Returns 2, with the
    reason on stderr, when the suite cannot run here (an unknown suite, a bad option, or a
    suite's ``unavailable(opts)``, such as the GPU suite on a machine without a GPU).
    Returns 1 when ``--json`` was not written: the write failed (the previous file is kept),
    or no case matched ``--filter`` (nothing measured: an earlier file there is not replaced).
    """
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    if not args.suite and not args.list and args.device.startswith("cuda"):
        args.suite = "cuda"  # `mpnb bench --device cuda`: the GPU kernels' suite
    if args.list or not args.suite:
        for name, doc in suites().items():
            print(f"{name:16} {doc}")
        return 0 if args.list else 2
    from mpnb.lab.bench._harness import Options
    from mpnb.lab.bench._report import write_json
    from mpnb.lab.bench._suite import run_suite

    try:  # bad input is reported before anything runs; a suite's own errors keep their traceback
        opts = Options.make(
            quick=args.quick,
            rounds=args.rounds,
            scale=args.scale,
            filter=args.filter,
            device=args.device,
            threads=args.threads,
            compile=args.compile,
        )
        module = load_suite(args.suite)
    except (KeyError, ValueError) as e:
        print(f"mpnb bench: {e.args[0] if e.args else e}", file=sys.stderr)
        return 2
    why = getattr(module, "unavailable", lambda opts: None)(opts) or _unusable(args, opts)
    if why:
        print(f"mpnb bench: {why}", file=sys.stderr)
        return 2
    result = run_suite(args.suite, opts, echo=True)
    if not result.rows:  # nothing measured: earlier results at --json stay as they were
        kept = f"; --json {args.json} was not written (a previous file there is kept)"
        print(
            f"mpnb bench: no case matched --filter {args.filter!r}{kept if args.json else ''}; "
            f"see the cases with `mpnb bench {args.suite} --quick`, then filter on one.",
            file=sys.stderr,
        )
        return 1 if args.json else 0
    if args.json:
        try:
            write_json(args.json, result.header, result.rows, result.summary)
        except OSError as e:
            print(f"mpnb bench: --json: {e.strerror or e}", file=sys.stderr)
            return 1
        print(f"# wrote {args.json}")
    return 0


def _unusable(args, opts) -> str | None:
    """Why the run could not finish (a GPU asked for where none is, an unwritable ``--json``),
    found before anything is timed."""
    import torch

    from mpnb.lab._files import unwritable_reason

    if opts.device.startswith("cuda") and not torch.cuda.is_available():
        return f"--device {opts.device} but no CUDA GPU is visible to torch here; use --device cpu."
    why = unwritable_reason(args.json, f"{args.suite}.json") if args.json else ""
    if why:
        return f"--json {args.json}: {why}."
    return None
