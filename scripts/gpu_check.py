"""The whole kit on one CUDA GPU, prepared: ``bash scripts/gpu-check.sh [--dry-run] [OUT]``.

Runs, with no network and in at most 8 minutes on one H100/H200, each step under its own time
budget (a step past it is stopped, with its process group); a failing step is recorded and the
check goes on:

1. ``mpnb build-ext`` and ``mpnb doctor`` (the CPU kernels; the CUDA dtypes, measured);
2. the ``gpu``-marked tests, and every Triton kernel against its reference on CUDA in
   fp32/fp16/bf16 (``tests/core/ops/triton``, compiled, not interpreted);
3. ``mpnb bench --device cuda``: every Triton kernel vs PyTorch's CUDA path at the GPT's sizes
   and at 256 MiB, each ratio with its 95% interval (rounds until it is within 2%, at most 40
   or 1 s per case: 40-50 s expected on an H100, an estimate), beside the same-run copy
   bandwidth; the ratios and intervals are pooled into ``mpnb/core/ops/triton/measured.json``
   (each case's worst run over the runs of the same card, torch, triton and kernel source),
   the table that decides which kernels are on by default (the lower end of every case at
   least 1.0). A ``--quick`` run's JSON is never recorded;
4. host reads and CUDA synchronizations per step, counted by PyTorch itself
   (``torch.cuda.set_sync_debug_mode``) beside mpnb's counter, for mpnb O1/O2 and torch.amp
   (``python -m mpnb.lab.sync_count``);
5. the GPU-sized workload (``--size auto``: :mod:`mpnb.lab.gpu_sizing`) under O0-O3 in fp16 and
   bf16, the peers (torch-amp, tf32, torch-amp+compile) and O2 with its step captured in a CUDA
   graph (``O2+graph``), with each row's GPU busy, host syncs and the estimate from its counts;
6. the FP8 recipes against bf16, Linear size by Linear size (``mpnb bench fp8``);
7. the ``medium`` workload on CUDA and on the CPU: the speed a CPU run's verdict estimates for
   this card beside the speed measured on it;
8. with the time the steps above left (at least a minute), notebooks 01, 03 and 09 under nbval.

It prints a summary (``scripts/gpu_check_summary.py``: the targets O2 bf16 >= 1.5x O0 and
>= 0.97x torch-amp, an estimate within 1.5x on every row) and writes it to
``docs/gpu/<date>-<card>-<rev>.md`` (two runs of a day on one card keep both); the logs, the
JSON of each run and a copy of the summary go to ``OUT`` (default ``$OUT``, else a new temporary
directory). ``--dry-run`` (on any machine) lists the steps with their budgets and checks that
every command exists and parses: the CLI arguments through mpnb's own parsers, the pytest
steps by collecting them, the notebooks by their files.
"""

from __future__ import annotations

import datetime as _dt
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_check_summary  # noqa: E402 - beside this script, found through the line above

LIMIT_S = 480  #: the whole check, on one H100/H200
SPARE_MIN_S = 60  #: a step that takes the time left runs only with at least this much
NOTEBOOKS = ("01_quick_start.ipynb", "03_opt_levels.ipynb", "09_low_precision_frontier.ipynb")
HALF = "O0,O1,O2,O3"
PEERS = "torch-amp,tf32,torch-amp+compile"
_PYTEST = ("-m", "pytest", "-q", "-p", "no:cacheprovider")
# The Triton tests compile ~300 kernels, on the CPU: 121 s in one process on an H100 machine
# (16 cores, 2026-11-27), past their budget; six workers where pytest-xdist is installed.
_XDIST = ("-n", "6") if importlib.util.find_spec("xdist") else ()
# The notebooks took past their 80 s budget in one process there (2026-11-27, 19 of 23 cells):
# one worker per notebook (each notebook's cells in order on its own kernel).
_XDIST_NB = ("-n", str(len(NOTEBOOKS)), "--dist", "loadfile") if _XDIST else ()
#: the bench of every Triton kernel, an estimate for an H100 (no GPU has run it yet): ~17 s of
#: rounds (40 cases; the rounds rule bounds them to 40 s), ~15-25 s of Triton compiles and
#: autotuning (three configs per layer kernel, one row width: those the kernel tests did not
#: leave in Triton's cache) and ~6 s of start, so 40-50 s. Stopped at its budget, it keeps
#: (and the check records) the cases it finished.
BENCH_S = 65
_HOST_COST_JSON = "{out}/bench-host-cost.json"
_GPU_WORKLOAD_FLAGS = ("--dtype", "fp16,bf16", "--compile-budget", "60", "--out", "{out}/gpu.html")


@dataclass(frozen=True)
class Step:
    """One command of the check. ``argv`` may hold ``{out}`` (the output directory);
    ``stdout`` names a file under it that receives the command's stdout (a JSON run);
    ``spare``: the step's budget is the time the others left (skipped below
    :data:`SPARE_MIN_S`), and it is not part of :data:`LIMIT_S`'s sum."""

    name: str
    budget_s: int
    argv: tuple[str, ...]
    what: str
    stdout: str = ""
    spare: bool = False


@dataclass
class Result:
    """What a step did: ``status`` is ``"pass"``, ``"FAIL (exit N)"``, ``"TIMEOUT"`` or
    ``"skipped (...)"``."""

    step: Step
    status: str
    seconds: float
    log: Path
    tail: list[str] = field(default_factory=list)


def _mpnb(*args: str) -> tuple[str, ...]:
    return (sys.executable, "-m", "mpnb.cli", *args)


def _compare(device: str, size: str, configs: str, steps: int, extra: tuple = ()) -> tuple:
    flags = f"--workload transformer --size {size} --configs {configs} --steps {steps}"
    return _mpnb("compare", "--device", device, *flags.split(), "--json", "--no-progress", *extra)


def steps() -> list[Step]:
    """The check, in order; the fixed budgets add up to at most :data:`LIMIT_S`."""
    nb = tuple(f"notebooks/{n}" for n in NOTEBOOKS)
    gpu_configs = f"{HALF},{PEERS},O2+graph"
    medium = "O0,O1,O2,O3,torch-amp"
    return [
        Step("build-ext", 50, _mpnb("build-ext"), "the CPU kernels build and load"),
        Step("doctor", 15, _mpnb("doctor"), "hardware, dtypes measured on CUDA, op paths"),
        Step("gpu tests", 30, (sys.executable, *_PYTEST, "-m", "gpu", "tests"), "gpu-marked tests"),
        Step(
            "triton vs reference",
            75,
            (sys.executable, *_PYTEST, *_XDIST, "tests/core/ops/triton"),
            "every Triton kernel against its reference on CUDA, fp32/fp16/bf16",
        ),
        Step(
            "bench cuda",
            BENCH_S,
            _mpnb("bench", "--device", "cuda", "--json", "{out}/bench-cuda.json"),
            "every Triton kernel vs PyTorch's CUDA path: 95% intervals, % of copy bandwidth",
        ),
        Step(
            "bench host-cost",
            10,
            _mpnb(*"bench host-cost --device cuda --quick --json".split(), _HOST_COST_JSON),
            "the list launchers' host cost (chunk table cached) vs torch's foreach/fused",
        ),
        Step(
            "syncs",
            20,
            (sys.executable, "-m", "mpnb.lab.sync_count", "--device", "cuda", "--json"),
            "host reads and CUDA syncs per step: mpnb O1/O2 and torch.amp",
            "syncs.json",
        ),
        Step(
            "compare gpu workload",
            150,
            _compare("cuda", "auto", gpu_configs, 30, _GPU_WORKLOAD_FLAGS),
            "the GPU-sized workload: O0-O3, peers, O2+graph; busy, syncs, estimate",
            "compare-gpu.json",
        ),
        Step(
            "bench fp8",
            20,
            _mpnb("bench", "fp8", "--device", "cuda", "--quick", "--json", "{out}/bench-fp8.json"),
            "FP8 recipes vs bf16 by Linear size: where FP8 pays",
        ),
        Step(
            "compare medium cuda",
            25,
            _compare("cuda", "medium", medium, 20, ("--dtype", "bf16", "--out", "")),
            "the medium workload on this GPU, for the CPU's estimate",
            "compare-medium-cuda.json",
        ),
        Step(
            "estimate: cpu medium",
            20,
            _compare("cpu", "medium", medium, 2, ("--dtype", "bf16", "--out", "")),
            "the same workload on the CPU: its verdict's estimate for this card",
            "compare-cpu-medium.json",
        ),
        Step(
            "notebooks",
            0,
            (
                sys.executable,
                *_PYTEST,
                *_XDIST_NB,
                "--nbval-lax",
                "--nbval-current-env",
                "--nbval-sanitize-with",
                "notebooks/sanitize.cfg",
                *nb,
            ),
            "notebooks 01, 03, 09 under nbval on CUDA (in the time left)",
            spare=True,
        ),
    ]


def _argv(step: Step, out: Path) -> list[str]:
    return [a.replace("{out}", str(out)) for a in step.argv]


def _env() -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", PIP_NO_INDEX="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def run_step(step: Step, out: Path, budget_s: float | None = None) -> Result:
    """Run ``step`` under its budget (``budget_s`` when given: a spare step's time left); on
    overrun stop its whole process group."""
    log = out / f"{re.sub(r'[^a-z0-9]+', '-', step.name.lower()).strip('-')}.log"
    budget = step.budget_s if budget_s is None else budget_s
    start = time.monotonic()
    with open(log, "w") as err:
        sink = open(out / step.stdout, "w") if step.stdout else err  # noqa: SIM115
        try:
            proc = subprocess.Popen(
                _argv(step, out),
                cwd=ROOT,
                env=_env(),
                stdout=sink,
                stderr=err,
                start_new_session=True,
            )
            try:
                rc = proc.wait(timeout=budget)
                status = "pass" if rc == 0 else f"FAIL (exit {rc})"
            except subprocess.TimeoutExpired:
                _stop(proc)
                status = "TIMEOUT"
        finally:
            if sink is not err:
                sink.close()
    seconds = time.monotonic() - start
    tail = log.read_text(errors="replace").strip().splitlines()[-3:]
    return Result(step, status, seconds, log, tail)


def _stop(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


# ---- the dry run ------------------------------------------------------------------------------


def check_step(step: Step, out: Path) -> str:
    """Empty when ``step``'s command exists and parses here, else what is wrong."""
    argv = _argv(step, out)
    if argv[1:3] == ["-m", "mpnb.cli"]:
        return _check_mpnb(argv[3:])
    if argv[1:3] == ["-m", "mpnb.lab.sync_count"]:
        return _check_sync_count(argv[3:])
    if argv[1:3] == ["-m", "pytest"]:
        missing = [
            a for a in argv if a.startswith(("notebooks/", "tests")) and not (ROOT / a).exists()
        ]
        if missing:
            return f"missing: {', '.join(missing)}"
        return _collect(argv)
    return f"unknown command {argv[:3]}"


def _check_mpnb(args: list[str]) -> str:
    try:
        if args[0] == "bench":
            from mpnb.lab.bench import _parser, load_suite

            load_suite(_parser().parse_args(args[1:]).suite or "cuda")
        else:
            from mpnb.cli import build_parser

            parsed = build_parser().parse_args(args)
            if args[0] == "compare":
                from mpnb.lab.config import expand

                expand(
                    parsed.workload, parsed.configs, parsed.dtype, (32,), parsed.steps, device="cpu"
                )
    except SystemExit as e:
        return f"the arguments do not parse (exit {e.code})"
    except Exception as e:  # noqa: BLE001 - the dry run reports it, whatever it is
        return f"{type(e).__name__}: {e}"
    return ""


def _check_sync_count(args: list[str]) -> str:
    from mpnb.lab import sync_count

    try:
        sync_count.parser().parse_args(args)
    except SystemExit as e:
        return f"the arguments do not parse (exit {e.code})"
    return ""


def _collect(argv: list[str]) -> str:
    cmd = [*argv, "--collect-only"]
    got = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    ids = [ln for ln in got.stdout.splitlines() if "::" in ln]
    if got.returncode != 0 or not ids:
        tail = (got.stdout + got.stderr).strip().splitlines()[-3:]
        return f"pytest collected nothing (exit {got.returncode}): {' | '.join(tail)}"
    return ""


def dry_run(out: Path) -> int:
    """List the steps with their budgets and check each command; 0 when all are ready."""
    total, bad = 0, 0
    print(f"gpu-check --dry-run: {len(steps())} steps, at most {LIMIT_S} s on one H100/H200")
    for i, step in enumerate(steps(), 1):
        problem = check_step(step, out)
        total += step.budget_s
        bad += bool(problem)
        shown = " ".join(_argv(step, out)[1:]).replace(" -p no:cacheprovider", "")
        budget = "left" if step.spare else f"{step.budget_s:>4} s"
        print(
            f"{i:2}. {step.name:<22} {budget:>6}  {'ok' if not problem else 'FAIL'}"
            f"  {step.what}\n      $ python {shown}"
        )
        if problem:
            print(f"      problem: {problem}")
    print(f"total budget: {total} s of {LIMIT_S} s; {bad} step(s) not ready")
    return 1 if bad or total > LIMIT_S else 0


# ---- the summary (scripts/gpu_check_summary.py) ----------------------------------------------

estimate_vs_measured = gpu_check_summary.estimate_vs_measured


def summary(results: list[Result], out: Path, card: str, about: str, triton: dict) -> str:
    """The summary as Markdown (:func:`gpu_check_summary.summary`)."""
    return gpu_check_summary.summary(results, out, card, about, triton, LIMIT_S)


def _card_and_about() -> tuple[str, str, str]:
    import torch

    import mpnb

    card = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    try:
        import triton

        tv = triton.__version__
    except ImportError:
        tv = "not installed"
    rev = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    about = (
        f"{_dt.date.today()}: mpnb {mpnb.__version__} ({rev or 'no git'}), torch "
        f"{torch.__version__} (CUDA {torch.version.cuda}), triton {tv}. {_block_scaled_line()}"
    )
    return card, about, rev


def _block_scaled_line() -> str:
    """Whether MXFP8 / MXFP4 / NVFP4 GEMMs go native on GPU 0 (on sm100+ this runs their
    first-use checks: one small GEMM each)."""
    from mpnb.core.fp8.blocked import NATIVE_MIN_CAPABILITY
    from mpnb.core.fp8.gemm import block_scaled_status, device_capability

    cap = device_capability("cuda:0")
    if cap is None or cap < NATIVE_MIN_CAPABILITY:
        return "Not sm100: native block-scaled GEMMs (MXFP8, MXFP4, NVFP4) not available here."
    got = ", ".join(f"{f} {block_scaled_status('cuda:0', f)}" for f in ("mxfp8", "mxfp4", "nvfp4"))
    return f"Block-scaled GEMMs after mpnb's first-use check: {got}."


def _record_triton(out: Path, card: str) -> dict:
    """The committed table with this run's bench pooled in (:func:`record`), written to the
    package and to ``out``."""
    import torch

    from mpnb.core.ops.triton import LAUNCHERS
    from mpnb.core.ops.triton._decision import kernel_source, load_table, record, write_table

    bench = out / "bench-cuda.json"
    doc = json.loads(bench.read_text()) if bench.is_file() else {}
    if not doc or doc.get("header", {}).get("quick"):  # one measurement per case decides nothing
        return load_table()
    about = dict(source="mpnb bench --device cuda", torch=torch.__version__)
    try:
        import triton

        about["triton"] = triton.__version__
    except ImportError:
        pass
    table = record(
        doc["rows"],
        card,
        str(_dt.date.today()),
        previous=load_table(),
        sources={op: kernel_source(where.split(":")[0]) for op, where in LAUNCHERS.items()},
        **about,
    )
    write_table(table)
    write_table(table, out / "measured.json")
    return table


def check(out: Path) -> int:
    """Run every step, then write the summary; 0 when every step passed."""
    import torch

    if not torch.cuda.is_available():
        print(
            "gpu-check: no CUDA GPU is visible to torch here; run it on a machine with one "
            "(`bash scripts/gpu-check.sh --dry-run` checks the commands on any machine).",
            file=sys.stderr,
        )
        return 2
    results, start = [], time.monotonic()
    for step in steps():
        left = LIMIT_S - (time.monotonic() - start)
        if step.spare and left < SPARE_MIN_S:
            log = out / f"{step.name}.log"
            log.write_text(f"skipped: {left:.0f} s left of {LIMIT_S} s\n")
            r = Result(step, f"skipped ({left:.0f} s left)", 0.0, log)
        else:
            r = run_step(step, out, left if step.spare else None)
        results.append(r)
        print(
            f"gpu-check: {step.name}: {r.status} in {r.seconds:.0f} s (budget {step.budget_s} s)",
            flush=True,
        )
    card, about, rev = _card_and_about()
    text = summary(results, out, card, about, _record_triton(out, card))
    slug = re.sub(r"[^a-z0-9]+", "-", card.lower()).strip("-")
    name = "-".join(filter(None, [str(_dt.date.today()), slug, rev]))
    doc = ROOT / "docs" / "gpu" / f"{name}.md"
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(text)
    (out / doc.name).write_text(text)
    print(text)
    print(f"gpu-check: wrote {doc} and the logs in {out}")
    return 0 if all(r.status in ("pass", "skipped") or r.step.spare for r in results) else 1


def main(argv: list[str]) -> int:
    """``gpu_check.py [--dry-run] [OUT]``."""
    dry = "--dry-run" in argv
    rest = [a for a in argv if a != "--dry-run"]
    out = Path(rest[0] if rest else os.environ.get("OUT") or tempfile.mkdtemp(prefix="gpu-"))
    out = out / "gpu-check"
    out.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(ROOT))
    return dry_run(out) if dry else check(out)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
