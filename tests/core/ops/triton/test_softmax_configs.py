"""The reworked softmax kernels: every stated config against the reference (plain, masked,
all-masked-zero and causal forwards, the backward), narrow rows with many rows per program,
rows at and past one block, the long-row forward's one-sweep statistics (a lane that sees only
-inf, a maximum that keeps growing), non-contiguous input, and the same bits on every run."""

from __future__ import annotations

import importlib

import pytest
import torch

import mpnb.core.ops as S

from .triton_cases import bitwise, close, gen, kernel, on, randn

HALF_OR_32 = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture
def softmax():
    """The kernel module, as the package fixture imported it (interpreted on a CPU)."""
    return importlib.import_module("mpnb.core.ops.triton.softmax")


@pytest.fixture
def tune():
    return importlib.import_module("mpnb.core.ops.triton._tune")


def _row_ulps(ulps, k):
    # a long row's sum is accumulated in another order than the reference's
    return ulps * (8 if k > 1024 else 1)


def _mask(shape, g):
    b, _, sq, sk = shape
    m = torch.rand(b, 1, sq, sk, generator=g) > 0.6
    m[0, 0, 0, :] = True  # a fully masked row
    return m


def _check_all(device, ulps, x, g, causal=True):
    """Every forward of ``x`` ([b, h, sq, sk]) and the backward against the references."""
    ulps = _row_ulps(ulps, x.shape[-1])
    close(
        kernel("scaled_softmax_fwd")(on(device, x), 0.3),
        S.reference_scaled_softmax_fwd(x, 0.3),
        ulps,
    )
    m = _mask(x.shape, g)
    for zero in (False, True):
        got = kernel("scaled_masked_softmax_fwd")(*on(device, [x, m]), 0.3, zero)
        close(got, S.reference_scaled_masked_softmax_fwd(x, m, 0.3, zero), ulps)
    if causal and x.shape[-1] == x.shape[-2]:
        got = kernel("scaled_upper_triang_masked_softmax_fwd")(on(device, x), 0.3)
        close(got, S.reference_scaled_upper_triang_masked_softmax_fwd(x, 0.3), ulps)
    y = S.reference_scaled_softmax_fwd(x, 1.0)
    dy = randn(x.shape, x.dtype, g)
    got = kernel("scaled_softmax_bwd")(*on(device, [dy, y]), 0.3)
    close(got, S.reference_scaled_softmax_bwd(dy, y, 0.3), 2 * ulps)


def test_kernels_tune_over_their_sets(device, tune, softmax):
    """Each kernel tunes over its stated set on a GPU; interpreted, it keeps the first one."""
    sets = {
        softmax._fwd_fused: tune.ROW_CONFIGS,
        softmax._bwd_fused: tune.ROW_CONFIGS,
        softmax._fwd_looped: tune.LOOP_CONFIGS,
        softmax._bwd_looped: tune.LOOP_CONFIGS,
    }
    for k, configs in sets.items():
        want = list(configs) if device == "cuda" else list(configs[:1])
        assert k.configs == want, k.fn.__name__
        assert k.keys == ["k"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_config_matches_reference(device, ulps, monkeypatch, tune, softmax, dtype):
    """Each config run alone (the tuner may pick any of them on a GPU)."""
    g = gen(50)
    for config in tune.ROW_CONFIGS:
        monkeypatch.setattr(softmax._fwd_fused, "configs", [config])
        monkeypatch.setattr(softmax._bwd_fused, "configs", [config])
        _check_all(device, ulps, randn((2, 3, 24, 24), dtype, g, 3.0), g)
    for config in tune.LOOP_CONFIGS:
        monkeypatch.setattr(softmax._fwd_looped, "configs", [config])
        monkeypatch.setattr(softmax._bwd_looped, "configs", [config])
        _check_all(device, ulps, randn((1, 2, 2, softmax.MAX_FUSED + 9), dtype, g, 3.0), g)


# [b, h, sq, sk]: one column; narrow rows, many per program, the last program partly empty;
# odd widths; the widest one-block row; the first looped row.
SHAPES = [(1, 2, 7, 1), (3, 2, 41, 3), (2, 3, 33, 33), (1, 1, 3, 1000)]
WIDE = [(1, 1, 2, 8192), (1, 1, 2, 8193)]


@pytest.mark.parametrize("dtype", HALF_OR_32)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_shapes_match_reference(device, ulps, dtype, shape):
    g = gen(51)
    _check_all(device, ulps, randn(shape, dtype, g, 3.0), g)


@pytest.mark.parametrize("shape", WIDE, ids=["widest-block", "first-looped"])
def test_wide_rows_match_reference(device, ulps, shape):
    g = gen(52)
    _check_all(device, ulps, randn(shape, torch.float16, g, 3.0), g)


def test_one_sweep_statistics_of_long_rows(device, ulps, tune, softmax):
    """Scores that grow along the row (the running maximum rises at every step); in row 0 a
    column that is -inf in every block (a lane that never sees a finite score), in row 1 only
    in the first block (a lane that sees -inf before finite scores), whichever the block."""
    k = softmax.MAX_FUSED + 100
    x = torch.linspace(-30.0, 30.0, k).repeat(1, 1, 2, 1)
    every = tune.LOOP_CONFIGS[0].kwargs["BLOCK"]
    x[0, 0, 0, 3::every] = float("-inf")
    x[0, 0, 1, 3] = float("-inf")
    got = kernel("scaled_softmax_fwd")(on(device, x), 1.0)
    want = S.reference_scaled_softmax_fwd(x, 1.0)
    assert torch.isfinite(got.cpu()).all()
    close(got, want, _row_ulps(ulps, k))
    assert (got.cpu()[0, 0, 0, 3::every] == 0).all() and got.cpu()[0, 0, 1, 3] == 0


def test_non_contiguous_input(device, ulps):
    g = gen(53)
    base = randn((2, 9, 3, 9), torch.bfloat16, g, 3.0).to(device)
    x = base.transpose(1, 2)  # [2, 3, 9, 9] viewed across another layout
    assert not x.is_contiguous()
    close(
        kernel("scaled_upper_triang_masked_softmax_fwd")(x, 0.5),
        S.reference_scaled_upper_triang_masked_softmax_fwd(x.cpu(), 0.5),
        ulps,
    )
    y = S.reference_scaled_softmax_fwd(x.cpu(), 1.0)
    dy = randn((2, 9, 3, 9), torch.bfloat16, g).transpose(1, 2)
    close(
        kernel("scaled_softmax_bwd")(*on(device, [dy, y]), 0.5),
        S.reference_scaled_softmax_bwd(dy, y, 0.5),
        2 * ulps,
    )


@pytest.mark.parametrize("k", [40, 8200], ids=["one-block", "looped"])
def test_same_bits_on_every_run(device, k):
    g = gen(54)
    x = on(device, randn((1, 2, 3, k), torch.float32, g, 3.0))
    m = on(device, torch.rand(1, 1, 3, k, generator=g) > 0.5)
    dy = on(device, randn((1, 2, 3, k), torch.float32, g))
    first = [
        kernel("scaled_masked_softmax_fwd")(x, m, 0.5),
        kernel("scaled_softmax_bwd")(dy, x, 0.5),
    ]
    again = [
        kernel("scaled_masked_softmax_fwd")(x, m, 0.5),
        kernel("scaled_softmax_bwd")(dy, x, 0.5),
    ]
    bitwise(again, [t.cpu() for t in first])
