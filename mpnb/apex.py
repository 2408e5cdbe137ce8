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
  theirs) is torn down by :func:`mpnb.core.parallel.end_group` once the script returns; and a
  rank that a launcher started beside others on this machine (``LOCAL_WORLD_SIZE``, or
  ``WORLD_SIZE`` with a loopback ``MASTER_ADDR``) takes its share of the CPUs
  (:func:`mpnb.core.parallel.launch.share_cpus`) unless ``OMP_NUM_THREADS`` is set.
* ``python -m mpnb.apex --check [--json] SCRIPT``: without running the script or its local
  modules (which it reads too), list every Apex name they use, whether mpnb provides, emulates
  or lacks it, and its ``torch.amp`` port, and every write to Apex's private state
  (:func:`mpnb.compat.check_script`); exit code 1 when something is lacking, 2 when a file
  cannot be read as Python.
* ``--deprecated_fused_adam``: also serve ``fused_adam_cuda``, which only Apex builds made with
  that option have (a standard build lacks it, and code that probes for it falls back).
"""

from __future__ import annotations

import contextlib
import os
import runpy
import sys

import torch
import torch.distributed as dist

from mpnb.compat._scan import SourceError
from mpnb.compat.alias import ApexAlias
from mpnb.compat.check import check_script, format_report, report_json
from mpnb.compat.rehearsal import CpuRehearsal
from mpnb.core.parallel.launch import cpus_available, end_group, local_ranks, share_cpus

__all__ = ["main", "run_script"]

_DEPRECATED_ADAM = "--deprecated_fused_adam"

_USAGE = """usage: python -m mpnb.apex [--cpu] [--deprecated_fused_adam] SCRIPT [ARGS...]
       python -m mpnb.apex --check [--json] SCRIPT

Run an Apex script unchanged on mpnb (import apex -> mpnb).
  --cpu    rehearse a CUDA-only script on the CPU (.cuda() and device="cuda" stay on the CPU,
           torch.cuda calls are no-ops, nccl becomes gloo; all undone on exit)
  --deprecated_fused_adam
           also serve fused_adam_cuda, as an Apex built with that option does (a standard
           build has no such module)
  --check  list the Apex names SCRIPT and its local modules use, what mpnb does with each and
           the torch.amp port, and the writes to Apex internals, without running anything
           (--json: as JSON; exit code 1 when something is lacking)"""


def run_script(
    script: str,
    args: list[str],
    cpu: bool = False,
    stream=None,
    build_flags: frozenset[str] = frozenset(),
) -> dict:
    """Run ``script`` as ``__main__`` under the Apex alias (and the CPU rehearsal).

    ``sys.argv``, ``sys.path``, the alias and (with ``cpu``) every torch replacement are
    restored when the script returns or raises; its exception propagates.

    Args:
        script: the path of the script.
        args: its command-line arguments.
        cpu: run inside :class:`mpnb.compat.CpuRehearsal`.
        stream: where the rehearsal's reports go (default stderr).
        build_flags: Apex build options whose extension modules the alias serves too
            (``{"--deprecated_fused_adam"}``).

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
        with ApexAlias(build_flags), rehearsal:
            return runpy.run_path(script, run_name="__main__")
    finally:
        sys.argv, sys.path[:] = old_argv, old_path


def _share_cpus() -> None:
    # One of several ranks a launcher started on this machine (torchrun sets OMP_NUM_THREADS
    # itself; Apex's scripts were also started by hand or by torch.distributed.launch-era
    # tools): take this rank's share of the CPUs, saying so once.
    ranks = local_ranks()
    before = torch.get_num_threads()
    if ranks > 1 and share_cpus(ranks) < before:
        print(
            f"mpnb.apex: {ranks} ranks share this machine's {cpus_available()} CPUs: "
            f"{torch.get_num_threads()} torch thread(s) per rank (set OMP_NUM_THREADS to "
            "choose).",
            file=sys.stderr,
        )


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
        if opt not in ("--cpu", "--check", "--json", _DEPRECATED_ADAM):
            return _fail(f"unknown option {opt!r}; options go before SCRIPT.")
        opts.add(opt)
    if not argv:
        return _fail("no SCRIPT given.")
    if "--cpu" in opts and "--check" in opts:
        return _fail("--cpu runs the script and --check does not; pass one of them.")
    if "--json" in opts and "--check" not in opts:
        return _fail("--json formats the --check report; add --check.")
    if _DEPRECATED_ADAM in opts and "--check" in opts:
        return _fail(f"{_DEPRECATED_ADAM} changes what a run imports; --check runs nothing.")
    script, args = argv[0], argv[1:]
    if not os.path.isfile(script):
        return _fail(f"no such script {script!r}.")
    if "--check" in opts:
        if args:
            return _fail("--check takes one SCRIPT and no script arguments.")
        try:
            report = check_script(script)
        except (SyntaxError, SourceError) as e:  # a clear line, not a traceback
            msg = str(e)
            print(
                msg if msg.startswith("mpnb.apex") else f"mpnb.apex --check: {msg}", file=sys.stderr
            )
            return 2
        print(report_json(report) if "--json" in opts else format_report(report))
        return 1 if report.lacking() else 0
    _share_cpus()
    had_group = _group_initialized()
    flags = frozenset(opts & {_DEPRECATED_ADAM})
    run_script(script, args, cpu="--cpu" in opts, build_flags=flags)  # namespace dropped here
    if _group_initialized() and not had_group:
        # Apex scripts never destroyed their group; the runner does, before the interpreter
        # exits (left to exit, a rank can abort from gloo's threads: see end_group).
        end_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
