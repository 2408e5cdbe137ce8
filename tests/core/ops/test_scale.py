"""``mpnb::multi_tensor_scale`` (``mpnb/core/ops/scale.py``): the compiled kernel against its
reference on every dtype pair and size, Apex's flag semantics, hypothesis-placed infs/NaNs, the
errors, and the PyTorch-ops path that serves CUDA. (The op-table test runs every op x dtype x
{kernel, reference} and opcheck.)

The list helpers here (``make``, ``flag``, ``assert_same``...) serve the other multi-tensor ops'
unit files too (``test_axpby.py``, ``test_l2norm.py``, ``test_check_finite.py``).
"""

from __future__ import annotations

import contextlib
import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mpnb.core import ops

mt = ops  # the references are exported beside the wrappers
# The PyTorch-ops paths that serve CUDA tensors, as the dispatcher calls them (positional).
_torch_scale = ops.op_info("multi_tensor_scale").torch_path

HALF_FLOAT = (torch.float32, torch.float16, torch.bfloat16)
PAIRS = [*itertools.product(HALF_FLOAT, HALF_FLOAT), (torch.float64, torch.float64)]
# Empty, single element, odd, block tails, and sizes crossing the 32768-element chunk grid.
SIZES = [0, 1, 3, 17, 1000, 32768, 32768 * 2 + 5, 100_003]


def ids(x):
    return str(x).replace("torch.", "")


def make(sizes, dtype, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, generator=g, dtype=torch.float64) * scale).to(dtype) for n in sizes]


def flag():
    return torch.zeros(1, dtype=torch.int32)


def assert_same(a, b):
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("din,dout", PAIRS, ids=ids)
def test_scale_matches_reference_bitwise(kernels, din, dout):
    src = make(SIZES, din)
    out_k = [torch.full_like(t, 7, dtype=dout) for t in src]
    out_r = [torch.full_like(t, 7, dtype=dout) for t in src]
    fk, fr = flag(), flag()
    ops.multi_tensor_scale(fk, src, out_k, 1 / 1024)
    mt.reference_multi_tensor_scale(fr, src, out_r, 1 / 1024)
    assert_same(out_k, out_r)
    assert fk.item() == fr.item() == 0


def test_scale_reference_is_the_plain_math():
    src = make([5, 300], torch.float32)
    dst = [torch.empty_like(t, dtype=torch.bfloat16) for t in src]
    mt.reference_multi_tensor_scale(flag(), src, dst, 0.25)
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(d, (s * 0.25).bfloat16())


@pytest.mark.parametrize(
    "din,dout", [(torch.bfloat16, torch.float32), (torch.float16, torch.float32)], ids=ids
)
def test_scale_with_device_scale_tensor(kernels, din, dout):
    src = make([100, 5000], din)
    inv = torch.tensor([1 / 3], dtype=torch.float32)
    k = [torch.empty_like(t, dtype=dout) for t in src]
    r = [torch.empty_like(t, dtype=dout) for t in src]
    ops.multi_tensor_scale(flag(), src, k, 2.0, inv)
    mt.reference_multi_tensor_scale(flag(), src, r, 2.0, inv)
    assert_same(k, r)


def test_scale_in_place(kernels):
    src = make([1000, 33], torch.float32)
    expect = [t * 0.5 for t in src]
    ops.multi_tensor_scale(flag(), src, src, 0.5)
    assert_same(src, expect)


nonfinite = st.sampled_from([math.inf, -math.inf, math.nan])


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 3000), min_size=1, max_size=6),
    pair=st.sampled_from(PAIRS),
    plant=st.lists(
        st.tuples(st.integers(0, 5), st.floats(0, 1, exclude_max=True), nonfinite), max_size=3
    ),
)
def test_scale_flags_planted_nonfinite(kernels, sizes, pair, plant):
    din, dout = pair
    src = make(sizes, din, seed=len(sizes))
    planted = False
    for ti, pos, val in plant:
        if ti < len(src) and src[ti].numel():
            src[ti][int(pos * src[ti].numel())] = val
            planted = True
    out_k = [torch.zeros_like(t, dtype=dout) for t in src]
    out_r = [torch.zeros_like(t, dtype=dout) for t in src]
    fk, fr = flag(), flag()
    ops.multi_tensor_scale(fk, src, out_k, 3.0)
    mt.reference_multi_tensor_scale(fr, src, out_r, 3.0)
    assert fk.item() == fr.item() == int(planted)
    assert_same(out_k, out_r)  # infs/NaNs propagate, as in Apex


def test_flag_already_set_still_writes_and_stays_set(kernels):
    """Apex's amp_C kernels do not skip on a set flag (they propagate infs); they never clear it."""
    src = make([10, 40000], torch.float32)
    dst = [torch.zeros_like(t) for t in src]
    f = torch.ones(1, dtype=torch.int32)
    ops.multi_tensor_scale(f, src, dst, 2.0)
    assert f.item() == 1
    assert_same(dst, [t * 2 for t in src])


def _on(path):
    """The block runs the C++ kernels (``kernel``) or the references behind their check."""
    return ops.use_reference() if path == "reference" else contextlib.nullcontext()


# ---- errors -------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["kernel", "reference"])
def test_errors_name_the_problem_and_the_fix(kernels, path):
    with _on(path):
        _errors_name_the_problem_and_the_fix()


def _errors_name_the_problem_and_the_fix():
    scale = ops.multi_tensor_scale
    a = [torch.ones(4), torch.ones(5)]
    with pytest.raises(ValueError, match="equal length"):
        scale(flag(), a, [torch.ones(4)], 1.0)
    with pytest.raises(ValueError, match="same size"):
        scale(flag(), a, [torch.ones(4), torch.ones(6)], 1.0)
    with pytest.raises(ValueError, match=r"contiguous\(\)"):
        scale(flag(), [torch.ones(4, 4).t()], [torch.ones(4, 4)], 1.0)
    with pytest.raises(TypeError, match="share a dtype"):
        scale(flag(), [torch.ones(4), torch.ones(4).half()], [torch.ones(4), torch.ones(4)], 1.0)
    with pytest.raises(TypeError, match="supported dtypes"):
        scale(flag(), [torch.ones(4, dtype=torch.int64)], [torch.ones(4)], 1.0)
    with pytest.raises(TypeError, match="float64"):
        scale(flag(), [torch.ones(4, dtype=torch.float64)], [torch.ones(4)], 1.0)


# ---- the foreach paths that serve CUDA tensors (exercised here on CPU tensors) ------------


@pytest.mark.parametrize("din", HALF_FLOAT, ids=ids)
def test_foreach_scale_path_matches_reference(din):
    src = make([0, 1, 33, 5000], din, seed=8)
    src[2][5] = math.inf
    a = [torch.empty_like(t, dtype=torch.float32) for t in src]
    b = [torch.empty_like(t, dtype=torch.float32) for t in src]
    fa, fb = flag(), flag()
    _torch_scale(fa, src, a, 0.125, torch.tensor([2.0]))
    mt.reference_multi_tensor_scale(fb, src, b, 0.125, torch.tensor([2.0]))
    assert_same(a, b)
    assert fa.item() == fb.item() == 1


def test_foreach_scale_path_falls_back_to_the_reference_for_half_destinations():
    src = make([10], torch.float32)
    src[0][3] = math.nan
    out, ref = [torch.empty(10).half()], [torch.empty(10).half()]
    fa, fb = flag(), flag()
    _torch_scale(fa, src, out, 2.0)
    mt.reference_multi_tensor_scale(fb, src, ref, 2.0)
    assert_same(out, ref)
    assert fa.item() == fb.item() == 1


@pytest.mark.gpu
@pytest.mark.parametrize("din", [torch.float16, torch.bfloat16], ids=ids)
def test_cuda_scale_and_check_match_cpu(din):
    src = make([5, 70000], din, seed=10)
    src[1][9] = math.inf
    cpu_out = [torch.empty_like(t, dtype=torch.float32) for t in src]
    fc = flag()
    mt.reference_multi_tensor_scale(fc, src, cpu_out, 0.5)
    gsrc = [t.cuda() for t in src]
    gout = [torch.empty_like(t, dtype=torch.float32) for t in gsrc]
    fg = flag().cuda()
    ops.multi_tensor_scale(fg, gsrc, gout, 0.5)
    assert_same([t.cpu() for t in gout], cpu_out)
    assert fg.item() == fc.item() == 1
    fg2 = flag().cuda()
    ops.multi_tensor_check_finite(fg2, gsrc)
    assert fg2.item() == 1
