"""How ``compare`` stops (``mpnb.lab._isolate``): Ctrl-C and SIGTERM in the middle of a step
keep the finished rows, in one process and under ``--isolate``, and the report is written."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from torch import nn

import mpnb.lab
from mpnb.lab import workloads


def _data(n=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    return x, x[:, :4].argmax(1)


class _CtrlCAt(nn.Module):
    """A tiny model whose ``n``-th forward (counted across configurations) raises
    KeyboardInterrupt, as a Ctrl-C in the middle of a training step does."""

    calls = 0

    def __init__(self, n: int):
        super().__init__()
        self.n = n
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))

    def forward(self, x):
        type(self).calls += 1
        if type(self).calls == self.n:
            raise KeyboardInterrupt
        return self.net(x)


def test_ctrl_c_in_a_step_returns_the_finished_rows():
    _CtrlCAt.calls = 0  # the 21st forward: some rounds in (setup runs forwards too)
    w = workloads.custom(lambda: _CtrlCAt(21), _data(), nn.functional.cross_entropy, batch_size=16)
    df = mpnb.lab.compare(w, opt_levels=("O0", "O1"), steps=40, progress=False, threads=1)
    assert df.attrs["stopped"] and df.attrs["stopped_by"] == "Ctrl-C"
    assert (df["status"] == "interrupted").all() and (df["error"] == "").all()
    for _, row in df.iterrows():
        assert "interrupted at step" in row.warnings and "(Ctrl-C)" in row.warnings
    hist = df.attrs["history"]
    done = hist.groupby("configuration").size()
    assert done.min() >= 4 and done.max() - done.min() <= 1  # round robin: one round apart
    for label, n in done.items():  # the step cut short recorded nothing
        note = df.set_index("configuration").loc[label, "warnings"]
        assert f"interrupted at step {n} of 40 (Ctrl-C)" in note
    o1 = df.set_index("opt_level").loc["O1"]  # the measured rounds are kept (3 or more timed
    assert o1.rounds >= 3 and math.isfinite(o1.speedup_vs_O0)  # rounds give a speed figure)
    assert not torch.is_autocast_enabled("cpu")  # an O1 forward cut short left nothing on


def _read_until(stream, needle: bytes, buf: bytearray, done: threading.Event) -> None:
    while True:
        chunk = stream.read1(4096) if hasattr(stream, "read1") else stream.read(1)
        if not chunk:
            break
        buf += chunk
        if needle in buf:
            done.set()


def _stop_cli(tmp_path, sig: int, extra: list[str], group: bool):
    """Run ``mpnb compare`` in its own session, send ``sig`` once a training step shows (to the
    whole process group, as a terminal's Ctrl-C or a scheduler does, or to the process only),
    and return its exit code, stdout, stderr and the report's path."""
    out = tmp_path / "report.html"
    out.write_text("the previous report")
    cmd = [sys.executable, "-m", "mpnb", "compare", "--workload", "mlp", "--size", "small"]
    cmd += ["--opt-levels", "O0,O1", "--steps", "20000", "--threads", "1", "--out", str(out)]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    p = subprocess.Popen(
        [*cmd, *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        start_new_session=True,
    )
    err, started = bytearray(), threading.Event()
    reader = threading.Thread(target=_read_until, args=(p.stderr, b"/20000]", err, started))
    reader.start()
    try:
        deadline = time.monotonic() + 120  # the progress bar shows a step: training runs
        while not started.wait(0.2) and p.poll() is None and time.monotonic() < deadline:
            pass
        assert started.is_set(), f"no training step shown: {bytes(err)[-2000:]!r}"
        time.sleep(1.0)  # a few steps more
        os.killpg(p.pid, sig) if group else p.send_signal(sig)
        p.wait(timeout=120)
        stdout = p.stdout.read().decode()
    finally:
        if p.poll() is None:
            p.kill()
        reader.join(5)
    time.sleep(0.5)
    return p.returncode, stdout, bytes(err).decode(errors="replace"), out, _running_in(p.pid)


def _running_in(pgid: int) -> list[int]:
    """The processes of process group ``pgid`` still running (zombies aside: a container's
    init may never reap multiprocessing's resource tracker)."""
    left = []
    for name in os.listdir("/proc") if os.path.isdir("/proc") else []:
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                rest = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if name.isdigit() and int(rest[2]) == pgid and rest[0] != b"Z":
            left.append(int(name))
    return left


def test_cli_ctrl_c_prints_the_rows_and_writes_the_report(tmp_path):
    code, text, err, out, _ = _stop_cli(tmp_path, signal.SIGINT, [], group=False)
    assert code == 130, (text, err[-2000:])
    assert "interrupted at step" in text and "(Ctrl-C)" in text  # the rows' notes
    assert "O0 fp32" in text and "O1 bf16" in text
    assert "interrupted (Ctrl-C)" in err
    assert out.exists() and "interrupted" in out.read_text()


@pytest.mark.parametrize(
    "sig, isolate, group",
    [
        (signal.SIGTERM, False, False),  # a scheduler's kill of the process
        (signal.SIGINT, True, True),  # Ctrl-C at a terminal, under --isolate
        (signal.SIGTERM, True, False),  # kill of the main process, under --isolate
        (signal.SIGTERM, True, True),  # a scheduler that signals the whole job
    ],
    ids=["sigterm", "isolate-ctrl-c", "isolate-sigterm", "isolate-sigterm-group"],
)
def test_a_stopped_sweep_keeps_its_rows_on_sigterm_and_under_isolate(tmp_path, sig, isolate, group):
    """SIGTERM killed the sweep and its rows; under --isolate a Ctrl-C lost the subprocess's
    steps ("nothing measured"). Now both keep the finished steps and write the report."""
    code, text, err, out, left = _stop_cli(tmp_path, sig, ["--isolate"] if isolate else [], group)
    name = "SIGTERM" if sig == signal.SIGTERM else "Ctrl-C"
    assert code == (143 if sig == signal.SIGTERM else 130), (text, err[-3000:])
    assert f"({name})" in text and "interrupted at step" in text
    # only configurations the stop came before may say "nothing measured" ("not started")
    lost = [ln for ln in text.splitlines() if "nothing measured" in ln and "not started" not in ln]
    assert lost == []
    row = next(line for line in text.splitlines() if "O0 fp32" in line)
    assert "baseline" in row  # the O0 row, measured
    done = int(text.split("interrupted at step ")[1].split(" ")[0])
    assert done >= 2
    assert ("terminated (SIGTERM)" if name == "SIGTERM" else "interrupted (Ctrl-C)") in err
    assert out.exists() and "interrupted at step" in out.read_text()
    assert left == []  # the isolated configuration's subprocess ended too
