"""mpnb.parallel.launch: results, a failing or dying rank, timeouts, the CUDA rule, torchrun,
and the process tree: ranks may start children, and nothing they started outlives launch."""

from __future__ import annotations

import importlib
import os
import signal
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
    assert "ValueError: boom" in msg and "_rank1_raises" in msg  # the traceback


def test_a_dying_rank_makes_launch_raise():
    t0 = time.monotonic()
    with pytest.raises(RankError, match="rank 1 died.*code 3"):
        launch(_rank1_dies, 2, backend="gloo", timeout=60, threads=1)
    assert time.monotonic() - t0 < 30


def test_timeout_stops_the_ranks_and_all_they_started(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="within 4 s"):
        launch(
            _sleeps_with_children,
            2,
            backend="gloo",
            args=(str(tmp_path),),
            timeout=4,
            threads=1,
            start_method="fork",  # forked ranks start at once: both write their pids in time
        )
    assert time.monotonic() - t0 < 20
    assert _still_running(_pids_written(tmp_path, 2)) == []


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


# ---- the process tree ---------------------------------------------------------------------
needs_proc = pytest.mark.skipif(
    not Path("/proc/self/stat").exists(), reason="reads process states from /proc (Linux)"
)


def _running(pid: int) -> bool:
    """The pid runs (a zombie, dead and waiting to be reaped, does not count)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def _still_running(pids, within: float = 5.0) -> list[int]:
    end = time.monotonic() + within
    while any(_running(p) for p in pids) and time.monotonic() < end:
        time.sleep(0.05)
    return [p for p in pids if _running(p)]


def _start_children(tmp: str) -> list[int]:
    """Start a child in the rank's group and one in a session of its own; write the pids."""
    kids = [
        subprocess.Popen(["sleep", "600"]),
        subprocess.Popen(["sleep", "600"], start_new_session=True),  # escapes the group
    ]
    pids = [os.getpid()] + [k.pid for k in kids]
    _write_atomically(Path(tmp, f"rank{dist.get_rank()}"), " ".join(map(str, pids)))
    return pids


def _write_atomically(path: Path, text: str) -> None:
    """A reader sees the whole file or none (the test polls for these files)."""
    path.with_suffix(".tmp").write_text(text)
    os.replace(path.with_suffix(".tmp"), path)


def _pids_written(tmp, nprocs: int) -> list[int]:
    return [int(p) for r in range(nprocs) for p in Path(tmp, f"rank{r}").read_text().split()]


def _sleeps_with_children(tmp):
    _start_children(tmp)
    time.sleep(60)


class _Squares(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i):
        return torch.tensor([float(i * i)]), os.getpid()


def _loads_with_workers(tmp):
    loader = torch.utils.data.DataLoader(_Squares(), batch_size=2, num_workers=2)
    total, workers = 0.0, set()
    for x, pid in loader:
        total += x.sum().item()
        workers.update(pid.tolist())
    t = torch.tensor([total])
    dist.all_reduce(t)
    left_running = _start_children(tmp)  # on purpose: launch must end them
    return t.item(), sorted(workers), left_running


@needs_proc
@pytest.mark.parametrize("start_method", ["spawn", "fork"])
def test_ranks_may_start_children_and_none_outlive_launch(tmp_path, start_method):
    """A DataLoader with workers runs inside a rank (ranks are not daemonic); what a rank
    leaves running when it returns is stopped before launch returns."""
    out = launch(
        _loads_with_workers,
        2,
        backend="gloo",
        args=(str(tmp_path),),
        timeout=60,
        threads=1,
        start_method=start_method,
    )
    for total, workers, pids in out:
        assert total == 2 * sum(i * i for i in range(8))
        assert len(workers) == 2 and pids[0] not in workers  # two worker processes
        assert _still_running(workers + pids) == []


def _rank0_has_children_rank1_raises(tmp):
    if dist.get_rank() == 0:
        _start_children(tmp)
    dist.barrier()
    if dist.get_rank() == 1:
        raise ValueError("boom after rank 0 started its children")
    time.sleep(60)


@needs_proc
def test_a_failing_launch_ends_every_descendant_of_every_rank(tmp_path):
    with pytest.raises(RankError, match="boom after rank 0") as info:
        launch(
            _rank0_has_children_rank1_raises, 2, backend="gloo", args=(str(tmp_path),), timeout=60
        )
    assert info.value.rank == 1
    pids = [int(p) for p in Path(tmp_path, "rank0").read_text().split()]
    assert _still_running(pids) == []  # rank 0, its child, and the child in its own session


def _interrupts_the_caller(tmp):
    _start_children(tmp)
    dist.barrier()  # both ranks wrote their pids
    if dist.get_rank() == 0:
        os.kill(os.getppid(), signal.SIGINT)  # as Ctrl-C (or a notebook's interrupt) would
    time.sleep(60)


@needs_proc
def test_an_interrupted_caller_stops_the_ranks_and_all_they_started(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        launch(
            _interrupts_the_caller,
            2,
            backend="gloo",
            args=(str(tmp_path),),
            timeout=60,
            start_method="fork",
        )
    assert time.monotonic() - t0 < 30
    assert _still_running(_pids_written(tmp_path, 2)) == []


_KILLED_CALLER = """
import os, subprocess, sys, time
from pathlib import Path
import torch.distributed as dist
from mpnb.parallel import launch

def rank_fn(tmp):
    kid = subprocess.Popen(["sleep", "600"])
    path = Path(tmp, f"rank{dist.get_rank()}")
    path.with_suffix(".tmp").write_text(f"{os.getpid()} {kid.pid}")
    os.replace(path.with_suffix(".tmp"), path)  # the test sees the whole file or none
    time.sleep(60)

launch(rank_fn, 2, backend="gloo", args=(sys.argv[1],), timeout=60, threads=1)
"""


@needs_proc
def test_ranks_end_their_trees_when_the_caller_is_killed(tmp_path):
    """No finally runs in a SIGKILLed caller (a notebook kernel restarted, the OOM killer):
    the ranks notice that their caller is gone and end themselves and their children."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    # python -c: fn lives in a __main__ without a file, as in a notebook, so the ranks fork
    caller = subprocess.Popen([sys.executable, "-c", _KILLED_CALLER, str(tmp_path)], env=env)
    try:
        end = time.monotonic() + 60
        while not all(Path(tmp_path, f"rank{r}").exists() for r in range(2)):
            assert caller.poll() is None and time.monotonic() < end, "the caller did not start"
            time.sleep(0.05)
        pids = _pids_written(tmp_path, 2)
        assert len(pids) == 4  # each rank and its child
        caller.kill()
        caller.wait()
        assert _still_running(pids) == []
    finally:
        caller.kill()
