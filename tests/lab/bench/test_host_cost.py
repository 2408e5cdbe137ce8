"""The host-cost suite: every case runs (its launchers' host work, no kernel), with torch's
call as the base and a target on the cached table; in its own process, so that triton is
imported there without the interpreter the kernel tests of this session use."""

from __future__ import annotations

import json
import os
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
        (f"{op} host cost", w)
        for op in ("scale", "l2norm", "adamw", "sgd")
        for w in ("GPT 20M/76", "1000x1k")
    }
    cached = [r for r in rows if r["candidate"].endswith("table cached")]
    assert len(cached) == 8 and all(r["target"] == 1.0 and r["ratio"] > 0 for r in cached)
    # the whole call: the public op, the dispatcher, the launcher (which served the Meta key)
    whole = [r for r in rows if r["candidate"].endswith("(wrapper, dispatcher, launcher)")]
    assert len(whole) == 8 and all(r["target"] == 1.0 and r["ratio"] > 0 for r in whole)
    # the dispatcher's floor beside them: the same lists through a no-op Python kernel
    floor = [r for r in rows if r["candidate"].startswith("dispatcher floor")]
    assert len(floor) == 8 and all(r["target"] is None and r["ratio"] > 0 for r in floor)
    counts = {(r["case"], r["workload"]): r["candidate"].split()[-2] for r in floor}
    assert counts[("adamw host cost", "GPT 20M/76")] == "380"  # 4 lists and the steps
    assert counts[("sgd host cost", "1000x1k")] == "2000"
    assert all(r["median_s"] > 0 for r in rows)


def test_the_floor_is_a_python_kernel_behind_the_dispatcher():
    # in a process of its own (the op's library is the suite's): the no-op reaches its Python
    # kernel through torch.ops with every list, the unused ones empty
    code = """
import torch
from mpnb.lab.bench import host_cost
seen = []
host_cost._nothing = lambda *lists: seen.append([len(x) for x in lists])
xs = [torch.empty(3, device="meta") for _ in range(4)]
host_cost._floor(xs, xs[:2])
print(seen, torch.ops.mpnb_bench.floor.default._schema.name)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("]] ")[1].strip() == "mpnb_bench::floor"
    assert done.stdout.startswith("[[4, 2, 0, 0, 0, 0]]")


def test_the_whole_call_reaches_the_launcher_and_the_fakes_come_back():
    # In a process of its own (triton imported without the interpreter): inside the suite's
    # block a meta call runs the launcher's host work (its launches counted); after it, the
    # fake again (nothing launched).
    code = """
import torch
from mpnb.core.ops import fused_sgd_, multi_tensor_l2norm, multi_tensor_scale
from mpnb.core.ops.triton._common import counting_launches
from mpnb.lab.bench.host_cost import _launchers_on
src, dst = [torch.empty(5, device="meta")], [torch.empty(5, device="meta")]
flag = torch.zeros(1, device="meta")
def calls():
    multi_tensor_scale(flag, src, dst, 0.5)
    multi_tensor_l2norm(flag, src, per_tensor=True)
    fused_sgd_(src, dst, [], [], [], lr=0.1)
with _launchers_on("Meta"), counting_launches() as inside:
    calls()
with counting_launches() as after:
    calls()
print(",".join(inside), after)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    kernels = "_scale_kernel,_sumsq_kernel,segment_sum_kernel,_finish_kernel,_sgd_kernel"
    assert done.stdout.split() == [kernels, "[]"]


def test_the_cuda_form_runs_every_case_with_real_launches_on_the_interpreter():
    # The form the GPU check runs (both sides on the device's tensors, mpnb's kernels
    # launched, not stubbed), here on CPU tensors under Triton's interpreter: every candidate
    # of every case runs once on the GPT's list and no launch is stubbed.
    code = """
from mpnb.core.ops.triton import _common
from mpnb.lab.bench.host_cost import Where, cases_on
ran = []
where = Where("cpu", "cpu", one=False, real=True)
for case in cases_on(where, scale=1e-5, workloads=("GPT 20M/76",)):
    for c in case.candidates:
        c.fn()
        assert not _common._COUNTING, c.name
        ran.append(c.name)
print(len(ran), sorted({n.split(" (")[0] for n in ran if n.startswith("torch")}))
"""
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    count, _, names = done.stdout.partition(" ")
    assert int(count) == 4 * 5  # 4 ops x (torch, 3 of mpnb's, the floor), on the GPT's list
    assert "torch._fused_adamw_" in names and "torch._fused_sgd_" in names
