"""Triton layer norm, RMS norm, scaled (masked, causal) softmax and RoPE against their references
(CPU interpreter, or the GPU when there is one): fp32, fp16, bf16 (and fp64), odd and empty
shapes, rows longer than one block, inf/NaN at random positions."""

from __future__ import annotations

import itertools

import pytest
import torch

import mpnb.core.ops as N
import mpnb.core.ops as R
import mpnb.core.ops as S

from .triton_cases import bitwise, close, gen, kernel, on, poison, randn

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
HALF_OR_32 = [torch.float32, torch.float16, torch.bfloat16]

# ---- layer norm and RMS norm ---------------------------------------------------------------

# (input shape, normalized_shape): odd sizes, two normalized dims, empty, one column, and rows
# longer than one block (forward and backward walk rows past 8192).
NORM_SHAPES = [((3, 5, 7), [7]), ((2, 3, 11), [3, 11]), ((0, 6), [6]), ((5, 1), [1])]
LONG_ROW = ((2, 8200), [8200])


def _affine(cols, dtype, g, bias=True):
    w = (torch.rand(cols, generator=g) + 0.5).to(dtype)
    b = randn(cols, dtype, g) if bias else None
    return w, b


def _norm_case(device, ulps, rms, x, shape, w, b, me):
    fwd = "rms_norm_fwd" if rms else "layer_norm_fwd"
    bwd = "rms_norm_bwd" if rms else "layer_norm_bwd"
    ref_fwd = N.reference_rms_norm_fwd if rms else N.reference_layer_norm_fwd
    ref_bwd = N.reference_rms_norm_bwd if rms else N.reference_layer_norm_bwd
    aff = (w,) if rms else (w, b)
    dev_aff = [None if a is None else a.to(device) for a in aff]
    want = ref_fwd(x, shape, *aff, 1e-5, me)
    got = kernel(fwd)(x.to(device), shape, *dev_aff, 1e-5, me)
    close(list(got), list(want), ulps)
    dy = randn(x.shape, x.dtype, gen(7))
    saved = want[0] if me else x
    stats = list(want[1:])
    want_g = ref_bwd(dy, saved, *stats, shape, *aff, me)
    got_g = kernel(bwd)(*on(device, [dy, saved, *stats]), shape, *dev_aff, me)
    # The weight and bias gradients sum over rows: their order differs from the reference's.
    close(list(got_g), list(want_g), 4 * ulps)


@pytest.mark.parametrize("rms", [False, True], ids=["layer", "rms"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", NORM_SHAPES, ids=lambda s: str(s[0]))
def test_norm_matches_reference(device, ulps, rms, dtype, shape):
    g = gen(10)
    xs, ns = shape
    x = randn(xs, dtype, g, 3.0) + 1
    cols = xs[-1] * (xs[-2] if len(ns) == 2 else 1)
    w, b = _affine(cols, dtype, g)
    w, b = w.view(ns), b.view(ns)
    for me in (False, True):
        _norm_case(device, ulps, rms, x, ns, w, b, me)


@pytest.mark.parametrize("rms", [False, True], ids=["layer", "rms"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_norm_mixed_fp32_params_and_no_params(device, ulps, rms, dtype):
    g = gen(11)
    x = randn((4, 33), dtype, g, 2.0)
    w, b = _affine(33, torch.float32, g)
    _norm_case(device, ulps, rms, x, [33], w, b, True)
    _norm_case(device, ulps, rms, x, [33], None, None, False)


@pytest.mark.parametrize("rms", [False, True], ids=["layer", "rms"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_long_rows(device, ulps, rms, dtype):
    g = gen(12)
    x = randn(LONG_ROW[0], dtype, g, 2.0)
    w, b = _affine(LONG_ROW[1][0], dtype, g)
    _norm_case(device, ulps, rms, x, LONG_ROW[1], w, b, False)


@pytest.mark.parametrize("rms", [False, True], ids=["layer", "rms"])
@pytest.mark.parametrize("dtype", HALF_OR_32)
def test_norm_inf_nan_rows(device, ulps, rms, dtype):
    g = gen(13)
    x = randn((6, 19), dtype, g)
    poison([x], g)
    w, b = _affine(19, dtype, g)
    _norm_case(device, ulps, rms, x, [19], w, b, False)


def test_norm_refuses_bad_shapes(device):
    x = torch.ones(2, 3, 4, device=device)
    with pytest.raises(ValueError, match="does not end with normalized_shape"):
        kernel("layer_norm_fwd")(x, [3], None, None, 1e-5)
    with pytest.raises(ValueError, match="weight has 3 elements"):
        kernel("rms_norm_fwd")(x, [4], torch.ones(3, device=device), 1e-5)
    with pytest.raises(TypeError, match="float32 weights with a half input"):
        kernel("layer_norm_fwd")(x.half(), [4], torch.ones(4, device=device).double(), None, 1e-5)


# ---- softmax -----------------------------------------------------------------------------

SOFTMAX_SHAPES = [(2, 3, 5, 5), (1, 2, 9, 9), (2, 1, 0, 0), (1, 1, 1, 8200)]


def _row_ulps(ulps, shape):
    # A row's sum is accumulated in another order than the reference's: on rows of thousands
    # of elements its rounding reaches a few more ulps.
    return ulps * (8 if shape[-1] > 1024 else 1)


def _mask(shape, g, heads_broadcast=True):
    b, h, sq, sk = shape
    m = torch.rand(b, 1 if heads_broadcast else h, sq, sk, generator=g) > 0.6
    if m.numel():
        m[0, 0, 0, :] = True  # a fully masked row: uniform, as in Apex
    return m


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SOFTMAX_SHAPES, ids=str)
def test_softmax_forward_matches_reference(device, ulps, dtype, shape):
    ulps = _row_ulps(ulps, shape)
    g = gen(20)
    x = randn(shape, dtype, g, 3.0)
    close(
        kernel("scaled_softmax_fwd")(on(device, x), 0.3),
        S.reference_scaled_softmax_fwd(x, 0.3),
        ulps,
    )
    for bcast, zero in itertools.product((True, False), (False, True)):
        m = _mask(shape, g, bcast)  # with a fully masked row: uniform, or zero (generic)
        got = kernel("scaled_masked_softmax_fwd")(*on(device, [x, m]), 0.3, zero)
        close(got, S.reference_scaled_masked_softmax_fwd(x, m, 0.3, zero), ulps)
        if zero and m.numel():
            assert (got.cpu()[0, 0, 0] == 0).all()
    if shape[-1] == shape[-2]:
        got = kernel("scaled_upper_triang_masked_softmax_fwd")(on(device, x), 0.3)
        want = S.reference_scaled_upper_triang_masked_softmax_fwd(x, 0.3)
        close(got, want, ulps)
        assert (got.cpu().triu(1) == 0).all()  # exactly zero past the diagonal


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SOFTMAX_SHAPES, ids=str)
def test_softmax_backward_matches_reference(device, ulps, dtype, shape):
    ulps = _row_ulps(ulps, shape)
    g = gen(21)
    y = S.reference_scaled_softmax_fwd(randn(shape, dtype, g, 3.0), 1.0)
    dy = randn(shape, dtype, g)
    for upper in (False, True):
        got = kernel("scaled_softmax_bwd")(*on(device, [dy, y]), 0.3, upper)
        close(got, S.reference_scaled_softmax_bwd(dy, y, 0.3, upper), 2 * ulps)


@pytest.mark.parametrize("dtype", HALF_OR_32)
def test_softmax_inf_nan_rows(device, ulps, dtype):
    g = gen(22)
    x = randn((2, 2, 6, 6), dtype, g, 3.0)
    poison([x], g, count=4)
    m = _mask(x.shape, g)
    # The reference's straight-through gradient turns a non-finite *masked* score into NaN
    # (Apex and the kernels replace it by -10000: test_masked_softmax_ignores_masked_scores),
    # so here the masked scores are finite.
    xm = torch.where(m.expand(x.shape), torch.zeros((), dtype=dtype), x)
    close(
        kernel("scaled_softmax_fwd")(on(device, x), 0.5),
        S.reference_scaled_softmax_fwd(x, 0.5),
        ulps,
    )
    close(
        kernel("scaled_masked_softmax_fwd")(*on(device, [xm, m]), 0.5),
        S.reference_scaled_masked_softmax_fwd(xm, m, 0.5),
        ulps,
    )
    close(
        kernel("scaled_upper_triang_masked_softmax_fwd")(on(device, x), 0.5),
        S.reference_scaled_upper_triang_masked_softmax_fwd(x, 0.5),
        ulps,
    )
    dy = randn(x.shape, dtype, g)
    poison([dy], g, count=2)
    y = S.reference_scaled_softmax_fwd(x, 0.5)
    close(
        kernel("scaled_softmax_bwd")(*on(device, [dy, y]), 0.5),
        S.reference_scaled_softmax_bwd(dy, y, 0.5),
        2 * ulps,
    )


def test_masked_softmax_ignores_masked_scores(device):
    """A masked score counts as -10000 whatever it holds, inf and NaN included (Apex's rule)."""
    g = gen(23)
    x = randn((1, 2, 4, 4), torch.float32, g)
    m = _mask(x.shape, g)
    dirty = x.clone()
    dirty[m.expand(x.shape)] = float("nan")
    dirty[0, 0, 0, 0] = float("inf")
    got = kernel("scaled_masked_softmax_fwd")(*on(device, [dirty, m]), 0.7)
    bitwise(got, kernel("scaled_masked_softmax_fwd")(*on(device, [x, m]), 0.7).cpu())
    close(got, S.reference_scaled_masked_softmax_fwd(x, m, 0.7))


def test_softmax_refuses_bad_masks(device):
    x = torch.ones(2, 3, 4, 4, device=device)
    with pytest.raises(ValueError, match="does not fit scores"):
        kernel("scaled_masked_softmax_fwd")(
            x, torch.ones(2, 2, 4, 4, dtype=torch.bool, device=device), 1.0
        )
    with pytest.raises(TypeError, match="bool"):
        kernel("scaled_masked_softmax_fwd")(x, torch.ones(2, 1, 4, 4, device=device), 1.0)
    with pytest.raises(ValueError, match="square"):
        kernel("scaled_upper_triang_masked_softmax_fwd")(torch.ones(2, 3, 4, device=device), 1.0)


# ---- RoPE ----------------------------------------------------------------------------------

# (s, b, h, d, rotary dims d2, group): whole rows rotated, a partial rotary dim with the rest
# passing through, several groups, one head, empty.
ROPE = [(5, 2, 3, 8, 8, 8), (3, 1, 2, 10, 4, 2), (4, 2, 1, 12, 8, 4), (0, 2, 2, 4, 4, 4)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ROPE, ids=str)
def test_rope_matches_reference(device, ulps, dtype, case):
    s, b, h, d, d2, group = case
    g = gen(30)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    angles = torch.randn(s, d2, generator=g).to(acc)
    cos, sin = angles.cos(), angles.sin()
    inputs = [randn((s, b, h, d), dtype, g), randn((b, s, h, d), dtype, g).transpose(0, 1)]
    if dtype != torch.float64 and s:
        poison(inputs[:1], g, count=2)
    for t in inputs:
        for transpose_output in (False, True):
            for backward, stepwise in itertools.product((False, True), (False, True)):
                args = (group, transpose_output, backward, stepwise)
                got = kernel("rope")(*on(device, [t, cos, sin]), *args)
                want = R.reference_rope(t, cos, sin, *args)
                close(got, want, ulps)
                if transpose_output:  # laid out as [b, s, h, d] in memory
                    assert got.transpose(0, 1).is_contiguous()


def test_rope_refuses_bad_tables(device):
    t = torch.ones(4, 1, 2, 8, device=device)
    with pytest.raises(ValueError, match="must be a float32 table"):
        kernel("rope")(t, torch.ones(3, 8, device=device), torch.ones(3, 8, device=device), 8)
    with pytest.raises(ValueError, match="even group"):
        kernel("rope")(t, torch.ones(4, 6, device=device), torch.ones(4, 6, device=device), 4)


# [b, s, h, d] and [b, h, s, d] contiguous, and each as the strided view of another layout's
# memory (what attention code holds): (layout passed, memory made, permutation memory -> layout)
ROPE_LAYOUTS = [
    ("bshd", (2, 5, 3, 12), (0, 1, 2, 3)),
    ("bshd", (2, 3, 5, 12), (0, 2, 1, 3)),
    ("bhsd", (2, 3, 5, 12), (0, 1, 2, 3)),
    ("bhsd", (2, 5, 3, 12), (0, 2, 1, 3)),
    ("sbhd", (2, 3, 5, 12), (2, 0, 1, 3)),
]


@pytest.mark.parametrize("dtype", HALF_OR_32)
@pytest.mark.parametrize("case", ROPE_LAYOUTS, ids=str)
def test_rope_layouts_match_reference(device, ulps, dtype, case):
    layout, memory, perm = case
    g = gen(31)
    angles = torch.randn(5, 8, generator=g)
    cos, sin = angles.cos(), angles.sin()
    t = randn(memory, dtype, g).to(device).permute(perm)
    for backward, stepwise in itertools.product((False, True), (False, True)):
        args = (8, False, backward, stepwise, layout)
        got = kernel("rope")(t, *on(device, [cos, sin]), *args)
        want = R.reference_rope(t.cpu(), cos, sin, *args[:4], layout=layout)
        close(got, want, ulps)
        assert got.stride() == t.stride()  # laid out as the input
