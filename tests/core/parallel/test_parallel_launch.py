"""mpnb.parallel.launch: results, a failing or dying rank, timeouts, the CUDA rule, torchrun."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from mpnb.parallel import RankError, launch

pytestmark = pytest.mark.dist

ROOT = Path(__file__).resolve().parents[3]
launch_mod = importlib.import_module("mpnb.core.parallel.launch")  # the module, not the function


def _rank_and_sum(k):
    t = torch.tensor([float(dist.get_rank() + k)])
    dist.all_reduce(t)
    return dist.get_rank(), t.item(), os.environ["MASTER_ADDR"]


def _rank1_raises():
    if dist.get_rank() == 1:
        raise ValueError("boom on purpose")
    dist.barrier()  # rank 0 would wait here forever without launch's watchdog


def _rank1_dies():
    if dist.get_rank() == 1:
        os._exit(3)
    dist.barrier()


def _sleeps():
    time.sleep(60)


def test_returns_each_ranks_value_over_loopback():
    out = launch(_rank_and_sum, 2, backend="gloo", args=(1,), timeout=60, threads=1)
    assert out == [(0, 3.0, "127.0.0.1"), (1, 3.0, "127.0.0.1")]


def _rank_tensor():
    rank = torch.distributed.get_rank()
    t = torch.full((1000,), float(rank))
    torch.distributed.all_reduce(t)
    return {"rank": rank, "sum": t, "half": t.bfloat16()}


@pytest.mark.parametrize("start_method", ["spawn", "fork"])
def test_ranks_can_return_tensors(start_method):
    """Tensors come back by value: the rank may exit before the caller reads them."""
    out = launch(_rank_tensor, 2, backend="gloo", timeout=60, threads=1, start_method=start_method)
    for rank, r in enumerate(out):
        assert r["rank"] == rank
        assert torch.equal(r["sum"], torch.ones(1000)) and r["half"].dtype == torch.bfloat16


def test_a_raising_rank_makes_launch_raise_with_its_traceback_quickly():
    t0 = time.monotonic()
    with pytest.raises(RankError) as info:
        launch(_rank1_raises, 2, backend="gloo", timeout=60, threads=1)
    assert time.monotonic() - t0 < 30
    assert info.value.rank == 1
    msg = str(info.value)
    assert "ValueError: boom on purpose" in msg and "_rank1_raises" in msg  # the traceback


def test_a_dying_rank_makes_launch_raise():
    t0 = time.monotonic()
    with pytest.raises(RankError, match="rank 1 died with exit code 3"):
        launch(_rank1_dies, 2, backend="gloo", timeout=60, threads=1)
    assert time.monotonic() - t0 < 30


def test_timeout_stops_the_ranks():
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="did not finish within 4 s"):
        launch(_sleeps, 2, backend="gloo", timeout=4, threads=1)
    assert time.monotonic() - t0 < 20


def test_refuses_fork_after_cuda_init_and_explains(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(RuntimeError, match="Restart the kernel"):
        launch(_rank_and_sum, 2, backend="gloo", args=(0,), start_method="fork")


def test_notebook_functions_are_forked_importable_ones_spawned(monkeypatch):
    def nb_fn():
        return 0

    nb_fn.__module__ = "__main__"
    monkeypatch.setitem(sys.modules, "__main__", types.ModuleType("__main__"))  # no __file__
    assert launch_mod._start_method(nb_fn, "gloo", None) == "fork"
    assert launch_mod._start_method(_sleeps, "gloo", None) == "spawn"


def test_bad_arguments():
    with pytest.raises(ValueError, match="nprocs"):
        launch(_sleeps, 0)


@pytest.mark.parametrize("how", ["torchrun", "python"])
def test_example_script_runs_under_torchrun_and_plain_python(how):
    script = str(ROOT / "examples" / "ddp_train.py")
    if how == "torchrun":
        # --standalone: torchrun picks its own free port on localhost (no port race)
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            script,
            "--steps",
            "3",
        ]
    else:
        cmd = [sys.executable, script, "--steps", "3"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "params identical across ranks: True" in proc.stdout


def _world_size():
    return dist.get_world_size()


def test_under_torchrun_launch_tears_down_the_group_it_made(monkeypatch):
    # A gloo group alive at interpreter exit can abort the rank from gloo's threads
    # ("terminate called without an active exception"): launch destroys the group it made,
    # and leaves one the caller made to the caller.
    port = launch_mod.free_port()
    for k, v in dict(
        RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    ).items():
        monkeypatch.setenv(k, v)
    assert launch_mod.under_torchrun()
    assert launch(_world_size, 1, backend="gloo", timeout=60) == [1]
    assert not dist.is_initialized()
    dist.init_process_group(
        "gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{launch_mod.free_port()}"
    )
    try:
        assert launch(_world_size, 1, backend="gloo") == [1]
        assert dist.is_initialized()
    finally:
        dist.destroy_process_group()
