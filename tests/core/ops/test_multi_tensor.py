"""Multi-tensor ops: the compiled kernels against their references, Apex's flag semantics,
hypothesis-placed infs/NaNs, errors, and the PyTorch-ops paths that serve CUDA. (The op-table
test runs every op x dtype x {kernel, reference} and opcheck.)"""

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
_torch_check_finite = ops.op_info("multi_tensor_check_finite").torch_path

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


# ---- scale --------------------------------------------------------------------------------


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
    out = [torch.zeros_like(t) for t in src]
    ops.multi_tensor_axpby(f, src, src, out, 1.0, 1.0, -1)
    assert f.item() == 1 and torch.equal(out[1], src[1] + src[1])
    total, _ = ops.multi_tensor_l2norm(f, src)
    assert f.item() == 1 and total.item() > 0


def test_float_flag_dtype(kernels):
    found = torch.zeros(1, dtype=torch.float32)
    src = [torch.tensor([1.0, math.nan])]
    ops.multi_tensor_check_finite(found, src)
    assert found.item() == 1.0


# ---- axpby --------------------------------------------------------------------------------

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


# ---- l2norm -------------------------------------------------------------------------------


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


# ---- check finite -------------------------------------------------------------------------


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


# ---- update_scale_hysteresis --------------------------------------------------------------


def _state(scale=65536.0, growth=0, hyst=2):
    return (
        torch.tensor([scale]),
        torch.tensor([growth], dtype=torch.int32),
        torch.tensor([hyst], dtype=torch.int32),
    )


@pytest.mark.parametrize("hysteresis", [1, 2, 4])
def test_update_scale_hysteresis_sequence(kernels, hysteresis):
    g = torch.Generator().manual_seed(hysteresis)
    k, r = _state(hyst=hysteresis), _state(hyst=hysteresis)
    for _ in range(300):
        found = torch.tensor([float(torch.rand(1, generator=g).item() < 0.3)])
        ops.update_scale_hysteresis(*k, found, 2.0, 0.5, 3, hysteresis)
        mt.reference_update_scale_hysteresis(*r, found, 2.0, 0.5, 3, hysteresis)
        for a, b in zip(k, r, strict=True):
            assert torch.equal(a, b)


def test_update_scale_hysteresis_one_is_gradscaler(kernels):
    g = torch.Generator().manual_seed(0)
    scale, growth, hyst = _state(hyst=1)
    t_scale, t_growth = scale.clone(), growth.clone()
    for _ in range(200):
        found = torch.tensor([float(torch.rand(1, generator=g).item() < 0.2)])
        ops.update_scale_hysteresis(scale, growth, hyst, found, 2.0, 0.5, 4, 1)
        torch._amp_update_scale_(t_scale, t_growth, found, 2.0, 0.5, 4)
        assert torch.equal(scale, t_scale) and torch.equal(growth, t_growth)


def test_update_scale_hysteresis_semantics(kernels):
    scale, growth, hyst = _state(scale=8.0, growth=5, hyst=2)
    inf = torch.ones(1)
    ops.update_scale_hysteresis(scale, growth, hyst, inf, 2.0, 0.5, 10, 2)
    assert (scale.item(), growth.item(), hyst.item()) == (8.0, 0, 1)  # held by hysteresis
    ops.update_scale_hysteresis(scale, growth, hyst, inf, 2.0, 0.5, 10, 2)
    assert (scale.item(), growth.item(), hyst.item()) == (4.0, 0, 0)  # backed off
    ops.update_scale_hysteresis(scale, growth, hyst, torch.zeros(1), 2.0, 0.5, 1, 2)
    assert (scale.item(), growth.item(), hyst.item()) == (8.0, 0, 2)  # grew, hysteresis refilled
    huge = _state(scale=3e38, hyst=1)
    ops.update_scale_hysteresis(*huge, torch.zeros(1), 2.0, 0.5, 1, 1)
    assert huge[0].item() == pytest.approx(3e38)  # never grows to inf


# ---- update_loss_scale_: the rule, the clamp and the inverse in one op -----------------------


@pytest.mark.parametrize(("lo", "hi"), [(0.0, 2.0**24), (2.0, 64.0), (1.0, 1.0)])
def test_update_loss_scale_sequence_matches_reference(kernels, lo, hi):
    g = torch.Generator().manual_seed(int(hi))
    k = (*_state(scale=16.0, hyst=2), torch.empty(1))
    r = (*_state(scale=16.0, hyst=2), torch.empty(1))
    for _ in range(300):
        found = torch.tensor([float(torch.rand(1, generator=g).item() < 0.4)])
        ops.update_loss_scale_(k[0], k[3], k[1], k[2], found, 2.0, 0.5, 2, 2, lo, hi)
        mt.reference_update_loss_scale_(r[0], r[3], r[1], r[2], found, 2.0, 0.5, 2, 2, lo, hi)
        for a, b in zip(k, r, strict=True):
            assert torch.equal(a, b)
        assert lo <= k[0].item() <= hi and k[3].item() == 1.0 / k[0].item()


def test_update_loss_scale_is_the_three_calls_it_replaces(kernels):
    g = torch.Generator().manual_seed(3)
    scale, growth, hyst = _state(scale=3.0, hyst=1)
    inv = torch.empty(1)
    t_scale, t_growth, t_hyst = (t.clone() for t in (scale, growth, hyst))
    for _ in range(200):
        found = torch.tensor([float(torch.rand(1, generator=g).item() < 0.3)])
        ops.update_loss_scale_(scale, inv, growth, hyst, found, 2.0, 0.5, 3, 1, 0.75, 96.0)
        ops.update_scale_hysteresis(t_scale, t_growth, t_hyst, found, 2.0, 0.5, 3, 1)
        t_scale.clamp_(0.75, 96.0)
        assert torch.equal(scale, t_scale) and torch.equal(growth, t_growth)
        assert torch.equal(inv, torch.reciprocal(t_scale))


@pytest.mark.parametrize("path", ["kernel", "reference"])
def test_update_loss_scale_errors(kernels, path):
    with _on(path):
        _update_loss_scale_errors(ops.update_loss_scale_)


def _on(path):
    """The block runs the C++ kernels (``kernel``) or the references behind their check."""
    return ops.use_reference() if path == "reference" else contextlib.nullcontext()


def _update_loss_scale_errors(fn):
    scale, growth, hyst = _state()
    with pytest.raises(TypeError, match="inv_scale must be a one-element float32"):
        fn(
            scale,
            torch.empty(1, dtype=torch.float64),
            growth,
            hyst,
            flag(),
            2.0,
            0.5,
            10,
            1,
            0.0,
            1.0e6,
        )
    with pytest.raises(ValueError, match="min_scale <= max_scale"):
        fn(scale, torch.empty(1), growth, hyst, flag(), 2.0, 0.5, 10, 1, 8.0, 4.0)
    with pytest.raises(TypeError, match="growth_tracker must be a one-element int32"):
        fn(scale, torch.empty(1), growth.float(), hyst, flag(), 2.0, 0.5, 10, 1, 0.0, 1.0e6)


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
    axpby = ops.multi_tensor_axpby
    with pytest.raises(ValueError, match="arg_to_check"):
        axpby(flag(), a, a, a, 1.0, 1.0, 2)


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
