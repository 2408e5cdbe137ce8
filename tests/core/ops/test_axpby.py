"""``mpnb::multi_tensor_axpby`` (``mpnb/core/ops/axpby.py``): ``out = a*x + b*y`` over lists,
the kernel against its reference bitwise on every dtype triple, ``arg_to_check`` choosing which
inputs set the flag, a set flag left set, and a bad ``arg_to_check`` refused."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from mpnb.core import ops
from tests.core.ops.test_scale import HALF_FLOAT, SIZES, _on, assert_same, flag, ids, make

mt = ops  # the references are exported beside the wrappers


AXPBY_TYPES = [*itertools.product(HALF_FLOAT, repeat=3), (torch.float64,) * 3]


@pytest.mark.parametrize("dx,dy,do", AXPBY_TYPES, ids=ids)
def test_axpby_matches_reference_bitwise(kernels, dx, dy, do):
    x, y = make(SIZES[:6], dx, seed=1), make(SIZES[:6], dy, seed=2)
    ok = [torch.empty_like(t, dtype=do) for t in x]
    orf = [torch.empty_like(t, dtype=do) for t in x]
    ops.multi_tensor_axpby(flag(), x, y, ok, 0.3, -1.7, -1)
    mt.reference_multi_tensor_axpby(flag(), x, y, orf, 0.3, -1.7, -1)
    assert_same(ok, orf)


@pytest.mark.parametrize(
    "arg,in_x,in_y",
    [(-1, 1, 1), (-1, 1, 0), (-1, 0, 1), (0, 1, 0), (0, 0, 1), (1, 0, 1), (1, 1, 0)],
)
def test_axpby_arg_to_check(kernels, arg, in_x, in_y):
    x, y = make([50, 40000], torch.float32), make([50, 40000], torch.float32, seed=3)
    if in_x:
        x[1][123] = math.inf
    if in_y:
        y[0][7] = math.nan
    expect = int((arg in (-1, 0) and in_x) or (arg in (-1, 1) and in_y))
    fk, fr = flag(), flag()
    ops.multi_tensor_axpby(fk, x, y, [torch.empty_like(t) for t in x], 1.0, 2.0, arg)
    mt.reference_multi_tensor_axpby(fr, x, y, [torch.empty_like(t) for t in x], 1.0, 2.0, arg)
    assert fk.item() == fr.item() == expect


def test_a_set_flag_still_writes_and_stays_set(kernels):
    """As Apex's kernel: a set flag skips nothing and is never cleared."""
    src = make([10, 40000], torch.float32)
    out = [torch.zeros_like(t) for t in src]
    f = torch.ones(1, dtype=torch.int32)
    ops.multi_tensor_axpby(f, src, src, out, 1.0, 1.0, -1)
    assert f.item() == 1 and torch.equal(out[1], src[1] + src[1])


@pytest.mark.parametrize("path", ["kernel", "reference"])
def test_a_bad_arg_to_check_is_refused(kernels, path):
    a = [torch.ones(4), torch.ones(5)]
    with _on(path), pytest.raises(ValueError, match="arg_to_check"):
        ops.multi_tensor_axpby(flag(), a, a, a, 1.0, 1.0, 2)
