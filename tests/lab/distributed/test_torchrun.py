"""``python -m mpnb.lab.distributed`` under ``torchrun --standalone --nproc-per-node 2``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from mpnb.lab import workloads

pytestmark = pytest.mark.dist


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    """The script's command run to completion (one thread per rank); it must succeed."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    return p


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
