"""Apex's ``Reducer`` (:mod:`mpnb.core.parallel.reducer`) on 2 gloo ranks: the module's params
are broadcast from rank 0 when it is built, and :meth:`~mpnb.parallel.Reducer.reduce` averages
the gradients over the ranks, a module's (missing grads reduced as zeros) or a list's."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mpnb.parallel import Reducer, launch

pytestmark = pytest.mark.dist


def _mean_over_ranks(t: torch.Tensor) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return torch.stack([p.double() for p in parts]).mean(0)


def _ranks() -> dict:
    rank = dist.get_rank()
    torch.manual_seed(rank)  # each rank starts from weights of its own
    net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2), torch.nn.Linear(4, 1))
    reducer = Reducer(net)  # rank 0's weights reach every rank here
    weights = torch.cat([p.detach().flatten() for p in net.parameters()])
    same_weights = torch.equal(_mean_over_ranks(weights), weights.double())
    x = torch.randn(5, 4)
    net[1](net[0](x)).pow(2).sum().backward()  # net[2] gets no grad on any rank
    local = [p.grad.clone() for p in net[:2].parameters()]
    reducer.reduce()
    module_err = max(
        (p.grad.double() - _mean_over_ranks(g)).abs().max().item()
        for p, g in zip(net[:2].parameters(), local, strict=True)
    )
    unused = [p.grad for p in net[2].parameters()]
    grads = [torch.full((3,), float(rank + 1)), torch.full((2, 2), 4.0 * rank).bfloat16()]
    Reducer(grads).reduce()  # in place, one all-reduce per dtype
    return {
        "same_weights": same_weights,
        "module_err": module_err,
        "unused_zero": all(g is not None and not g.any() for g in unused),
        "list": [g.float().tolist() for g in grads],
        "dtypes": [g.dtype for g in grads],
    }


@pytest.fixture(scope="module")
def results():
    return launch(_ranks, 2, backend="gloo", timeout=120, threads=1)


def test_the_module_is_broadcast_from_rank_0_at_construction(results):
    assert all(r["same_weights"] for r in results)


def test_reduce_averages_a_modules_grads_and_zero_fills_the_missing(results):
    for r in results:
        assert r["module_err"] <= 1e-6
        assert r["unused_zero"]


def test_reduce_averages_a_list_in_place_keeping_its_dtypes(results):
    for r in results:
        assert r["list"] == [[1.5] * 3, [[2.0, 2.0], [2.0, 2.0]]]
        assert r["dtypes"] == [torch.float32, torch.bfloat16]


def test_a_reducer_needs_a_process_group():
    with pytest.raises(RuntimeError, match="init_process_group"):
        Reducer(torch.nn.Linear(2, 2))
