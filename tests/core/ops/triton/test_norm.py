"""The Triton norm kernels (``mpnb/core/ops/triton/_norm.py``, behind layer norm and RMS norm)
against their references (CPU interpreter, or the GPU when there is one): fp32, fp16, bf16 (and
fp64), odd and empty shapes, rows longer than one block, inf/NaN at random positions."""

from __future__ import annotations

import pytest
import torch

import mpnb.core.ops as N

from .triton_cases import close, gen, kernel, on, poison, randn

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
