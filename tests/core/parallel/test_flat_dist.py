"""Apex's flat collective helpers: bucketing by type, and 2 gloo ranks broadcasting and
averaging mixed-dtype tensor lists with one collective per bucket."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mpnb.core.parallel.flat_dist import (
    apply_flat_dist_call,
    flat_dist_call,
    split_by_type,
    split_half_float_double,
)
from mpnb.parallel import launch


def test_split_by_type_and_by_precision_keep_the_order():
    a, b, c, d = torch.zeros(2), torch.zeros(1).half(), torch.zeros(3), torch.zeros(1).double()
    assert split_by_type([a, b, c, d]) == {
        "torch.FloatTensor": [a, c],
        "torch.HalfTensor": [b],
        "torch.DoubleTensor": [d],
    }
    buckets = split_half_float_double([a, b, c, d, torch.zeros(1).bfloat16()])
    assert [[t.dtype for t in bk] for bk in buckets] == [
        [torch.float16],
        [torch.bfloat16],
        [torch.float32, torch.float32],
        [torch.float64],
    ]


def test_apply_flat_dist_call_refuses_a_mixed_bucket():
    with pytest.raises(ValueError, match="use flat_dist_call"):
        apply_flat_dist_call([torch.zeros(1), torch.zeros(1).half()], lambda t: None)


def _ranks():
    r = dist.get_rank()
    ts = [torch.full((3,), float(r + 1)), torch.full((2, 2), 10.0 * (r + 1)).bfloat16()]
    flat_dist_call(ts, dist.all_reduce)  # averaged, per dtype
    params = [torch.full((4,), float(r)), torch.full((1,), float(r)).double()]
    flat_dist_call(params, dist.broadcast, (0,))  # rank 0's values everywhere
    return [t.double().tolist() for t in ts], [t.tolist() for t in params]


@pytest.mark.dist
def test_flat_dist_call_on_two_ranks():
    for averaged, broadcast in launch(_ranks, 2, backend="gloo", timeout=120, threads=1):
        assert averaged == [[1.5] * 3, [[15.0, 15.0], [15.0, 15.0]]]
        assert broadcast == [[0.0] * 4, [0.0]]
