"""The host-cost suite: every case runs (its launchers' host work, no kernel), with torch's
call as the base and a target on the cached table; in its own process, so that triton is
imported there without the interpreter the kernel tests of this session use."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("triton", reason="the suite times mpnb's Triton launchers")


def test_the_suite_runs_every_case_at_tiny_sizes(tmp_path):
    path = tmp_path / "host.json"
    argv = ["bench", "host-cost", "--quick", "--rounds", "1", "--scale", "0.001"]
    cmd = [sys.executable, "-m", "mpnb", *argv, "--json", str(path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(path.read_text())["rows"]
    cases = {(r["case"], r["workload"]) for r in rows}
    assert cases == {
        (c, w) for c in ("scale host cost", "adamw host cost") for w in ("GPT 20M/76", "1000x1k")
    }
    cached = [r for r in rows if r["candidate"].endswith("table cached")]
    assert len(cached) == 4 and all(r["target"] == 1.0 and r["ratio"] > 0 for r in cached)
    # the whole call: the public op, the dispatcher, the launcher (which served the Meta key)
    whole = [r for r in rows if r["candidate"].endswith("(wrapper, dispatcher, launcher)")]
    assert len(whole) == 4 and all(r["target"] == 1.0 and r["ratio"] > 0 for r in whole)
    assert all(r["median_s"] > 0 for r in rows)


def test_the_whole_call_reaches_the_launcher_and_the_fakes_come_back():
    # In a process of its own (triton imported without the interpreter): inside the suite's
    # block a meta call runs the launcher's host work (its launches counted); after it, the
    # fake again (nothing launched).
    code = """
import torch
from mpnb.core.ops import multi_tensor_scale
from mpnb.core.ops.triton._common import counting_launches
from mpnb.lab.bench.host_cost import _launchers_on_meta
src, dst = [torch.empty(5, device="meta")], [torch.empty(5, device="meta")]
flag = torch.zeros(1, device="meta")
with _launchers_on_meta(), counting_launches() as inside:
    multi_tensor_scale(flag, src, dst, 0.5)
with counting_launches() as after:
    multi_tensor_scale(flag, src, dst, 0.5)
print(inside, after)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["['_scale_kernel']", "[]"]
