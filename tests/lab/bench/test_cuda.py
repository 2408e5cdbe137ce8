"""``mpnb bench --device cuda`` on a machine without a GPU: a clear message, exit code 2, no
traceback (the suite itself runs on a GPU; its cases are smoke-tested on the CPU in
tests/core/ops/triton/test_triton_bench_cases.py). The suite's tables, walked with a stand-in
for the Triton launchers: each case keeps the workload it was built with, and every scalar
reaches a kernel by keyword."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from mpnb.lab import bench
from mpnb.lab.bench import Options, _cuda_layers, _cuda_lists, cuda

_no_gpu = pytest.mark.skipif(
    torch.cuda.is_available(), reason="a GPU is present: the suite would run, not refuse"
)


@_no_gpu
def test_device_cuda_alone_picks_the_gpu_suite_and_refuses(capsys):
    assert bench.main(["--device", "cuda"]) == 2
    out = capsys.readouterr()
    assert "no CUDA GPU" in out.err and "CUDA build of torch" in out.err
    assert out.out == ""


@_no_gpu
def test_gpu_suite_on_the_cpu_device_says_what_to_run(capsys):
    assert bench.main(["cuda", "--quick"]) == 2
    err = capsys.readouterr().err
    assert "needs a CUDA GPU" in err and "mpnb bench --device cuda" in err


@_no_gpu
def test_unavailable_reasons():
    assert "needs a CUDA GPU" in cuda.unavailable(Options.make(device="cpu"))
    with pytest.raises(ValueError, match="not a device"):
        Options.make(device="gpu0")  # refused before any suite looks at it
    assert "no CUDA GPU" in cuda.unavailable(Options.make(device="cuda:1"))


@_no_gpu
def test_command_line_exits_2_without_a_traceback():
    run = subprocess.run(
        [sys.executable, "-m", "mpnb", "bench", "--device", "cuda"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 2, run.stderr
    assert run.stderr.startswith("mpnb bench: ") and "Traceback" not in run.stderr
    assert "no CUDA GPU" in run.stderr and run.stdout == ""


def _record_launches(monkeypatch) -> list:
    """Stand in for every Triton launcher the suite takes: record ``(op, args, kwargs)``."""
    calls = []

    def launcher(op):
        return lambda *args, **kwargs: calls.append((op, args, kwargs))

    monkeypatch.setattr(_cuda_layers, "launcher", launcher)
    monkeypatch.setattr(_cuda_lists, "launcher", launcher)
    return calls


def test_each_case_keeps_the_workload_it_was_built_with(monkeypatch):
    calls = _record_launches(monkeypatch)

    def row(name):
        torch_side = ("torch", lambda w: w.t)
        return _cuda_layers.TritonRow(name, torch_side, "op", lambda w, k: k(w.t), 1)

    def replace(w):  # a step that replaces a tensor the rows before it use
        w.t = torch.ones(2)

    w = SimpleNamespace(t=torch.zeros(2), n=2, none=None)
    skipped = _cuda_layers.TritonRow("c", ("torch", lambda w: w.t), "op", None, 1, needs="none")
    cases = list(_cuda_layers.walk((row("a"), replace, row("b"), skipped), w, "work", "cpu"))
    assert [c.name for c in cases] == ["a", "b"] and cases[0].candidates[1].name == "triton op"
    calls.clear()
    for c in cases:  # all built first, then run: each on its own workload
        c.candidates[1].fn()
    assert [args[0].sum().item() for _, args, _ in calls] == [0.0, 2.0]
    assert [c.candidates[0].fn().sum().item() for c in cases] == [0.0, 2.0]


def test_a_baseline_that_fails_on_the_device_falls_back(monkeypatch):
    _record_launches(monkeypatch)

    def missing(w):
        raise NotImplementedError("no kernel for this device")

    row = _cuda_layers.TritonRow(
        "x",
        ("torch fused", missing),
        "op",
        lambda w, k: k(),
        1,
        fallback=("torch ops", lambda w: None),
    )
    (c,) = _cuda_layers.walk((row,), SimpleNamespace(n=1), "work", "cpu")
    assert c.candidates[0].name == "torch ops"


def test_every_scalar_reaches_the_kernels_by_keyword(monkeypatch):
    calls = _record_launches(monkeypatch)
    cases = list(_cuda_lists.list_cases("tiny", [5, 3000], "cpu"))
    cases += cuda._layers(cuda.shapes(dict(d=32, heads=2, seq=8, batch=1)), "cpu")
    ops = {op for op, _, _ in calls}
    assert ops == {c.candidates[1].name.split()[1] for c in cases if c.name[:3] != "O2 "}
    positional = [
        (op, a) for op, args, _ in calls for a in args if isinstance(a, (int, float, str))
    ]
    assert positional == []  # bools are ints: a flag passed by position fails too
    adam = next(kw for op, _, kw in calls if op == "fused_adam_")
    assert adam["lr"] == 1e-4 and adam["adam_w_mode"] and adam["bias_correction"]
