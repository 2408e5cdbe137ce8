"""``python -m mpnb.apex``: run, rehearse or check an unchanged Apex script on mpnb.

* ``python -m mpnb.apex SCRIPT [ARGS...]``: run ``SCRIPT`` as ``__main__`` with
  ``sys.argv = [SCRIPT, *ARGS]``, its directory first on ``sys.path``, and ``import apex``
  (``amp_C``, ``syncbn``, ...) resolved to mpnb by :func:`mpnb.compat.apex_alias`. Nothing of
  torch is touched.
* ``python -m mpnb.apex --cpu SCRIPT [ARGS...]``: the same, inside
  :class:`mpnb.compat.CpuRehearsal`: a CUDA-only script (``.cuda()``, ``device="cuda"``,
  ``torch.cuda.set_device``, ``nccl``) runs on the CPU and gloo, each replacement reported once
  on stderr and all of them undone on exit. Works under ``torchrun ... -m mpnb.apex --cpu``.
* Either way, a process group the script created and left open (Apex scripts never destroyed
  theirs) is torn down by :func:`mpnb.core.parallel.end_group` once the script returns.
* ``python -m mpnb.apex --check [--json] SCRIPT``: without running the script, list every Apex
  name it uses, whether mpnb provides, emulates or lacks it, and its ``torch.amp`` port
  (:func:`mpnb.compat.check_script`); exit code 1 when a name is lacking.
"""

from __future__ import annotations

import contextlib
import os
import runpy
import sys

import torch.distributed as dist

from mpnb.compat.alias import ApexAlias
from mpnb.compat.check import check_script, format_report, report_json
from mpnb.compat.rehearsal import CpuRehearsal
from mpnb.core.parallel.launch import end_group

__all__ = ["main", "run_script"]

_USAGE = """usage: python -m mpnb.apex [--cpu] SCRIPT [ARGS...]
       python -m mpnb.apex --check [--json] SCRIPT

Run an Apex script unchanged on mpnb (import apex -> mpnb).
  --cpu    rehearse a CUDA-only script on the CPU (.cuda() and device="cuda" stay on the CPU,
           torch.cuda calls are no-ops, nccl becomes gloo; all undone on exit)
  --check  list the Apex names SCRIPT uses, what mpnb does with each and the torch.amp port,
           without running it (--json: as JSON; exit code 1 when a name is lacking)"""


def run_script(script: str, args: list[str], cpu: bool = False, stream=None) -> dict:
    """Run ``script`` as ``__main__`` under the Apex alias (and the CPU rehearsal).

    ``sys.argv``, ``sys.path``, the alias and (with ``cpu``) every torch replacement are
    restored when the script returns or raises; its exception propagates.

    Args:
        script: the path of the script.
        args: its command-line arguments.
        cpu: run inside :class:`mpnb.compat.CpuRehearsal`.
        stream: where the rehearsal's reports go (default stderr).

    Returns:
        The script's global namespace after it ran.

    Example::

        >>> run_script("train.py", ["--opt-level", "O2"], cpu=True)["final_loss"]
    """
    old_argv, old_path = sys.argv, list(sys.path)
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    rehearsal = CpuRehearsal(stream) if cpu else contextlib.nullcontext()
    try:
        with ApexAlias(), rehearsal:
            return runpy.run_path(script, run_name="__main__")
    finally:
        sys.argv, sys.path[:] = old_argv, old_path


def _group_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def _fail(message: str) -> int:
    print(f"mpnb.apex: {message}\n{_USAGE}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    """The command line; returns the exit code (the script's own exceptions propagate).

    Example::

        $ python -m mpnb.apex --check train_imagenet.py
        $ torchrun --nproc_per_node=2 -m mpnb.apex --cpu train_imagenet.py --opt-level O1
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    opts: set[str] = set()
    while argv and argv[0].startswith("-"):
        opt = argv.pop(0)
        if opt in ("-h", "--help"):
            print(_USAGE)
            return 0
        if opt not in ("--cpu", "--check", "--json"):
            return _fail(f"unknown option {opt!r}; options go before SCRIPT.")
        opts.add(opt)
    if not argv:
        return _fail("no SCRIPT given.")
    if "--cpu" in opts and "--check" in opts:
        return _fail("--cpu runs the script and --check does not; pass one of them.")
    if "--json" in opts and "--check" not in opts:
        return _fail("--json formats the --check report; add --check.")
    script, args = argv[0], argv[1:]
    if not os.path.isfile(script):
        return _fail(f"no such script {script!r}.")
    if "--check" in opts:
        if args:
            return _fail("--check takes one SCRIPT and no script arguments.")
        report = check_script(script)
        print(report_json(report) if "--json" in opts else format_report(report))
        return 1 if report.count("lacks") else 0
    had_group = _group_initialized()
    run_script(script, args, cpu="--cpu" in opts)  # its namespace is dropped here
    if _group_initialized() and not had_group:
        # Apex scripts never destroyed their group; the runner does, before the interpreter
        # exits (left to exit, a rank can abort from gloo's threads: see end_group).
        end_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
