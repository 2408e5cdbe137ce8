"""The reworked layer norm and RMS norm kernels: every stated config against the reference,
narrow rows with many rows per program, rows at and past one block, non-contiguous input, and
the backward's two-stage weight and bias gradients (their documented order, bit for bit, and
the same bits on every run)."""

from __future__ import annotations

import importlib

import pytest
import torch

import mpnb.core.ops as N

from .triton_cases import bitwise, close, gen, kernel, on, randn

HALF_OR_32 = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture
def norm():
    """The kernel module, as the package fixture imported it (interpreted on a CPU)."""
    return importlib.import_module("mpnb.core.ops.triton._norm")


@pytest.fixture
def tune():
    return importlib.import_module("mpnb.core.ops.triton._tune")


def _run(device, rms, x, w, b, me, dy):
    """Forward and backward through the Triton launchers, and the references' results."""
    shape = [x.shape[-1]]
    aff = (w,) if rms else (w, b)
    ref_fwd = N.reference_rms_norm_fwd if rms else N.reference_layer_norm_fwd
    ref_bwd = N.reference_rms_norm_bwd if rms else N.reference_layer_norm_bwd
    fwd = kernel("rms_norm_fwd" if rms else "layer_norm_fwd")
    bwd = kernel("rms_norm_bwd" if rms else "layer_norm_bwd")
    dev_aff = [None if a is None else a.to(device) for a in aff]
    want = ref_fwd(x, shape, *aff, 1e-5, me)
    got = fwd(on(device, x), shape, *dev_aff, 1e-5, me)
    saved = want[0] if me else x
    want_g = ref_bwd(dy, saved, *want[1:], shape, *aff, me)
    got_g = bwd(*on(device, [dy, saved, *want[1:]]), shape, *dev_aff, me)
    return list(got), list(want), list(got_g), list(want_g)


def _check(device, ulps, rms, rows, cols, dtype, me=False, seed=40):
    g = gen(seed)
    x = randn((rows, cols), dtype, g, 2.0) + 0.5
    w = (torch.rand(cols, generator=g) + 0.5).to(dtype)
    b = randn(cols, dtype, g)
    dy = randn((rows, cols), dtype, g)
    got, want, got_g, want_g = _run(device, rms, x, w, b, me, dy)
    close(got, want, ulps)
    close(got_g[0], want_g[0], 2 * ulps)
    # dw and db sum over rows in another order than the reference's: off by a few ulps of the
    # sum of the terms' magnitudes (the sum itself may cancel to far less)
    xhat = x.float() * want[-1][:, None]
    if not rms:
        xhat = (x.float() - want[1][:, None]) * want[-1][:, None]
    terms = [dy.float() * xhat] + ([] if rms else [dy.float()])
    for got_t, want_t, t in zip(got_g[1:], want_g[1:], terms, strict=True):
        bound = float(t.abs().sum(0).max()) * torch.finfo(dtype).eps
        torch.testing.assert_close(
            got_t.cpu(), want_t, rtol=4 * ulps * torch.finfo(dtype).eps, atol=4 * ulps * bound
        )


# ---- the stated config sets -----------------------------------------------------------------


def test_config_sets_are_the_stated_ones(tune, norm):
    """The sets the docstrings state, in that order (the first is the interpreter's)."""
    rows = [({"TILE": 4096}, 8), ({"TILE": 2048}, 4), ({"TILE": 8192}, 16)]
    loops = [({"BLOCK": 1024}, 4), ({"BLOCK": 2048}, 8), ({"BLOCK": 4096}, 8)]
    assert tune.configs_of(tune.ROW_CONFIGS) == rows
    assert tune.configs_of(tune.LOOP_CONFIGS) == loops
    assert tune.configs_of(norm.BWD_CONFIGS) == [({}, 8), ({}, 4), ({}, 16)]
    for kw, nw in rows + loops:
        ((name, value),) = kw.items()
        assert f"{name}={value} num_warps={nw}" in tune.__doc__
    assert "num_warps=8 | num_warps=4 | num_warps=16" in norm.__doc__


def test_kernels_tune_over_their_sets(device, tune, norm):
    """Each kernel tunes over its set on a GPU; interpreted, it keeps the first config only."""
    sets = {
        norm._fwd_fused: tune.ROW_CONFIGS,
        norm._fwd_looped: tune.LOOP_CONFIGS,
        norm._bwd_fused: norm.BWD_CONFIGS,
        norm._bwd_looped: tune.LOOP_CONFIGS,
    }
    for k, configs in sets.items():
        want = list(configs) if device == "cuda" else list(configs[:1])
        assert k.configs == want, k.fn.__name__
        assert k.keys == ["cols"]


@pytest.mark.parametrize("rms", [False, True], ids=["layer", "rms"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_config_matches_reference(device, ulps, monkeypatch, norm, tune, rms, dtype):
    """Each config run alone (the tuner may pick any of them on a GPU)."""
    for config in tune.ROW_CONFIGS:
        monkeypatch.setattr(norm._fwd_fused, "configs", [config])
        _check(device, ulps, rms, 37, 24, dtype)
    for config in norm.BWD_CONFIGS:
        monkeypatch.setattr(norm._bwd_fused, "configs", [config])
        _check(device, ulps, rms, 37, 24, dtype, me=True)
    for config in tune.LOOP_CONFIGS:
        monkeypatch.setattr(norm._fwd_looped, "configs", [config])
        monkeypatch.setattr(norm._bwd_looped, "configs", [config])
        _check(device, ulps, rms, 2, norm.BWD_FUSED + 5, dtype)


# ---- shapes ---------------------------------------------------------------------------------

# (rows, cols): one column; narrow rows, many per program, the last program partly empty;
# odd widths.
SHAPES = [(9, 1), (1001, 3), (70, 33), (13, 1000)]


@pytest.mark.parametrize("rms", [False, True], ids=["layer", "rms"])
@pytest.mark.parametrize("dtype", HALF_OR_32)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_shapes_match_reference(device, ulps, rms, dtype, shape):
    for me in (False, True):
        _check(device, ulps, rms, *shape, dtype, me=me)


@pytest.mark.parametrize("rms", [False, True], ids=["layer", "rms"])
@pytest.mark.parametrize("cols", [8192, 8193], ids=["widest-block", "first-looped"])
def test_wide_rows_match_reference(device, ulps, rms, cols):
    _check(device, ulps, rms, 2, cols, torch.float16, me=True)


def test_layout_of_the_backward(norm):
    """Tiles of BWD_TILE elements (one row past BWD_FUSED), at most MAX_PROGS programs."""
    assert norm.bwd_layout(16384, 768) == (2, 256)
    assert norm.bwd_layout(5, 3) == (512, 1)
    assert norm.bwd_layout(3000, 24) == (64, 47)
    assert norm.bwd_layout(100, norm.BWD_FUSED) == (1, 100)
    assert norm.bwd_layout(1000, norm.BWD_FUSED + 1) == (1, 256)
    assert norm.bwd_layout(0, 8) == (256, 1)


@pytest.mark.parametrize("rms", [False, True], ids=["layer", "rms"])
def test_non_contiguous_input(device, ulps, rms):
    g = gen(41)
    big = randn((12, 50), torch.bfloat16, g, 2.0)
    x = big.to(device)[:, 3:40:2].t()  # [19, 12], neither row nor column contiguous
    assert not x.is_contiguous()
    w = (torch.rand(12, generator=g) + 0.5).to(torch.bfloat16)
    b = randn(12, torch.bfloat16, g)
    dy = randn((19, 12), torch.bfloat16, g).to(device).t().contiguous().t()
    got, want, got_g, want_g = _run(device, rms, x, w, b, False, dy)
    close(got, want, ulps)
    close(got_g, want_g, 4 * ulps)


# ---- the weight and bias gradients: two stages, in a fixed order ----------------------------


def _documented_sums(norm, contrib: torch.Tensor) -> torch.Tensor:
    """The column sums of ``contrib`` (one row per input row) in the order the module
    docstring states: per program its tiles' rows elementwise, folded pairwise, then the
    programs' partial rows one after another."""
    rows, cols = contrib.shape
    per, nprog = norm.bwd_layout(rows, cols)
    ntiles = -(-rows // per)
    padded = torch.zeros(ntiles * per, cols, dtype=contrib.dtype)
    padded[:rows] = contrib
    tiles = padded.view(ntiles, per, cols)
    total = torch.zeros(cols, dtype=contrib.dtype)
    for p in range(nprog):
        acc = torch.zeros(per, cols, dtype=contrib.dtype)
        for t in range(p, ntiles, nprog):
            acc = acc + tiles[t]
        while acc.shape[0] > 1:
            half = acc.shape[0] // 2
            acc = acc[:half] + acc[half:]
        total = total + acc[0]
    return total


# (rows, cols, most programs): tiles of 64 rows on 24 programs; with a few programs (each then
# walks several tiles, as large inputs do on MAX_PROGS programs): tiles of 64 rows, of one
# row, and looped rows.
MANY_ROWS = [(1500, 24, None), (600, 24, 8), (50, 1500, 8), (6, 8200, 4)]


@pytest.mark.parametrize("shape", MANY_ROWS, ids=str)
def test_weight_grads_in_the_documented_order(device, monkeypatch, norm, shape):
    """fp32 dw and db equal, bit for bit, the sums in the stated order, on every run."""
    rows, cols, most = shape
    if most is not None:
        monkeypatch.setattr(norm, "MAX_PROGS", most)
        assert norm.bwd_layout(rows, cols)[1] == most
    g = gen(42)
    x = randn((rows, cols), torch.float32, g, 2.0)
    w = torch.rand(cols, generator=g) + 0.5
    b = randn(cols, torch.float32, g)
    dy = randn((rows, cols), torch.float32, g)
    y, mean, rstd = N.reference_layer_norm_fwd(x, [cols], w, b, 1e-5)
    bwd = kernel("layer_norm_bwd")
    args = on(device, [dy, x, mean, rstd])
    first = bwd(*args, [cols], w.to(device), b.to(device), False)
    again = bwd(*args, [cols], w.to(device), b.to(device), False)
    bitwise(list(again), [t.cpu() for t in first])
    xhat = (x - mean[:, None]) * rstd[:, None]
    bitwise(first[1], _documented_sums(norm, dy * xhat))
    bitwise(first[2], _documented_sums(norm, dy))
    want = N.reference_layer_norm_bwd(dy, x, mean, rstd, [cols], w, b)
    close(list(first), list(want), 8.0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_weight_grads_many_rows(device, ulps, monkeypatch, norm, dtype):
    """Many rows of a half input, programs walking several tiles: fp32 partial sums, one
    rounding to the weight's dtype."""
    monkeypatch.setattr(norm, "MAX_PROGS", 8)
    _check(device, ulps, True, 500, 40, dtype)
    _check(device, ulps, False, 500, 40, dtype, me=True)
