"""The distributed comparison's command line (``mpnb.lab.distributed._cli``): every flag used or
refused before anything starts, under torchrun or launching its ranks, and Ctrl-C/SIGTERM."""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from mpnb.cli import main
from mpnb.core.parallel.launch import cpus_available
from mpnb.lab import workloads
from mpnb.lab.distributed.__main__ import main as dist_main


def _code(run, argv) -> int:
    """The exit code of ``run(argv)``, argparse's usage errors (SystemExit) included."""
    try:
        return run(argv)
    except SystemExit as e:
        return e.code


_RUN = ["--workload", "mlp", "--size", "small", "--steps", "4"]


@pytest.mark.parametrize(
    "args, says",
    [
        (["--ranks", "0"], "--ranks"),
        (["--ranks", "-1"], "--ranks"),
        (["--ranks", "2", "--timeout", "0"], "--timeout"),
        (["--ranks", "2", "--timeout", "-5"], "--timeout"),
        (["--ranks", "2", "--timeout", "nan"], "--timeout"),
        (["--ranks", "2", "--dtype", "fp16"], "--dtype"),
        (["--ranks", "2", "--isolate"], "--isolate"),
        (["--ranks", "2", "--out", "rows.html"], ".csv or .json"),
        (["--ranks", str(cpus_available() + 1)], "CPU"),
    ],
    ids=[
        "ranks0",
        "ranks-1",
        "timeout0",
        "timeout-5",
        "timeout-nan",
        "dtype",
        "isolate",
        "html",
        "oversubscribed",
    ],
)
def test_compare_refuses_what_the_distributed_run_would_drop(args, says, capsys):
    """--ranks 0/-1 ran the one-process comparison; --timeout 0/-5/nan said 'no rank had
    started' or failed after the run; --dtype, --isolate and --out were dropped silently;
    --ranks 64 on 2 CPUs started 65 processes."""
    t0 = time.monotonic()
    assert _code(main, ["compare", *_RUN, *args]) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err
    assert time.monotonic() - t0 < 10  # refused up front: nothing was trained


def test_compare_refuses_an_unwritable_out_with_ranks(tmp_path, capsys):
    """--out was neither checked nor written with --ranks."""
    (tmp_path / "a_file").write_text("x")
    for bad, says in [
        (tmp_path, "is a directory"),
        (tmp_path / "a_file" / "rows.json", "is a file, so"),
        (tmp_path / "missing" / "rows.json", "create it first"),
    ]:
        assert _code(main, ["compare", *_RUN, "--ranks", "2", "--out", str(bad)]) == 2
        err = capsys.readouterr().err
        assert says in err and "--out" in err and str(bad) in err


def test_the_script_refuses_an_unwritable_out_before_the_run(tmp_path, capsys):
    t0 = time.monotonic()
    assert _code(dist_main, [*_RUN, "--ranks", "2", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--out" in err and "is a directory" in err
    assert _code(dist_main, [*_RUN, "--ranks", "0"]) == 2
    assert "--ranks" in capsys.readouterr().err
    assert time.monotonic() - t0 < 10


STEPS = 600  # more than run before the signal (the fp32 reference runs them all first)


def _records(tmp: str) -> int:
    """Step records the ranks wrote so far (their JSON-lines files, under the run's TMPDIR)."""
    n = 0
    for path in glob.glob(os.path.join(tmp, "mpnb-dist-*", "rank*.jsonl")):
        try:
            with open(path) as f:
                n += sum(1 for _ in f)
        except OSError:
            pass
    return n


def _descendants(pid: int) -> set[int]:
    try:
        import psutil
    except ImportError:
        from mpnb.core.parallel._procs import _descendants as walk  # /proc, by ppid

        return set(walk([pid]))
    return {p.pid for p in psutil.Process(pid).children(recursive=True)}


def _alive(pids: set[int]) -> list[int]:
    left = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except OSError:
            continue
        if state != b"Z":  # a zombie has ended (a container's init may never reap it)
            left.append(pid)
    return left


@pytest.mark.parametrize(
    "sig, group",
    [
        (signal.SIGINT, False),  # Ctrl-C that reaches the caller
        (signal.SIGINT, True),  # Ctrl-C at a terminal: the whole foreground group
        (signal.SIGTERM, False),  # a scheduler's kill
    ],
    ids=["ctrl-c", "ctrl-c-group", "sigterm"],
)
@pytest.mark.dist
def test_a_signal_keeps_the_rows_and_ends_every_rank(tmp_path, sig, group):
    """SIGINT: rc 130 with a raw KeyboardInterrupt, the records thrown away; SIGTERM: rc 143,
    nothing printed, mpnb-dist-*/mpnb-launch-* left in the temp dir."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    out = tmp_path / "rows.json"
    cmd = [sys.executable, "-m", "mpnb", "compare", "--ranks", "2", "--workload", "mlp"]
    cmd += ["--size", "small", "--steps", str(STEPS), "--configs", "ddp-fp32", "--out", str(out)]
    env = dict(os.environ, TMPDIR=str(tmp), PYTHONUNBUFFERED="1")
    p = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 120
        while _records(str(tmp)) < 11 and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert p.poll() is None and _records(str(tmp)) >= 11, "no step recorded in time"
        pids = _descendants(p.pid)
        assert len(pids) >= 2  # the ranks
        os.killpg(p.pid, sig) if group else p.send_signal(sig)
        stdout, stderr = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    stdout, stderr = stdout.decode(), stderr.decode(errors="replace")
    assert p.returncode == (143 if sig == signal.SIGTERM else 130), stderr[-3000:]
    name = "terminated (SIGTERM)" if sig == signal.SIGTERM else "interrupted (Ctrl-C)"
    assert name in stderr and "Traceback" not in stderr, stderr[-3000:]
    row = next(line for line in stdout.splitlines() if line.strip().startswith("ddp-fp32"))
    assert "interrupted" in row
    rows = json.loads(out.read_text())["rows"]
    assert rows[0]["policy"] == "ddp-fp32" and rows[0]["status"] == "interrupted"
    assert 4 <= rows[0]["steps_done"] < STEPS  # the steps before the signal are kept
    assert f"of {STEPS} steps" in rows[0]["error"]
    end = time.monotonic() + 10
    while _alive(pids) and time.monotonic() < end:
        time.sleep(0.2)
    assert _alive(pids) == []  # every rank, and all they started
    assert sorted(os.listdir(tmp)) == [n for n in sorted(os.listdir(tmp)) if "mpnb-" not in n]


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    """The script's command run to completion (one thread per rank); it must succeed."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    return p


@pytest.mark.dist
def test_the_script_runs_under_torchrun_and_prints_the_rows(tmp_path):
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    assert torchrun, "torchrun comes with torch, next to this python"
    out = tmp_path / "rows.csv"
    cmd = [
        torchrun,
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "mpnb.lab.distributed",
        "--workload",
        "mlp",
        "--size",
        "small",
        "--steps",
        "3",
        "--configs",
        "ddp-fp32,fsdp2-bf16-reduce",
        "--json",
        "--out",
        str(out),
    ]
    p = _run(cmd)
    doc = json.loads(p.stdout)  # rank 0 alone prints the rows
    assert doc["distributed"]["ranks"] == 2 and doc["distributed"]["launcher"] == "torchrun"
    rows = {r["policy"]: r for r in doc["rows"]}
    assert set(rows) == {"ddp-fp32", "fsdp2-bf16-reduce"}
    n = sum(p.numel() for p in workloads.get("mlp", "small").model_fn().parameters())
    assert rows["ddp-fp32"]["bytes_by_op"]["all_reduce"] == 4 * n
    assert rows["fsdp2-bf16-reduce"]["bytes_by_op"]["reduce_scatter"] == n  # bf16, half kept
    for r in rows.values():
        assert r["status"] == "ok" and r["within_tolerance"], r
    assert out.read_text().count("\n") == 3  # header and two rows


@pytest.mark.dist
def test_the_script_launches_its_own_ranks_without_torchrun():
    cmd = [
        sys.executable,
        "-m",
        "mpnb.lab.distributed",
        "--ranks",
        "2",
        "--workload",
        "mlp",
        "--size",
        "small",
        "--steps",
        "3",
        "--configs",
        "fsdp2-fp32",
    ]
    p = _run(cmd)
    assert "fsdp2-fp32" in p.stdout and "all_gather" in p.stdout
