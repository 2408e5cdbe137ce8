"""MXFP8's E8M0 block scales: rounded up by default (RCEIL), down on request (FLOOR).

Compared with torchao's MX quantization (``torchao.prototype.mx_formats``, a test-only
dependency: these comparisons skip without it) bit for bit, in both modes.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from mpnb import fp8
from mpnb.core.precision import PRECISION_CONFIGS

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _normal():
    return torch.randn(512, 256, generator=torch.Generator().manual_seed(0))


def _linear_weight():
    torch.manual_seed(0)  # nn.Linear's default init: U(-1/sqrt(in), 1/sqrt(in)) = U(-2**-5, 2**-5)
    return torch.nn.Linear(1024, 256).weight.detach().clone()


DATA = {"normal": _normal, "nn.Linear weight": _linear_weight}


def _clipped_blocks(x, op):
    """How many blocks hold a value beyond ``fp8_max`` times the block's scale."""
    units = x.view(x.shape[0], -1, 32).abs() / op.dequant_scale.float().unsqueeze(-1)
    return int((units > fp8.fp8_max(op.data.dtype)).any(-1).sum())


def _rel_error(x, op):
    return ((op.dequantize() - x).norm() / x.norm()).item()


def test_the_mxfp8_recipe_rounds_scales_up_by_default_and_names_its_rule():
    rec = fp8.recipe("mxfp8")
    assert rec.scale_rounding == "rceil" and rec.label == "mxfp8 (rceil scales)"
    floor = fp8.recipe("mxfp8", scale_rounding="floor")
    assert floor.label == "mxfp8 (floor scales)" and "floor" in repr(floor)
    assert "RCEIL" in PRECISION_CONFIGS["mxfp8"].description
    with pytest.raises(ValueError, match="'rceil'.*'floor'"):
        fp8.MXFP8BlockScaling(scale_rounding="nearest")
    layer = fp8.Float8Linear(64, 8, recipe=floor)
    with pytest.warns(fp8.Float8FallbackWarning, match=r"\(mxfp8 \(floor scales\)\)"):
        layer(torch.randn(4, 64))


@pytest.mark.parametrize("data", DATA)
def test_rceil_clips_no_block_and_errs_less_than_floor(data):
    x = DATA[data]()
    rec = fp8.recipe("mxfp8")
    default = rec.quantize(None, x, "input", False)  # what a default MXFP8 layer does
    floor = fp8.quantize_mx(x, E4M3, "floor")
    assert _clipped_blocks(x, default) == 0
    assert _clipped_blocks(x, floor) > 0
    assert _rel_error(x, default) < _rel_error(x, floor)


@pytest.mark.parametrize("rounding", ["rceil", "floor"])
def test_a_layer_follows_the_reference_with_either_rounding(rounding):
    torch.manual_seed(0)
    layer = fp8.Float8Linear(64, 32, recipe=fp8.MXFP8BlockScaling(scale_rounding=rounding))
    x = torch.randn(16, 64, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fp8.Float8FallbackWarning)
        y = layer(x)
    gy = torch.randn_like(y)
    y.backward(gy)
    ref = fp8.reference_float8_linear(
        x.detach(),
        layer.weight.detach(),
        layer.bias.detach(),
        gy,
        (E4M3, E4M3),
        "mx",
        mx_rounding=rounding,
    )
    for got, want in zip((y, x.grad, layer.weight.grad), ref[:3], strict=False):
        assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-6)


def _edge_blocks(dtype):
    """Blocks whose amax sits within a few ulps of fp8_max * 2**k, for k over E8M0's range."""
    m = fp8.fp8_max(dtype)
    tops = []
    for k in range(-130, 112):
        t = torch.tensor(m * 2.0**k, dtype=torch.float32)
        if not 0 < t < float("inf"):
            continue
        below, above = t, t
        tops.append(t)
        for _ in range(3):
            below = torch.nextafter(below, torch.tensor(0.0))
            above = torch.nextafter(above, torch.tensor(float("inf")))
            tops += [below, above]
    x = torch.zeros(len(tops), 32)
    x[:, 0] = torch.stack(tops)
    x[:, 5] = -x[:, 0] * 0.3
    return x


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_rceil_is_exact_next_to_each_power_of_two(dtype):
    """The smallest power of two that clips nothing, also a few ulps above fp8_max * 2**k."""
    x = _edge_blocks(dtype)
    op = fp8.quantize_mx(x, dtype)
    q, scales = fp8.reference_quantize_mx(x, dtype)
    assert torch.equal(op.dequant_scale.view(torch.uint8), scales.view(torch.uint8))
    assert torch.equal(op.data.view(torch.uint8), q.view(torch.uint8))
    assert _clipped_blocks(x, op) == 0
    half = (op.dequant_scale.view(torch.uint8).int() - 128).clamp(min=-127).float().exp2()
    units = x.view(x.shape[0], 1, 32).abs() / half.unsqueeze(-1)  # one power of two less
    big = x[:, 0].abs() > fp8.fp8_max(dtype) * 2.0**-126  # where a smaller scale exists
    assert (units[big] > fp8.fp8_max(dtype)).any(-1).all()


# ---- torchao --------------------------------------------------------------------------------


def _torchao_mx(x, dtype, rounding):
    mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
    cfg = pytest.importorskip("torchao.prototype.mx_formats.config")
    mode = getattr(cfg.ScaleCalculationMode, rounding.upper())
    scales, data = mx.to_mx(x, dtype, 32, scaling_mode=mode)
    return data.view(torch.uint8), scales.view(torch.uint8).view(x.shape[0], -1)


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("rounding", ["rceil", "floor"])
@pytest.mark.parametrize("data", DATA)
def test_mx_quantization_equals_torchao_bitwise(data, rounding, dtype):
    x = DATA[data]()
    data_ao, scales_ao = _torchao_mx(x, dtype, rounding)
    op = fp8.quantize_mx(x, dtype, rounding)
    assert torch.equal(op.dequant_scale.view(torch.uint8), scales_ao)
    assert torch.equal(op.data.view(torch.uint8), data_ao)


def test_torchao_eager_rceil_differs_only_next_to_powers_of_two():
    """torchao's eager RCEIL takes ceil(log2(amax / fp8_max)) in float32, which rounds a
    quotient a few ulps above 2**k down to k: that block's top clips by those ulps. Everywhere
    else (exactly at, or below, fp8_max * 2**k) the scales agree."""
    x = _edge_blocks(E4M3)
    big = x[:, 0] >= fp8.fp8_max(E4M3) * 2.0**-126  # torchao's quotient is a float32 normal
    x = x[big]
    _, scales_ao = _torchao_mx(x, E4M3, "rceil")
    ours = fp8.quantize_mx(x, E4M3).dequant_scale.view(torch.uint8)
    differ = (ours != scales_ao).flatten()
    top_ao = fp8.fp8_max(E4M3) * (scales_ao.flatten().int() - 127).float().exp2()
    assert differ.any()
    assert torch.equal(differ, x[:, 0] > top_ao)  # they differ exactly where torchao's clips
    assert (ours.flatten()[differ] == scales_ao.flatten()[differ] + 1).all()
