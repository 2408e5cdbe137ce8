"""MXFP4: E2M1 in blocks of 32 with E8M0 scales, FLOOR and RCEIL, against torchao bit for bit;
stochastic rounding and the RHT of Tseng et al. 2025 on the backward."""

import pytest
import torch

from mpnb.core.fp8 import hadamard, mxfp4


def _normal():
    return torch.randn(128, 256, generator=torch.Generator().manual_seed(0))


def _linear_weight():
    torch.manual_seed(0)
    return torch.nn.Linear(256, 64).weight.detach().clone()


def _edge_cases():
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(1))
    x[0] = 0.0  # a zero block: the smallest scale, zero elements
    x[1, 3] = float("nan")  # a NaN block: the NaN scale (0xFF)
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    x[2, :32] = torch.tensor([6.0] + ties + [-t for t in ties] + [-6.0] + [0.1] * 16)  # X = 1
    x[3, :32] = 0.01
    x[3, 0] = 7.5  # FLOOR: X = 1, the top saturates at 6; RCEIL: X = 2
    x[4] *= 1e6
    x[5, 32:] *= 1e-30
    return x


DATA = {"normal": _normal, "nn.Linear weight": _linear_weight, "edge cases": _edge_cases}


def _torchao(x, rounding):
    mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
    cfg = pytest.importorskip("torchao.prototype.mx_formats.config")
    mode = getattr(cfg.ScaleCalculationMode, rounding.upper())
    scales, data = mx.to_mx(x, torch.float4_e2m1fn_x2, 32, scaling_mode=mode)
    return scales.view(torch.uint8).view(x.shape[0], -1), data.view(torch.uint8)


@pytest.mark.parametrize("rounding", ["rceil", "floor"])
@pytest.mark.parametrize("data", DATA)
def test_mxfp4_equals_torchao_bitwise(data, rounding):
    x = DATA[data]()
    scales_ao, data_ao = _torchao(x, rounding)
    op = mxfp4.quantize_mxfp4(x, rounding)
    assert op.block_scale.dtype == torch.float8_e8m0fnu and op.label == f"mxfp4 ({rounding})"
    assert torch.equal(op.block_scale.view(torch.uint8), scales_ao)
    finite = (scales_ao != 255).repeat_interleave(16, 1)  # E2M1 has no NaN: the scale holds it
    assert torch.equal(op.data[finite], data_ao[finite])
    assert op.dequantize()[~finite.repeat_interleave(2, 1)].isnan().all()


def test_mxfp4_saturates_under_floor_and_clips_nothing_under_rceil():
    x = _edge_cases()[3:4]
    floor, rceil = mxfp4.quantize_mxfp4(x, "floor"), mxfp4.quantize_mxfp4(x, "rceil")
    assert floor.dequantize()[0, 0] == 6.0 and rceil.dequantize()[0, 0] == 8.0


def test_an_inf_block_gets_the_nan_scale_where_torchao_gives_a_finite_one():
    x = torch.ones(1, 32)
    x[0, 4] = float("inf")
    assert mxfp4.quantize_mxfp4(x, "floor").block_scale.view(torch.uint8).item() == 255
    assert mxfp4.quantize_mxfp4(x, "rceil").block_scale.view(torch.uint8).item() == 255
    assert _torchao(x, "floor")[0].item() == 253 and _torchao(x, "rceil")[0].item() == 254


def test_a_block_in_float32_subnormals_decodes_exactly():
    """torchao divides by 2**-126 (FLOOR) or 1 (RCEIL) where the scale is 2**-127; mpnb
    divides by the scale itself, so the block's values decode to what they were."""
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 1] = 2.0**-125, -(2.0**-126)
    op = mxfp4.quantize_mxfp4(x, "floor")
    assert op.block_scale.view(torch.uint8).item() == 0  # 2**-127
    assert torch.equal(op.dequantize(), x)


@pytest.mark.parametrize("rounding", ["rceil", "floor"])
def test_mxfp4_stochastic_rounding_is_unbiased_and_reproducible(rounding):
    row = torch.linspace(-7.9, 7.9, 32)  # FLOOR: X = 1, the top would clip without the 3/4
    x = row.repeat(10_000, 1)
    op = mxfp4.quantize_mxfp4(x, rounding, stochastic=True, generator=5)
    err = op.dequantize().double() - x.double()
    se = err.std(0) / x.shape[0] ** 0.5
    assert (err.mean(0).abs() <= 3 * se + 1e-6).all()
    assert op.tensor_divisor == (0.75 if rounding == "floor" else 1.0)
    again = mxfp4.quantize_mxfp4(x, rounding, stochastic=True, generator=5)
    assert torch.equal(op.data, again.data)


def test_mxfp4_rht_option_is_the_transform_then_the_quantization():
    x = _normal()
    h = hadamard.hadamard_matrix(32, hadamard.random_signs(32, generator=0))
    op = mxfp4.quantize_mxfp4(x, hadamard=h)
    ref = mxfp4.quantize_mxfp4(hadamard.hadamard_transform(x, h))
    assert torch.equal(op.data, ref.data) and torch.equal(op.block_scale, ref.block_scale)


def test_mxfp4_inputs_are_checked():
    with pytest.raises(ValueError, match="multiple of 32"):
        mxfp4.quantize_mxfp4(torch.ones(2, 48))
    with pytest.raises(ValueError, match="'rceil'.*'floor'"):
        mxfp4.quantize_mxfp4(torch.ones(2, 32), "nearest")
    with pytest.raises(ValueError, match="2-D"):
        mxfp4.quantize_mxfp4(torch.ones(32))
    with pytest.raises(TypeError, match="floating"):
        mxfp4.quantize_mxfp4(torch.ones(2, 32, dtype=torch.int32))
    with pytest.raises(TypeError, match="generator"):
        mxfp4.quantize_mxfp4(torch.ones(2, 32), stochastic=True)
