"""``mpnb::multi_tensor_check_finite`` (``mpnb/core/ops/check_finite.py``): hypothesis-placed
infs/NaNs set the flag as the reference does and leave the tensors as they were, a float flag
works, and the PyTorch-ops path that serves CUDA takes PyTorch's op only for the dtypes that op
takes."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mpnb.core import ops
from tests.core.ops.test_scale import HALF_FLOAT, assert_same, flag, ids, make, nonfinite

mt = ops  # the references are exported beside the wrappers
# The PyTorch-ops path that serves CUDA tensors, as the dispatcher calls it (positional).
_torch_check_finite = ops.op_info("multi_tensor_check_finite").torch_path


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 70000), min_size=0, max_size=5),
    dtype=st.sampled_from([*HALF_FLOAT, torch.float64]),
    plant=st.lists(
        st.tuples(st.integers(0, 4), st.floats(0, 1, exclude_max=True), nonfinite), max_size=2
    ),
)
def test_check_finite(kernels, sizes, dtype, plant):
    xs = make(sizes, dtype, seed=6)
    planted = False
    for ti, pos, val in plant:
        if ti < len(xs) and xs[ti].numel():
            xs[ti][int(pos * xs[ti].numel())] = val
            planted = True
    before = [x.clone() for x in xs]
    fk, fr = flag(), flag()
    ops.multi_tensor_check_finite(fk, xs)
    mt.reference_multi_tensor_check_finite(fr, xs)
    assert fk.item() == fr.item() == int(planted)
    assert_same(xs, before)


def test_float_flag_dtype(kernels):
    found = torch.zeros(1, dtype=torch.float32)
    src = [torch.tensor([1.0, math.nan])]
    ops.multi_tensor_check_finite(found, src)
    assert found.item() == 1.0


@pytest.mark.parametrize("dtype", HALF_FLOAT, ids=ids)
def test_foreach_check_finite_path(dtype):
    xs = make([7, 3000], dtype, seed=9)
    before = [x.clone() for x in xs]
    f = flag()
    _torch_check_finite(f, xs)
    assert f.item() == 0
    assert_same(xs, before)  # unscaling by 1.0 preserves every bit
    xs[1][17] = math.nan
    _torch_check_finite(f, xs)
    assert f.item() == 1


@pytest.mark.parametrize("din", [torch.float32, torch.float16, torch.bfloat16], ids=ids)
@pytest.mark.parametrize("plant", [None, math.inf, math.nan])
def test_check_finite_cuda_path_takes_torch_op_only_for_its_dtypes(din, plant, monkeypatch):
    """The CUDA kernel of check_finite, run on CPU tensors against a stand-in for PyTorch's
    CUDA op that refuses bf16 as that op does (seen on an H100, torch 2.11): bf16 goes to the
    reference, fp32/fp16 to the op, and the flag is right either way."""
    from mpnb.core.ops import check_finite

    real, seen = torch._amp_foreach_non_finite_check_and_unscale_, []

    def cuda_like(tensors, found, inv):
        seen.append(tensors[0].dtype)
        if tensors[0].dtype == torch.bfloat16:
            raise NotImplementedError("not implemented for 'BFloat16'")
        real(tensors, found, inv)

    monkeypatch.setattr(torch, "_amp_foreach_non_finite_check_and_unscale_", cuda_like)
    src = make([5, 70000], din, seed=11)
    if plant is not None:
        src[1][9] = plant
    f = flag()
    check_finite._torch_multi_tensor_check_finite(check_finite.OP.Args(f, src))
    assert f.item() == (plant is not None)
    assert seen == ([] if din == torch.bfloat16 else [din])
