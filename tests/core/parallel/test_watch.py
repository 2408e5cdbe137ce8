"""Distributed faults are named, fast: two gloo ranks that disagree fail with an error that
names both ranks and the fix, well before the launch's timeout (and the timeout names the rank
that hung, and where).

Each case used to end in a rank aborted by gloo (SIGABRT), a wait until the launch's timeout,
or a raw gloo timeout error.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from mpnb.parallel import DistributedDataParallel as DDP
from mpnb.parallel import RankError, SyncBatchNorm, launch

pytestmark = pytest.mark.dist

ROOT = Path(__file__).resolve().parents[3]
TIMEOUT = 60  # the launch's; every failure here must come well before it
FAST = 30


def _launch_fails(fn) -> tuple[RankError, float]:
    t0 = time.monotonic()
    with pytest.raises(RankError) as info:
        launch(fn, 2, backend="gloo", timeout=TIMEOUT, threads=1)
    return info.value, time.monotonic() - t0


def _channels_differ():
    r = dist.get_rank()
    c = 4 if r == 0 else 6
    SyncBatchNorm(c)(torch.randn(8, c)).sum().backward()


def test_syncbn_with_different_channel_counts_names_both_ranks():
    """Before: gloo's 'Received data size doesn't match' abort killed a rank (SIGABRT)."""
    err, took = _launch_fails(_channels_differ)
    msg = str(err)
    assert "raised ValueError" in msg and "different numbers" in msg
    assert "rank 0: 4, rank 1: 6" in msg and "same num_features" in msg
    assert "died" not in msg and took < FAST


def _block():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), SyncBatchNorm(4), nn.Linear(4, 1))


def _rank1_eval_with_ddp(switch_at: int):
    model = DDP(_block())
    for i in range(4):
        if dist.get_rank() == 1 and i == switch_at:
            model.eval()
        model(torch.randn(8, 4)).sum().backward()


def _rank1_eval_from_the_start():
    _rank1_eval_with_ddp(0)


def _rank1_eval_later():
    _rank1_eval_with_ddp(2)


@pytest.mark.parametrize("fn", [_rank1_eval_from_the_start, _rank1_eval_later])
def test_one_rank_in_eval_the_other_training_is_a_named_mismatch(fn):
    """Before: rank 0 waited in SyncBatchNorm's all-gather, rank 1 in DDP's all-reduce, until
    the launch's timeout ('2 rank(s) did not finish')."""
    err, took = _launch_fails(fn)
    msg = str(err)
    assert "collective mismatch" in msg and "DistributedDataParallel" in msg
    assert "SyncBatchNorm's" in msg and "model.train() or" in msg and "on every rank" in msg
    assert took < FAST


def _rank1_eval_syncbn_alone():
    bn = SyncBatchNorm(4)
    if dist.get_rank() == 1:
        bn.eval()
    bn(torch.randn(8, 4)).sum().backward()


def test_a_rank_in_eval_that_returns_is_named_by_the_training_rank():
    err, took = _launch_fails(_rank1_eval_syncbn_alone)
    msg = str(err)
    assert err.rank == 0 and "rank 0 waits in" in msg and "SyncBatchNorm's" in msg
    assert "rank(s) 1 already" in msg and "eval() mode runs none" in msg
    assert took < FAST


def _rank1_hangs():
    if dist.get_rank() == 1:
        time.sleep(120)


def test_the_timeout_names_the_rank_that_hung_and_where():
    """Before: '2 rank(s) did not finish (finished: [])', though rank 0 had returned."""
    with pytest.raises(TimeoutError) as info:
        launch(_rank1_hangs, 2, backend="gloo", timeout=8, threads=1)
    msg = str(info.value)
    assert "rank(s) 1 did not return" in msg and "within 8 s" in msg
    assert "rank(s) 0 had returned" in msg
    assert "rank 1 was still in fn" in msg and "in _rank1_hangs" in msg


_UNEVEN = """
import sys
import torch
import torch.distributed as dist
from mpnb.parallel import DistributedDataParallel, launch


def train():
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(4, 2))
    for _ in range(5 if dist.get_rank() == 0 else 3):  # uneven inputs, no model.join()
        model(torch.randn(8, 4)).sum().backward()


if __name__ == "__main__":
    launch(train, 2, backend="gloo", timeout=int(sys.argv[1]))
"""


def test_uneven_inputs_under_torchrun_are_named_at_once(tmp_path):
    """Before: the whole timeout, then gloo's 'Timed out waiting ... for recv operation'."""
    script = tmp_path / "uneven.py"
    script.write_text(textwrap.dedent(_UNEVEN))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    t0 = time.monotonic()
    proc = subprocess.run(
        [*cmd, str(script), str(TIMEOUT)],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
        cwd=ROOT,
    )
    took = time.monotonic() - t0
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    says = "uneven inputs: rank 0 waits in the gradient all-reduce of its batch 4"
    assert says in out, out[-3000:]
    assert "rank(s) 1 already returned" in out and "with model.join():" in out
    assert "Timed out waiting" not in out
    assert took < TIMEOUT - 10, out[-3000:]


class _StoreOfAnEndedWait:
    """A store in which rank 1's entry is there at ``check`` and gone at ``get``: its wait
    ended in between and it took its entry back (a TCP store then answers b"")."""

    def __init__(self) -> None:
        self.data: dict[str, str] = {}
        self.vanishing = "mpnb/launch/waiting/1"

    def check(self, keys) -> bool:
        return all(k in self.data or k == self.vanishing for k in keys)

    def set(self, key, value) -> None:
        self.data[key] = value

    def get(self, key) -> bytes:
        return self.data.get(key, "").encode()


class _Returned:
    def __init__(self, store) -> None:
        self._store = store

    def __call__(self) -> list[int]:
        return []

    def store(self):
        return self._store


class _Owner:
    def __init__(self, store) -> None:
        self.ranks, self.rank, self.returned = [0, 1], 0, _Returned(store)

    def key(self, rank: int) -> str:
        return f"mpnb/launch/waiting/{rank}"


def test_a_peer_entry_that_vanishes_between_check_and_get_is_no_mismatch_and_no_crash():
    """Before: the empty answer failed to unpack ('not enough values to unpack') inside the
    watch, and the launch reported that ValueError instead of the real cause."""
    from mpnb.core.parallel._watch import _Waiting

    store = _StoreOfAnEndedWait()
    waiting = _Waiting(_Owner(store), 3, "DistributedDataParallel's all-reduce", RuntimeError)
    waiting()  # rank 1's entry reads empty: nothing to compare
    assert store.data == {"mpnb/launch/waiting/0": "3\tDistributedDataParallel's all-reduce"}
    store.data[store.vanishing] = "3\tSyncBatchNorm's all-gather"  # a peer that waits on
    with pytest.raises(RuntimeError, match="mismatch: rank 0"):
        waiting()


def test_a_peer_that_raised_stops_the_wait_with_its_error():
    """Before: the watch raised this inside its store try-block, which swallowed it as a
    store error; only the launch's own failure handling ended the wait."""
    from mpnb.core.parallel._watch import _Waiting

    store = _StoreOfAnEndedWait()
    store.data["mpnb/launch/failed/1"] = "ValueError: bad batch"
    waiting = _Waiting(_Owner(store), 1, "SyncBatchNorm's all-gather", RuntimeError)
    with pytest.raises(RuntimeError, match="rank 1 raised in fn") as e:
        waiting()
    assert "ValueError: bad batch" in str(e.value)
