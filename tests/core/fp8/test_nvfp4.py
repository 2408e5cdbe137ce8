"""NVFP4: TransformerEngine's recipe against golden vectors worked out by hand from its
formulas, torchao's variant against torchao bit for bit, SR, 2-D blocks.

The GEMM of NVFP4 operands: tests/core/fp8/test_fp4_gemm.py."""

import struct

import pytest
import torch

from mpnb.core.fp8 import fp4, hadamard, nvfp4

E4M3 = torch.float8_e4m3fn


def _f32(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def _scale_codes(op):
    return op.block_scale.view(torch.uint8).flatten().tolist()


# ---- TE: golden vectors ---------------------------------------------------------------------

# A block amax whose decode scale rounds to different E4M3 values under the two formulas, with
# global amax 1 (S_enc = 2688 / 1 = 2688, S_enc * fp32(1/6) = 448 exactly):
#   v2.14: b * (S_enc * (1/6)) = b * 448       = 1.1875 exactly, an E4M3 tie -> 1.25  (0x3A)
#   v2.13: (b / 6) * S_enc     = 1.18749988...,  just below the tie        -> 1.125 (0x39)
B = _f32(0x3B2DB6DB)  # 0.0026506695...


def _two_blocks():
    x = torch.zeros(1, 32)
    x[0, :4] = torch.tensor([1.0, 0.5, 0.25, 0.1])  # block 0: amax 1 = the global amax
    x[0, 16], x[0, 17] = B, 0.4 * B  # block 1: amax B
    return x


def test_te_block_scale_rounds_differently_under_v2_13_and_v2_14():
    x = _two_blocks()
    new = nvfp4.quantize_nvfp4(x)  # v2.14 is the default
    old = nvfp4.quantize_nvfp4(x, formula="v2.13")
    assert new.tensor_scale.item() == 1.0
    assert _scale_codes(new) == [0x7E, 0x3A]  # 448 (block 0: 1 * 448), 1.25
    assert _scale_codes(old) == [0x7E, 0x39]  # 448, 1.125
    # elements: x * min(1 / (S_dec_b * (1/S_enc)), FLT_MAX)
    #   block 0: encode ~6:      1 -> 6 (7), 0.5 -> 3 (5), 0.25 -> 1.5 (3), 0.1 -> 0.6 -> 0.5 (1)
    #   block 1, v2.14: ~2150.4: B -> 5.70 -> 6 (7), 0.4B -> 2.28 -> 2 (4)
    #   block 1, v2.13: ~2389.3: B -> 6.33 -> 6 (7), 0.4B -> 2.53 -> 3 (5)
    block0 = [0x57, 0x13] + [0] * 6
    assert new.data.flatten().tolist() == block0 + [0x47] + [0] * 7
    assert old.data.flatten().tolist() == block0 + [0x57] + [0] * 7
    want = torch.zeros(1, 32)
    want[0, :4] = torch.tensor([1.0, 0.5, 0.25, 1 / 12])  # 448 / 2688 = 1/6 per unit
    want[0, 16], want[0, 17] = 6 * 1.25 / 2688, 2 * 1.25 / 2688
    assert torch.allclose(new.dequantize(), want, rtol=1e-6, atol=0)


def test_te_zero_block_and_zero_tensor():
    x = _two_blocks()
    x[0, 16:] = 0.0
    op = nvfp4.quantize_nvfp4(x)
    assert _scale_codes(op) == [0x7E, 0x00]
    assert op.data[0, 8:].tolist() == [0] * 8
    zero = nvfp4.quantize_nvfp4(torch.zeros(2, 16))
    assert zero.tensor_scale.item() == 0.0 and _scale_codes(zero) == [0, 0]
    assert torch.equal(zero.dequantize(), torch.zeros(2, 16))
    assert nvfp4.global_encode_scale(torch.tensor(0.0)).item() == 1.0  # amax 0 -> 1
    assert nvfp4.global_encode_scale(torch.tensor(float("inf"))).item() == 1.0  # result 0 -> 1
    big = torch.finfo(torch.float32).max
    assert nvfp4.global_encode_scale(torch.tensor(1e-40)).item() == big  # 2688/1e-40 = inf


def test_te_block_scale_that_underflows_e4m3_has_no_lower_clamp():
    x = _two_blocks()
    x[0, 16:] = 0.0
    x[0, 16], x[0, 17] = 1e-6, -5e-7  # S_dec_b = 1e-6 * 448 = 4.5e-4 < 2**-10: E4M3 rounds to 0
    op = nvfp4.quantize_nvfp4(x)
    assert _scale_codes(op) == [0x7E, 0x00]
    # encode = min(1 / (0 * (1/S_enc)), FLT_MAX) = FLT_MAX: the elements saturate at +-6 ...
    assert op.data[0, 8].item() == 7 | (15 << 4)
    # ... and decode to 0 with the zero scale
    assert torch.equal(op.dequantize()[0, 16:], torch.zeros(16))


def test_te_rht_takes_the_amax_after_the_transform():
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(0))
    x[3, 7] = 40.0  # an outlier the transform spreads over its 16-block
    h = hadamard.te_rht_matrix()
    op = nvfp4.quantize_nvfp4(x, hadamard=h)
    y = hadamard.hadamard_transform(x, h)
    assert op.tensor_scale.item() == y.float().abs().max().item() < 40.0
    ref = nvfp4.quantize_nvfp4(y)
    assert torch.equal(op.data, ref.data) and torch.equal(op.block_scale, ref.block_scale)


def test_te_2d_blocks_give_identical_w_and_w_transpose_values():
    w = torch.randn(32, 48, generator=torch.Generator().manual_seed(1))
    w[5, 40] = 9.0
    rows = nvfp4.quantize_nvfp4(w, tile_rows=16)
    cols = nvfp4.quantize_nvfp4(w.T.contiguous(), tile_rows=16)
    assert torch.equal(rows.dequantize(), cols.dequantize().T)
    scales = rows.block_scale.float()
    assert torch.equal(scales, scales[::16].repeat_interleave(16, 0))  # one per 16x16 tile
    one_d = nvfp4.quantize_nvfp4(w.T.contiguous())
    assert not torch.equal(rows.dequantize(), one_d.dequantize().T)  # 1-D blocks differ


def _sr_rows(draws=10_000):
    row = torch.tensor(
        [0.3, 1.1, -1.9, 2.7, 3.2, 4.9, 5.9, -0.1, -2.2, -4.5, 0.7, 6.0, 1.3, 0, 2, 9]
    )
    return row.repeat(draws, 1)


def test_te_stochastic_rounding_is_unbiased_and_reproducible():
    x = _sr_rows()
    op = nvfp4.quantize_nvfp4(x, stochastic=True, generator=0)
    err = op.dequantize().double() - x.double()
    se = err.std(0) / x.shape[0] ** 0.5
    assert (err.mean(0).abs() <= 3 * se + 1e-6).all()
    again = nvfp4.quantize_nvfp4(x, stochastic=True, generator=0)
    assert torch.equal(op.data, again.data)
    other = nvfp4.quantize_nvfp4(x, stochastic=True, generator=1)
    assert not torch.equal(op.data, other.data)
    nearest = nvfp4.quantize_nvfp4(x)
    assert torch.equal(op.block_scale, nearest.block_scale)  # SR changes elements only


def test_nvfp4_inputs_are_checked():
    with pytest.raises(ValueError, match="multiple of 16"):
        nvfp4.quantize_nvfp4(torch.ones(2, 20))
    with pytest.raises(ValueError, match="multiple of 16"):
        nvfp4.quantize_nvfp4(torch.ones(20, 16), tile_rows=16)
    with pytest.raises(ValueError, match="tile_rows"):
        nvfp4.quantize_nvfp4(torch.ones(16, 16), tile_rows=4)
    with pytest.raises(ValueError, match="v2.14"):
        nvfp4.quantize_nvfp4(torch.ones(2, 16), formula="v3")
    with pytest.raises(ValueError, match="2-D"):
        nvfp4.quantize_nvfp4(torch.ones(16))
    with pytest.raises(TypeError, match="floating"):
        nvfp4.quantize_nvfp4(torch.ones(2, 16, dtype=torch.int64))
    with pytest.raises(TypeError, match="generator"):
        nvfp4.quantize_nvfp4(torch.ones(2, 16), stochastic=True)
    with pytest.raises(ValueError, match="seed"):
        nvfp4.quantize_nvfp4(torch.ones(2, 16), stochastic=True, generator=float("nan"))
    with pytest.raises(ValueError, match="per_tensor_scale"):
        nvfp4.quantize_nvfp4_torchao(torch.ones(2, 16), per_tensor_scale=torch.ones(2))


# ---- torchao's variant, bit for bit ---------------------------------------------------------


def _torchao(x, per_tensor_scale=None):
    ao = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor")
    scales, data = ao.nvfp4_quantize(x, 16, per_tensor_scale)
    return scales.view(torch.uint8), data.view(torch.uint8)


def _ties_block():
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    return torch.tensor([6.0] + ties + [-t for t in ties] + [-6.0])  # amax 6: scale exactly 1


def _edge_cases():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, 32, generator=g)
    x[0] = 0.0  # zeros
    x[1] *= 0.01
    x[1, 5], x[1, 20] = 1e4, -3e3  # one huge value per block
    x[2] *= 1e-3  # block amax / 6 below the smallest E4M3 normal (2**-6): subnormal scales
    x[3, :16] = torch.tensor([6.5, -7.0, 6.0, 5.99] + [0.1] * 12)  # saturation at +-6
    x[3, 16:] = _ties_block()  # every E2M1 tie
    x[4, 16] = -0.0
    x[5, 3] = float("inf")
    x[6, 30] = float("nan")
    x[7, :16] = 1e-30
    return x


def _assert_same_as_torchao(op, x, scales_ao, data_ao):
    assert torch.equal(op.block_scale.view(torch.uint8), scales_ao)
    finite = torch.isfinite(op.block_scale.float()).repeat_interleave(8, 1)
    assert torch.equal(op.data[finite], data_ao[finite])
    nan_blocks = ~torch.isfinite(op.block_scale.float()).repeat_interleave(16, 1)
    assert op.dequantize()[nan_blocks].isnan().all()  # E2M1 has no NaN: the scale holds it


DATA = {
    "normal": lambda: torch.randn(64, 128, generator=torch.Generator().manual_seed(0)),
    "bf16": lambda: torch.randn(32, 64, generator=torch.Generator().manual_seed(4)).bfloat16(),
    "edge cases": _edge_cases,
}


@pytest.mark.parametrize("data", DATA)
def test_torchao_variant_single_level_equals_torchao_bitwise(data):
    x = DATA[data]()
    scales_ao, data_ao = _torchao(x)
    op = nvfp4.quantize_nvfp4_torchao(x)
    _assert_same_as_torchao(op, x, scales_ao, data_ao)


@pytest.mark.parametrize("data", DATA)
def test_torchao_variant_two_level_equals_torchao_bitwise(data):
    x = DATA[data]()
    x = x[torch.isfinite(x.float()).all(1)]  # a per-tensor scale needs a finite amax
    ao = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor")
    pts = ao.per_tensor_amax_to_scale(x.float().abs().max())
    assert torch.equal(nvfp4.torchao_per_tensor_scale(x), pts)
    scales_ao, data_ao = _torchao(x, pts)
    op = nvfp4.quantize_nvfp4_torchao(x, per_tensor_scale=pts)
    _assert_same_as_torchao(op, x, scales_ao, data_ao)


def test_torchao_variant_clamps_small_scales_where_te_rounds_them_to_zero():
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 16] = 1.0, 2e-6  # TE: 2e-6 * 448 = 9.0e-4 < 2**-10, rounds to 0
    te = nvfp4.quantize_nvfp4(x)
    ao = nvfp4.quantize_nvfp4_torchao(x, per_tensor_scale=nvfp4.torchao_per_tensor_scale(x))
    assert te.block_scale.float()[0, 1] == 0  # no lower clamp: the block decodes to 0
    assert ao.block_scale.float()[0, 1] == torch.finfo(E4M3).tiny  # clamped to 2**-6
    assert ao.dequantize()[0, 16] > 0
    assert "torchao" in ao.label and "TE" in te.label and ao.label != te.label
    assert fp4.e2m1_to_float(fp4.unpack_e2m1(te.data))[0, 16] == 6.0
