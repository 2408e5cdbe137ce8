"""The ``mpnb`` command: ``doctor``, ``build-ext``, ``bench``, ``compare``; ``--version``."""

from __future__ import annotations

import argparse
import sys

__all__ = ["main"]


def _cmd_doctor(args: argparse.Namespace) -> int:
    # on use: `import mpnb.cli` stays at ~5 ms, without torch, for `mpnb --help`
    from mpnb.core.doctor import report

    print(report(build=not args.no_build))
    return 0


def _cmd_build_ext(args: argparse.Namespace) -> int:
    # on use: `import mpnb.cli` stays at ~5 ms, without torch, for `mpnb --help`
    from mpnb.core.ops import cpu_extension

    ext = cpu_extension()
    if ext.disabled:
        print("mpnb: MPNB_DISABLE_EXT=1 is set; unset it to build the kernels.", file=sys.stderr)
        return 2
    result = ext.build(force=args.force, verbose=args.verbose)
    if not result.loaded and not (args.force and result.built):
        print(f"mpnb: build failed: {result.reason}", file=sys.stderr)
        return 1
    if result.built:
        print(
            f"mpnb: CPU kernels built in {result.seconds:.1f} s ({result.compiled} build steps): "
            f"{result.path}"
        )
    else:
        print(f"mpnb: CPU kernels up to date (nothing compiled), loaded from {result.path}")
    if result.note:
        print(f"mpnb: note: {result.note}")
    return 0


def _cmd_bench(args: argparse.Namespace, rest: list[str]) -> int:
    # on use: `import mpnb.cli` stays at ~5 ms, without torch, for `mpnb --help`
    from mpnb.lab.bench import main as bench_main

    return bench_main(rest)


class _Version(argparse.Action):
    """``--version``: one unwrapped line, the version and where this mpnb is imported from."""

    def __init__(self, option_strings, dest, **kwargs):
        kwargs.update(nargs=0, help="print mpnb's version and where it is installed, and exit")
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        # on use: `import mpnb.cli` stays at ~5 ms, without torch, for `mpnb --help`
        from pathlib import Path

        # on use: `import mpnb.cli` stays at ~5 ms, without torch, for `mpnb --help`
        import mpnb

        print(f"mpnb {mpnb.__version__} ({Path(mpnb.__file__).resolve().parent})")
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``mpnb`` command."""
    p = argparse.ArgumentParser(prog="mpnb", description="Mixed precision on the hardware at hand.")
    p.add_argument("--version", action=_Version)
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("doctor", help="what this machine supports and which path each op takes")
    d.add_argument("--no-build", action="store_true", help="report without building the kernels")
    d.set_defaults(func=_cmd_doctor)
    b = sub.add_parser(
        "build-ext", help="build the C++ kernels now (they build on first use otherwise)"
    )
    b.add_argument("--force", action="store_true", help="rebuild from scratch")
    b.add_argument("--verbose", action="store_true", help="show the compiler's output")
    b.set_defaults(func=_cmd_build_ext)
    sub.add_parser("bench", help="benchmarks vs PyTorch: `mpnb bench --help`", add_help=False)
    # on use: `import mpnb.cli` stays at ~5 ms, without torch, for `mpnb --help`
    from mpnb.lab.cli import add_parser as add_compare

    add_compare(sub)  # the lab's main command (its own module: mpnb/lab/cli.py)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the ``mpnb`` command with ``argv`` (default: ``sys.argv[1:]``); returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":
        return _cmd_bench(argparse.Namespace(), argv[1:])
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
