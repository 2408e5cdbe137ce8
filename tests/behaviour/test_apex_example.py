"""examples/apex/simple_distributed.py, a CUDA-only Apex script, runs unchanged on a CPU:
``python -m mpnb.apex --cpu`` on one rank, and under torchrun on two gloo ranks."""

from __future__ import annotations

import io
import json
import os
import pathlib
import subprocess
import sys

import pytest

from mpnb.apex import run_script
from mpnb.parallel import free_port

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "apex" / "simple_distributed.py"


def _summaries(stdout: str) -> list[dict]:
    """Every rank's JSON line, wherever it lies: torchrun runs the ranks unbuffered (-u) on one
    stdout, so rank 0's ``print("final loss = ", ...)`` goes out in pieces and the other rank's
    line (one write) can land between them, in the middle of a line."""
    decoder, found, at = json.JSONDecoder(), [], stdout.find('{"rank"')
    while at >= 0:
        summary, end = decoder.raw_decode(stdout, at)
        found.append(summary)
        at = stdout.find('{"rank"', end)
    return found


def test_summaries_are_found_inside_an_interleaved_line():
    one, two = {"rank": 1, "x": 2.5}, {"rank": 0, "x": 1.0}
    out = f"final loss = {json.dumps(one)}\n 0.66\n{json.dumps(two)}\n"
    assert _summaries(out) == [one, two]


def test_the_example_is_written_for_cuda_and_apex():
    src = EXAMPLE.read_text()
    for apex_style in (
        "from apex import amp",
        "from apex.parallel import DistributedDataParallel",
        'init_process_group(backend="nccl", init_method="env://")',
        "torch.cuda.set_device(args.local_rank)",
        ".cuda()",
        "amp.initialize(",
        "with amp.scale_loss(loss, optimizer) as scaled_loss:",
        "ReLU(inplace=True)",
        "convert_syncbn_model(model)",
    ):
        assert apex_style in src, apex_style


@pytest.mark.slow
def test_one_rank_in_process(kernels):
    out = io.StringIO()
    ns = run_script(str(EXAMPLE), ["--steps", "4"], cpu=True, stream=out)
    summary = ns["summary"]
    assert summary["world_size"] == 1 and summary["device"] == "cpu"
    assert summary["final_loss"] < summary["first_loss"]
    assert ".cuda() -> stays on the CPU" in out.getvalue()


@pytest.mark.dist
@pytest.mark.slow
def test_two_ranks_under_torchrun_unchanged(kernels):
    """torchrun starts 2 ranks of ``python -m mpnb.apex --cpu`` on the unchanged script: NCCL
    becomes gloo, SyncBN + ReLU(inplace=True) trains, and the ranks end with equal weights."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        "--nproc-per-node=2",
        "--master-addr=127.0.0.1",
        f"--master-port={free_port()}",
        "-m",
        "mpnb.apex",
        "--cpu",
        str(EXAMPLE),
        "--steps",
        "15",
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-4000:])
    ranks = _summaries(r.stdout)
    assert sorted(s["rank"] for s in ranks) == [0, 1]
    for s in ranks:
        assert s["world_size"] == 2 and s["device"] == "cpu"
        assert s["final_loss"] < s["first_loss"]
        assert s["loss_scale"] > 0
    assert ranks[0]["param_checksum"] == ranks[1]["param_checksum"]
    assert r.stderr.count("init_process_group(backend='nccl') -> gloo") == 2  # once per rank
    assert "torch.cuda.set_device() -> no-op" in r.stderr


_ONE_RANK_SCRIPT = """
import torch
import torch.distributed as dist

dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
t = torch.ones(3)
dist.all_reduce(t, async_op=True).wait()
"""


@pytest.mark.dist
def test_the_runner_ends_a_group_the_script_left_open(tmp_path):
    """Apex scripts never destroyed their group: ``python -m mpnb.apex`` does once the script
    returns (left to interpreter exit, a gloo rank could abort: see ``end_group``)."""
    import torch.distributed as dist

    from mpnb.apex import main

    script = tmp_path / "train.py"
    script.write_text(_ONE_RANK_SCRIPT.format(port=free_port()))
    assert main(["--cpu", str(script)]) == 0
    assert not dist.is_initialized()


@pytest.mark.dist
def test_the_runner_leaves_a_group_it_did_not_see_created(tmp_path):
    import torch.distributed as dist

    from mpnb.apex import main

    script = tmp_path / "train.py"
    script.write_text("import torch.distributed as dist\nassert dist.is_initialized()\n")
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        assert main([str(script)]) == 0
        assert dist.is_initialized()  # the caller's group: the caller ends it
    finally:
        dist.destroy_process_group()
