"""``python -m mpnb.apex SCRIPT [ARGS...]``: run an unchanged Apex script on mpnb.

The script runs as ``__main__`` (``runpy.run_path``) with ``sys.argv = [SCRIPT, *ARGS]``, its
directory first on ``sys.path``, and ``import apex`` resolved to ``mpnb`` by
:func:`mpnb.compat.apex_alias`.
"""

from __future__ import annotations

import os
import runpy
import sys

from mpnb.compat import ApexAlias

__all__ = ["main"]

_USAGE = "usage: python -m mpnb.apex SCRIPT [ARGS...]  (runs an Apex script on mpnb)"


def main(argv: list[str] | None = None) -> int:
    """Run ``argv[0]`` with the Apex alias; returns the exit code.

    Example::

        $ python -m mpnb.apex train_imagenet.py --opt-level O2
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_USAGE, file=sys.stderr if not argv else sys.stdout)
        return 2 if not argv else 0
    script = argv[0]
    if not os.path.isfile(script):
        print(f"mpnb.apex: no such script {script!r}.\n{_USAGE}", file=sys.stderr)
        return 2
    old_argv, old_path = sys.argv, list(sys.path)
    sys.argv = argv
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        with ApexAlias():
            runpy.run_path(script, run_name="__main__")
    finally:
        sys.argv, sys.path[:] = old_argv, old_path
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
