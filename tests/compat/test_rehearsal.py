"""``python -m mpnb.apex --cpu``: CUDA placement and calls redirected to the CPU and gloo inside
the runner only, each reported once, and every replacement undone on exit (also on errors)."""

from __future__ import annotations

import functools
import io
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

from mpnb.apex import run_script
from mpnb.compat import CpuRehearsal
from mpnb.compat.rehearsal import REPLACED
from mpnb.parallel import free_port


def _resolve(dotted: str):
    return functools.reduce(getattr, dotted.split(".")[1:], torch)


def _snapshot() -> dict[str, object]:
    return {name: _resolve(name) for name in REPLACED}


def _cuda_placement_refused() -> bool:
    try:
        torch.empty(1, device="cuda")
    except (RuntimeError, AssertionError):
        return True
    return False


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what a CPU-only torch refuses")
def test_inside_the_rehearsal_cuda_code_runs_on_the_cpu_and_each_replacement_is_reported_once():
    out = io.StringIO()
    with CpuRehearsal(out) as r:
        for _ in range(2):  # twice: each report appears once
            x = torch.randn(3, device="cuda")
            lin = torch.nn.Linear(3, 2).cuda()
            y = lin(x.cuda().to("cuda:0")).to(torch.device("cuda", 0))
            torch.cuda.set_device(0)
            torch.cuda.manual_seed(0)
            s = torch.cuda.Stream()
            with torch.cuda.stream(s):
                z = y * 2
            torch.cuda.current_stream().wait_stream(s)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            end.record()
            torch.cuda.synchronize()
            legacy = torch.cuda.FloatTensor([1.0, 2.0])
            assert torch.cuda.LongTensor().numel() == 0 and isinstance(s, torch.cuda.Stream)
            pinned = x.pin_memory()
    assert x.device.type == z.device.type == legacy.device.type == pinned.device.type == "cpu"
    assert lin.weight.device.type == "cpu" and legacy.dtype == torch.float32
    assert start.elapsed_time(end) >= 0.0
    lines = out.getvalue().splitlines()
    assert len(lines) == len(set(lines)) == len(r.reported) >= 9
    assert all(line.startswith("mpnb.apex --cpu: ") for line in lines)
    assert any("set_device" in line for line in lines) and any(".cuda()" in line for line in lines)
    assert _cuda_placement_refused()  # and nothing is left behind


def test_nccl_becomes_gloo_inside_the_rehearsal():
    out = io.StringIO()
    with CpuRehearsal(out):
        dist.init_process_group(
            backend="nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
        )
        try:
            assert dist.get_backend() == "gloo"
            group = dist.new_group([0], backend="nccl")
            assert dist.get_backend(group) == "gloo"
        finally:
            dist.destroy_process_group()
    assert "init_process_group(backend='nccl') -> gloo" in out.getvalue()
    assert "new_group(backend='nccl') -> gloo" in out.getvalue()


def test_everything_is_restored_when_the_script_raises(tmp_path):
    before = _snapshot()
    script = tmp_path / "fails.py"
    script.write_text(
        "import torch\n"
        "x = torch.zeros(2, device='cuda')\n"
        "torch.cuda.set_device(0)\n"
        "raise ValueError('the script fails on purpose')\n"
    )
    with pytest.raises(ValueError, match="on purpose"):
        run_script(str(script), [], cpu=True, stream=io.StringIO())
    after = _snapshot()
    assert all(after[n] is before[n] for n in REPLACED), [
        n for n in REPLACED if after[n] is not before[n]
    ]
    if not torch.cuda.is_available():
        assert _cuda_placement_refused()
    assert "apex" not in sys.modules


def test_without_cpu_nothing_of_torch_is_touched(tmp_path):
    before = _snapshot()
    script = tmp_path / "plain.py"
    script.write_text(
        textwrap.dedent("""
        import functools, torch
        from mpnb.compat.rehearsal import REPLACED
        seen = {n: functools.reduce(getattr, n.split(".")[1:], torch) for n in REPLACED}
        try:
            torch.empty(1, device="cuda")
            placed = True
        except (RuntimeError, AssertionError):
            placed = False
        from apex import amp  # the alias is on, the rehearsal is not
        """)
    )
    ns = run_script(str(script), [], cpu=False)
    assert all(ns["seen"][n] is before[n] for n in REPLACED)
    assert ns["placed"] == torch.cuda.is_available()
    assert ns["amp"].initialize is not None


def test_python_m_mpnb_apex_cpu_reports_on_stderr_once(tmp_path):
    script = tmp_path / "cuda_only.py"
    script.write_text(
        "import torch\n"
        "for _ in range(3):\n"
        "    x = torch.ones(2).cuda()\n"
        "    torch.cuda.synchronize()\n"
        "print('sum', x.sum().item(), x.device)\n"
    )
    r = subprocess.run(
        [sys.executable, "-m", "mpnb.apex", "--cpu", str(script)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "sum 2.0 cpu" in r.stdout
    assert r.stderr.count(".cuda() -> stays on the CPU") == 1
    assert r.stderr.count("torch.cuda.synchronize() -> no-op") == 1
