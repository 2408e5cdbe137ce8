"""The lab keeps what it measured: Ctrl-C, refused arguments, all-skipped rows, NaN advice.

Ctrl-C (KeyboardInterrupt) in the middle of a step ends ``compare`` as Stop does (the rows keep
the finished steps, the report is still written); ``--steps 0``, ``--batch-sizes ""``, an
unknown device and an unwritable ``--out`` are refused before anything runs.
"""

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
from mpnb.cli import main
from mpnb.lab import workloads
from mpnb.lab.config import expand


def _data(n=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    return x, x[:, :4].argmax(1)


def _tiny():
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


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


@pytest.mark.parametrize(
    "args, says",
    [
        (["--steps", "0"], "need at least 2 steps"),
        (["--steps", "-5"], "need at least 2 steps"),
        (["--batch-sizes", ""], "expected positive batch sizes"),
        (["--batch-sizes", "16,0"], "expected positive batch sizes"),
    ],
)
def test_cli_refuses_bad_counts_instead_of_running_the_defaults(args, says, capsys):
    with pytest.raises(SystemExit) as e:
        main(["compare", "--out", "", *args])
    assert e.value.code == 2
    assert says in capsys.readouterr().err


def test_cli_refuses_an_unknown_device_and_an_unwritable_report(tmp_path, capsys):
    assert main(["compare", "--device", "tpu", "--out", ""]) == 2
    err = capsys.readouterr().err
    assert "device='tpu' is not a device" in err and "'cpu'" in err
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    for bad, says in [
        (blocker / "report.html", "is a file, so"),
        (tmp_path, "is a directory"),
    ]:
        t0 = time.perf_counter()
        assert main(["compare", "--out", str(bad)]) == 2
        err = capsys.readouterr().err
        assert says in err and "--out ''" in err
        assert time.perf_counter() - t0 < 5  # refused before the run, not after it


def test_compare_refuses_zero_steps_and_an_unknown_device():
    with pytest.raises(ValueError, match="steps=0"):
        mpnb.lab.compare("mlp", steps=0, progress=False)
    with pytest.raises(ValueError, match="is not a device"):
        mpnb.lab.compare("mlp", device="tpu", progress=False)


class _Overflow(nn.Module):
    """Logits far above fp16's range: every fp16 step overflows and is skipped."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 4)

    def forward(self, x):
        return self.lin(x) * 1e6


def test_a_row_whose_every_step_was_skipped_says_so():
    w = workloads.custom(_Overflow, _data(), nn.functional.cross_entropy, batch_size=16)
    df = mpnb.lab.compare(
        w, opt_levels=("O0", "O2"), half_dtype="fp16", steps=4, progress=False, threads=1
    ).set_index("opt_level")
    assert df.loc["O2", "skipped_steps"] == 4
    assert "every one of the 4 steps was skipped" in df.loc["O2", "warnings"]
    assert "trace_overflow" in df.loc["O2", "warnings"]
    assert "skipped" not in df.loc["O0", "warnings"]


def _cfg(level, half):
    dtype = "bf16" if half == "fp32" else half  # O0 runs fp32 whatever the half dtype
    return next(
        c
        for c in expand("mlp", (level,), dtype, (16,), 4, "adam", None, None, "cpu", 0)
        if c.half_dtype == half
    )


def test_the_nan_divergence_advice_fits_the_row():
    from mpnb.lab._train import divergence_message

    fp32 = divergence_message(_cfg("O0", "fp32"), float("nan"), 3, False, 1.0)
    assert "not a precision problem" in fp32 and "loss scal" not in fp32 and "bf16" not in fp32
    bf16 = divergence_message(_cfg("O2", "bf16"), float("nan"), 3, False, 1.0)
    assert "loss scaling would not help" in bf16 and "use dynamic" not in bf16
    static = divergence_message(_cfg("O2", "fp16"), float("inf"), 3, False, 128.0)
    assert "use dynamic loss scaling" in static and "or bf16" in static
    dynamic = divergence_message(_cfg("O2", "fp16"), float("nan"), 3, True, 128.0)
    assert "use dynamic" not in dynamic and "dynamic loss scale 128" in dynamic
    o3 = divergence_message(_cfg("O3", "bf16"), float("nan"), 3, False, 1.0)
    assert "O2 keeps them in fp32" in o3


# ---- no bogus figures -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw, says",
    [
        (dict(opt_levels=("O0", "O1", "O1")), r"lists O1 more than once.*O0,O1\)"),
        (dict(batch_sizes=(16, 16)), r"lists 16 more than once.*e\.g\. 16\)"),
    ],
)
def test_a_configuration_given_twice_is_refused(kw, says):
    """They ran again under the same label (one row reading '0.10x O0')."""
    w = workloads.custom(_tiny, _data(), nn.functional.cross_entropy, batch_size=16)
    args = dict(opt_levels=("O0", "O1"), batch_sizes=(16,), steps=4, progress=False)
    with pytest.raises(ValueError, match=says):
        mpnb.lab.compare(w, **{**args, **kw})


@pytest.mark.parametrize("args", [["--opt-levels", "O0,O1,O1"], ["--batch-sizes", "16,16"]])
def test_the_cli_refuses_a_configuration_given_twice(args, capsys):
    try:  # a bad list is a usage error (argparse exits) or the run's refusal (exit code 2)
        code = main(["compare", "--workload", "mlp", "--steps", "2", "--out", "", *args])
    except SystemExit as e:
        code = e.code
    assert code == 2
    err = capsys.readouterr().err
    assert "more than once" in err and "Traceback" not in err


def test_too_few_timed_steps_give_no_ratio_but_say_so():
    """--steps 2 timed one round and printed '2.00x faster than O0' with no interval, while
    the verdict (which needs the interval) said nothing was faster."""
    w = workloads.custom(_tiny, _data(), nn.functional.cross_entropy, batch_size=16)
    for steps, rounds in ((2, 1), (3, 2)):
        df = mpnb.lab.compare(w, opt_levels=("O0", "O1"), steps=steps, progress=False, threads=1)
        o1 = df.set_index("opt_level").loc["O1"]
        assert o1.rounds == rounds and math.isnan(o1.speedup_vs_O0)
        assert o1.speed_label.startswith("too few timed steps for a speed figure")
        assert "faster" not in o1.speed_label and "slower" not in o1.speed_label
        assert f"{rounds} round" in o1.speed_label and "run more steps" in o1.speed_label
        assert "x faster than O0" not in df.attrs["verdict"]["text"]
    df = mpnb.lab.compare(w, opt_levels=("O0", "O1"), steps=4, progress=False, threads=1)
    o1 = df.set_index("opt_level").loc["O1"]  # 3 rounds: a figure with its interval
    assert o1.rounds == 3 and o1.speedup_lo <= o1.speedup_vs_O0 <= o1.speedup_hi
    assert not o1.speed_label.startswith("too few")


# ---- the report: written whole or not at all --------------------------------------------------


def test_a_report_write_that_fails_half_way_keeps_the_previous_report(tmp_path, file_size_limit):
    """A file system filling up mid-write truncated the previous report to the part written."""
    w = workloads.custom(_tiny, _data(), nn.functional.cross_entropy, batch_size=16)
    df = mpnb.lab.compare(w, opt_levels=("O0",), steps=4, progress=False, threads=1)
    path = tmp_path / "report.html"
    previous = "<html>the previous report</html>"
    path.write_text(previous)
    with file_size_limit(100_000), pytest.raises(OSError, match="previous content is kept"):
        mpnb.lab.report(df, path)
    assert path.read_text() == previous
    assert [p.name for p in tmp_path.iterdir()] == ["report.html"]  # no temporary file left
    mpnb.lab.report(df, path)  # with room, the new report replaces it
    assert "plotly" in path.read_text()
