"""``mpnb bench --device cuda`` on a machine without a GPU: a clear message, exit code 2, no
traceback (the suite itself runs on a GPU; its cases are smoke-tested on the CPU in
tests/core/ops/triton_kernels/test_bench_cases.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from mpnb.lab import bench
from mpnb.lab.bench import Options, cuda

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="a GPU is present: the suite would run, not refuse"
)


def test_device_cuda_alone_picks_the_gpu_suite_and_refuses(capsys):
    assert bench.main(["--device", "cuda"]) == 2
    out = capsys.readouterr()
    assert "no CUDA GPU is visible to torch" in out.err and "CUDA build of torch" in out.err
    assert out.out == ""


def test_gpu_suite_on_the_cpu_device_says_what_to_run(capsys):
    assert bench.main(["cuda", "--quick"]) == 2
    err = capsys.readouterr().err
    assert "needs a CUDA GPU" in err and "mpnb bench --device cuda" in err


def test_unavailable_reasons():
    assert "needs a CUDA GPU" in cuda.unavailable(Options.make(device="cpu"))
    with pytest.raises(ValueError, match="not a device the suites run on"):
        Options.make(device="gpu0")  # refused before any suite looks at it
    assert "no CUDA GPU" in cuda.unavailable(Options.make(device="cuda:1"))


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
