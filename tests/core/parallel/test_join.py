"""Uneven inputs on 2 gloo ranks: ``model.join()`` against torch's DDP join on the same data,
the join protocol's errors, and, without join, a clear error instead of a hang.

All join scenarios run inside ONE launch (spawning ranks costs seconds); each rank returns
a dict of measurements and the tests assert on them.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from mpnb.parallel import DistributedDataParallel as DDP
from mpnb.parallel import RankError, launch

pytestmark = pytest.mark.dist


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Tanh(), torch.nn.Linear(10, 3))


def _batches(n: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)) for _ in range(n)]


def _loss(model, x, y):
    return (model(x) - y).pow(2).mean()


def _train(model, data, join_kw: dict, micro: int = 1) -> torch.Tensor:
    """SGD with momentum inside ``model.join()``; ``micro`` micro-batches per step, all but
    the last under ``no_sync()``. Returns the final parameters, flat."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with model.join(**join_kw):
        for step in range(0, len(data), micro):
            opt.zero_grad()
            for k, (x, y) in enumerate(data[step : step + micro]):
                if k < micro - 1:
                    with model.no_sync():  # forward and backward: join needs both inside
                        _loss(model, x, y).backward()
                else:
                    _loss(model, x, y).backward()
            opt.step()
    return torch.cat([p.detach().flatten() for p in model.parameters()])


# name: (batches of rank 0, batches of rank 1, join kwargs, mpnb DDP kwargs, micro-batches)
CASES = {
    "rank1_short": (5, 3, {}, {"message_size": 30}, 1),
    "rank1_short_divide_by_active": (
        5,
        3,
        {"divide_by_initial_world_size": False},
        {"message_size": 30},
        1,
    ),
    "rank0_short_two_streams": (2, 4, {}, {"message_size": 30, "num_allreduce_streams": 2}, 1),
    "rank1_empty_joins_before_first_backward": (3, 0, {}, {}, 1),
    "no_sync_accumulation": (8, 4, {}, {"message_size": 30}, 2),
    "even_inputs": (3, 3, {}, {"message_size": 30}, 1),
}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def _join_checks() -> dict:
    r = dist.get_rank()
    out: dict = {}
    for name, (n0, n1, join_kw, ddp_kw, micro) in CASES.items():
        data = _batches((n0, n1)[r], seed=10 + r)
        ours = DDP(_net(), **ddp_kw)
        mine = _train(ours, data, join_kw, micro)
        theirs = _train(torch.nn.parallel.DistributedDataParallel(_net()), data, join_kw, micro)
        out[name] = _rel(mine, theirs)
        out[f"{name}/weights"] = mine
        out[f"{name}/join_off_after_block"] = not ours._join_config.enable
    out.update(_protocol_errors(r))
    return out


def _protocol_errors(r: int) -> dict:
    """Misuse inside join() raises, naming the rule (on every rank: nothing hangs)."""
    out = {}
    model = DDP(_net())
    x, y = _batches(1, seed=3)[0]
    try:
        with model.join():
            model(x)  # a forward with grad that no backward follows
            _loss(model, x, y).backward()
    except RuntimeError as e:
        out["two_forwards"] = str(e)
    try:
        with model.join():
            with model.no_sync():
                loss = _loss(model, x, y)
            loss.backward()  # reduces, but its forward said it would not
    except RuntimeError as e:
        out["no_sync_forward_only"] = str(e)
    data = _batches(3 - 2 * r, seed=4)  # rank 0: 3 batches, rank 1: 1
    try:
        _train(model, data, {"throw_on_early_termination": True})
    except RuntimeError as e:
        out["throw"] = str(e)
    return out


@pytest.fixture(scope="module")
def join_results():
    return launch(_join_checks, 2, backend="gloo", timeout=120, threads=1)


@pytest.mark.parametrize("case", list(CASES))
def test_join_trains_uneven_inputs_like_torch_ddp_join(join_results, case):
    """Both ranks finish, and every rank ends with the weights torch's DDP join gives."""
    for rank, res in enumerate(join_results):
        assert res[case] <= 1e-6, f"rank {rank}: {case} differs from torch by {res[case]:.3g}"
        assert res[f"{case}/join_off_after_block"]
    assert torch.equal(join_results[0][f"{case}/weights"], join_results[1][f"{case}/weights"])


def test_the_divide_flag_and_the_extra_batches_matter(join_results):
    """The comparisons above are not vacuous: the settings give different models."""
    res = join_results[0]
    short, active = res["rank1_short/weights"], res["rank1_short_divide_by_active/weights"]
    assert _rel(short, active) > 1e-3
    assert _rel(res["even_inputs/weights"], short) > 1e-3


def test_join_protocol_misuse_raises_and_names_the_fix(join_results):
    for rank, res in enumerate(join_results):
        assert f"rank {rank} ran a forward" in res["two_forwards"]
        assert "torch.no_grad()" in res["two_forwards"]
        assert "ran inside no_sync()" in res["no_sync_forward_only"]
        assert "exhausted" in res["throw"]


def _uneven_without_join():
    r = dist.get_rank()
    model = DDP(_net(), message_size=30)
    for x, y in _batches(5 if r == 0 else 3, seed=10 + r):
        _loss(model, x, y).backward()


def test_uneven_inputs_without_join_fail_fast_naming_rank_and_batch():
    t0 = time.monotonic()
    with pytest.raises(RankError) as info:
        launch(_uneven_without_join, 2, backend="gloo", timeout=60, threads=1)
    assert time.monotonic() - t0 < 20  # not the 60 s of the launch's timeout
    assert info.value.rank == 0
    msg = str(info.value)
    assert "uneven inputs" in msg and "rank 0 waits" in msg and "its batch 4" in msg
    assert "rank(s) 1 already" in msg and "after the 3 batch(es)" in msg
    assert "with model.join():" in msg
