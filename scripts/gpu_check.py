"""The whole kit on one CUDA GPU, prepared: ``bash scripts/gpu-check.sh [--dry-run] [OUT]``.

Runs, with no network and in at most 8 minutes on one H100/H200, each step under its own time
budget (a step past it is stopped, with its process group); a failing step is recorded and the
check goes on:

1. ``mpnb build-ext`` and ``mpnb doctor`` (the CPU kernels; the CUDA dtypes, measured);
2. the ``gpu``-marked tests, and every Triton kernel against its reference on CUDA in
   fp32/fp16/bf16 (``tests/core/ops/triton_kernels``, compiled, not interpreted);
3. ``mpnb bench --device cuda --quick``: the Triton kernels vs PyTorch's fused CUDA ops, with
   the same-run bandwidth; its ratios are pooled into ``mpnb/core/ops/triton/measured.json``
   (each case's worst over the runs of the same card, torch, triton and kernel source), the
   table that decides which kernels are on by default;
4. ``mpnb compare --device cuda`` over O0-O3 in fp16 and bf16 and the four FP8 recipes, and
   the same workload on the CPU, whose verdict's GPU estimate for this card is set beside the
   speed measured on it (the error of our own estimate, per configuration);
5. notebooks 01, 03 and 09 under nbval on CUDA.

It prints a summary table and writes it to ``docs/gpu/<date>-<card>-<rev>.md`` (two runs of a
day on one card keep both); the logs, the JSON
of each run and a copy of the summary go to ``OUT`` (default ``$OUT``, else a new temporary
directory). ``--dry-run`` (on any machine) lists the steps with their budgets and checks that
every command exists and parses: the CLI arguments through mpnb's own parsers, the pytest
steps by collecting them, the notebooks by their files.
"""

from __future__ import annotations

import datetime as _dt
import importlib.util
import json
import math
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
LIMIT_S = 480  #: the whole check, on one H100/H200
NOTEBOOKS = ("01_quick_start.ipynb", "03_opt_levels.ipynb", "09_low_precision_frontier.ipynb")
HALF = "O0,O1,O2,O3"
FP8 = "fp8-tensorwise,fp8-delayed,fp8-rowwise,mxfp8"
_PYTEST = ("-m", "pytest", "-q", "-p", "no:cacheprovider")
# The Triton tests compile ~300 kernels, on the CPU: 121 s in one process on an H100 machine
# (16 cores, 2026-11-27), past their budget; six workers where pytest-xdist is installed.
_XDIST = ("-n", "6") if importlib.util.find_spec("xdist") else ()
# The notebooks took past their 80 s budget in one process there (2026-11-27, 19 of 23 cells):
# one worker per notebook (each notebook's cells in order on its own kernel).
_XDIST_NB = ("-n", str(len(NOTEBOOKS)), "--dist", "loadfile") if _XDIST else ()


@dataclass(frozen=True)
class Step:
    """One command of the check. ``argv`` may hold ``{out}`` (the output directory);
    ``stdout`` names a file under it that receives the command's stdout (a JSON run)."""

    name: str
    budget_s: int
    argv: tuple[str, ...]
    what: str
    stdout: str = ""


@dataclass
class Result:
    """What a step did: ``status`` is ``"pass"``, ``"FAIL (exit N)"`` or ``"TIMEOUT"``."""

    step: Step
    status: str
    seconds: float
    log: Path
    tail: list[str] = field(default_factory=list)


def _mpnb(*args: str) -> tuple[str, ...]:
    return (sys.executable, "-m", "mpnb.cli", *args)


def _compare(device: str, levels: str, steps: int, extra: tuple[str, ...] = ()) -> tuple:
    flags = f"--workload transformer --size medium --configs {levels} --steps {steps}"
    return _mpnb("compare", "--device", device, *flags.split(), "--json", "--no-progress", *extra)


def steps() -> list[Step]:
    """The check, in order; the budgets add up to at most :data:`LIMIT_S`."""
    both = ("--dtype", "fp16,bf16")
    nb = tuple(f"notebooks/{n}" for n in NOTEBOOKS)
    return [
        Step("build-ext", 60, _mpnb("build-ext"), "the CPU kernels build and load"),
        Step("doctor", 20, _mpnb("doctor"), "hardware, dtypes measured on CUDA, op paths"),
        Step(
            "gpu tests",
            35,
            (sys.executable, *_PYTEST, "-m", "gpu", "tests"),
            "every gpu-marked test",
        ),
        Step(
            "triton vs reference",
            100,
            (sys.executable, *_PYTEST, *_XDIST, "tests/core/ops/triton_kernels"),
            "every Triton kernel against its reference on CUDA, fp32/fp16/bf16",
        ),
        Step(
            "bench cuda",
            20,
            _mpnb("bench", "--device", "cuda", "--quick", "--json", "{out}/bench-cuda.json"),
            "Triton vs PyTorch's fused CUDA ops, same-run bandwidth",
        ),
        Step(
            "compare cuda",
            50,
            _compare("cuda", f"{HALF},{FP8}", 20, (*both, "--out", "{out}/compare-cuda.html")),
            "O0-O3 fp16/bf16 and the FP8 recipes, measured on this GPU",
            "compare-cuda.json",
        ),
        Step(
            "estimate: cpu bf16",
            25,
            _compare("cpu", HALF, 2, ("--dtype", "bf16", "--out", "")),
            "the same workload on the CPU (bf16, its default): the verdict's estimate",
            "compare-cpu-half.json",
        ),
        Step(
            "estimate: cpu fp8",
            45,
            _compare("cpu", f"O0,{FP8}", 2, ("--out", "")),
            "the same for the FP8 recipes",
            "compare-cpu-fp8.json",
        ),
        Step(
            "notebooks",
            105,
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
            "notebooks 01, 03, 09 under nbval on CUDA",
        ),
    ]


def _argv(step: Step, out: Path) -> list[str]:
    return [a.replace("{out}", str(out)) for a in step.argv]


def _env() -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", PIP_NO_INDEX="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def run_step(step: Step, out: Path) -> Result:
    """Run ``step`` under its budget; on overrun stop its whole process group."""
    log = out / f"{re.sub(r'[^a-z0-9]+', '-', step.name.lower()).strip('-')}.log"
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
                rc = proc.wait(timeout=step.budget_s)
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
        print(
            f"{i:2}. {step.name:<22} {step.budget_s:>4} s  {'ok' if not problem else 'FAIL'}"
            f"  {step.what}\n      $ python {shown}"
        )
        if problem:
            print(f"      problem: {problem}")
    print(f"total budget: {total} s of {LIMIT_S} s; {bad} step(s) not ready")
    return 1 if bad or total > LIMIT_S else 0


# ---- the summary ------------------------------------------------------------------------------


def _rows(path: Path) -> list[dict]:
    try:
        return json.loads(path.read_text())["rows"]
    except (OSError, ValueError, KeyError):
        return []


def estimate_vs_measured(cuda_rows: list[dict], cpu_runs: list[list[dict]], card: str):
    """Per configuration: the speed vs O0 measured on ``card`` and the one a CPU run's verdict
    estimates for it (:func:`mpnb.lab.verdict.estimate_for_card`), and their ratio."""
    import pandas as pd

    from mpnb.lab.verdict import estimate_for_card

    est = {}
    for rows in cpu_runs:
        if rows:
            for _, e in estimate_for_card(pd.DataFrame(rows), card).iterrows():
                est.setdefault(e["configuration"], e)
    out = []
    for r in cuda_rows:
        e = est.get(r["configuration"], est.get(_bf16_twin(r["configuration"], card)))
        measured = r.get("speedup_vs_O0")
        guess = float(e["est_speedup_vs_O0"]) if e is not None else math.nan
        ok = measured is not None and math.isfinite(measured) and math.isfinite(guess)
        out.append(
            dict(
                configuration=r["configuration"],
                precision=r.get("precision", ""),
                measured=measured,
                estimated=guess,
                error=measured / guess if ok and guess > 0 else math.nan,
                bound=e["bound"] if e is not None else "",
            )
        )
    return out


def _bf16_twin(configuration: str, card: str) -> str:
    """The CPU runs in bf16 (a CPU's default, what its verdict estimates from): an fp16
    configuration takes its bf16 twin's estimate where the card's fp16 and bf16 peaks are
    equal (then the roofline is the same: same FLOPs, bytes and, but for the loss scaler's
    one op, ops)."""
    from mpnb.lab.verdict import CARD_NAMES, GPU_PEAKS

    key = next((k for pattern, k in CARD_NAMES if re.search(pattern, card)), None)
    same = key is not None and GPU_PEAKS[key]["fp16"] == GPU_PEAKS[key]["bf16"]
    return configuration.replace(" fp16 ", " bf16 ") if same else ""


def _f(v, fmt="{:.2f}") -> str:
    return fmt.format(v) if isinstance(v, (int, float)) and math.isfinite(v) else "-"


def summary(results: list[Result], out: Path, card: str, about: str, triton: dict) -> str:
    """The summary as Markdown: the steps, the Triton decisions, estimate vs measured."""
    total = sum(r.seconds for r in results)
    lines = [
        f"# GPU check: {card}",
        "",
        about,
        f"Total {total:.0f} s (limit {LIMIT_S} s).",
        "",
        "| step | budget s | took s | result | checks |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        note = f" (`{r.log.name}`: {r.tail[-1][:120]})" if r.status != "pass" and r.tail else ""
        lines.append(
            f"| {r.step.name} | {r.step.budget_s} | {r.seconds:.0f} | {r.status}{note} "
            f"| {r.step.what} |"
        )
    lines += [
        "",
        "## Triton kernels vs PyTorch's CUDA path (`mpnb bench --device cuda --quick`)",
        "",
        "| kernel | worst case: PyTorch time / Triton time | runs pooled | decision |",
        "|---|---|---|---|",
    ]
    from mpnb.core.ops.triton import LAUNCHERS
    from mpnb.core.ops.triton._decision import decide

    for name in LAUNCHERS:
        d = decide(name, triton)
        runs = triton.get("kernels", {}).get(name, {}).get("runs", "-")
        lines.append(f"| {name} | {_f(d.speed_vs_torch)} | {runs} | {d.label.split(':')[0]} |")
    rows = estimate_vs_measured(
        _rows(out / "compare-cuda.json"),
        [_rows(out / "compare-cpu-half.json"), _rows(out / "compare-cpu-fp8.json")],
        card,
    )
    lines += [
        "",
        f"## Speed vs O0: measured on {card}, and estimated by a CPU run's verdict",
        "",
        "| configuration | precision | measured | estimated | measured / estimated | "
        "estimate's bound |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        off = (
            " (off by more than 1.5x)"
            if math.isfinite(r["error"]) and not (1 / 1.5 <= r["error"] <= 1.5)
            else ""
        )
        lines.append(
            f"| {r['configuration']} | {r['precision']} | {_f(r['measured'])} | "
            f"{_f(r['estimated'])} | {_f(r['error'])}{off} | {r['bound']} |"
        )
    if not rows:
        lines.append("| (no CUDA compare rows: see the compare step) | | | | | |")
    return "\n".join(lines) + "\n"


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
        f"{torch.__version__} (CUDA {torch.version.cuda}), triton {tv}."
    )
    return card, about, rev


def _record_triton(out: Path, card: str) -> dict:
    """The committed table with this run's bench pooled in (:func:`record`), written to the
    package and to ``out``."""
    import torch

    from mpnb.core.ops.triton import LAUNCHERS
    from mpnb.core.ops.triton._decision import kernel_source, load_table, record, write_table

    bench = out / "bench-cuda.json"
    if not bench.is_file():
        return load_table()
    about = dict(source="mpnb bench --device cuda --quick", torch=torch.__version__)
    try:
        import triton

        about["triton"] = triton.__version__
    except ImportError:
        pass
    table = record(
        json.loads(bench.read_text())["rows"],
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
    results = []
    for step in steps():
        r = run_step(step, out)
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
    return 0 if all(r.status == "pass" for r in results) else 1


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
