"""``mpnb::multi_tensor_l2norm`` (``mpnb/core/ops/l2norm.py``): the total and per-tensor norms
against the reference and the exact fp64 norm on every dtype, the unscaled norm reading its
input only, the empty list, and the flag set by an inf or by a norm past fp32's range."""

from __future__ import annotations

import math

import pytest
import torch

from mpnb.core import ops
from tests.core.ops.test_scale import HALF_FLOAT, SIZES, assert_same, flag, ids, make

mt = ops  # the references are exported beside the wrappers


@pytest.mark.parametrize("dtype", [*HALF_FLOAT, torch.float64], ids=ids)
@pytest.mark.parametrize("per_tensor", [False, True])
def test_l2norm_matches_reference_and_math(kernels, dtype, per_tensor):
    xs = make(SIZES, dtype, seed=4)
    tk, pk = ops.multi_tensor_l2norm(flag(), xs, per_tensor)
    tr, pr = mt.reference_multi_tensor_l2norm(flag(), xs, per_tensor)
    out_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    assert tk.shape == (1,) and tk.dtype == out_dtype
    assert pk.shape == ((len(xs),) if per_tensor else (0,))
    torch.testing.assert_close(tk, tr, rtol=1e-6, atol=0)
    torch.testing.assert_close(pk, pr, rtol=1e-6, atol=0)
    exact = torch.linalg.vector_norm(torch.cat([x.double() for x in xs]))
    torch.testing.assert_close(tk.double(), exact.reshape(1), rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=ids)
def test_unscale_l2norm(kernels, dtype):
    xs = make([3, 1000, 70000], dtype, seed=5, scale=512.0)
    inv = torch.tensor([1 / 512], dtype=torch.float32)
    before = [x.clone() for x in xs]
    tk, pk = ops.multi_tensor_l2norm(flag(), xs, True, inv)
    tr, pr = mt.reference_multi_tensor_l2norm(flag(), xs, True, inv)
    assert_same(xs, before)  # read-only
    torch.testing.assert_close(tk, tr, rtol=1e-6, atol=0)
    torch.testing.assert_close(pk, pr, rtol=1e-6, atol=0)
    plain, _ = ops.multi_tensor_l2norm(flag(), xs)
    torch.testing.assert_close(tk, plain / 512, rtol=1e-5, atol=0)


def test_l2norm_empty_list_and_flags(kernels):
    t, p = ops.multi_tensor_l2norm(flag(), [], True)
    assert t.item() == 0 and p.numel() == 0
    f = flag()
    t, p = ops.multi_tensor_l2norm(f, [torch.tensor([1.0, math.inf]), torch.ones(3)], True)
    assert f.item() == 1 and math.isinf(t.item()) and p[1].item() == pytest.approx(math.sqrt(3))
    f = flag()
    big = [torch.full((4,), 3e38)]  # the norm itself leaves the fp32 range
    t, _ = ops.multi_tensor_l2norm(f, big)
    assert f.item() == 1 and math.isinf(t.item())


def test_a_set_flag_stays_set(kernels):
    """As Apex's kernel: a set flag is never cleared, and the norm is still computed."""
    src = make([10, 40000], torch.float32)
    f = torch.ones(1, dtype=torch.int32)
    total, _ = ops.multi_tensor_l2norm(f, src)
    assert f.item() == 1
    exact = torch.linalg.vector_norm(torch.cat([x.double() for x in src]))
    torch.testing.assert_close(total.double(), exact.reshape(1), rtol=1e-6, atol=0)
