"""Ctrl-C and SIGTERM end ``mpnb compare --ranks 2`` as they end the one-process compare: the
rows measured so far printed and written to ``--out``, every rank and its children ended, the
temporary directories removed, and an exit code that says which signal (130, 143)."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.dist

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
