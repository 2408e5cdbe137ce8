"""The emulated four-bit GEMM ``fp4_mm`` and its operand ``FP4Operand``: per-K-block float32
accumulation with both scale levels (TransformerEngine's reference ``qgemm`` restated), the
dequantized product within float32's rounding, the chunked walk over K blocks, and the pair
checks that name the fix."""

import pytest
import torch

from mpnb.core.fp8 import fp4_gemm, mxfp4, nvfp4
from mpnb.core.fp8.fp4 import pack_e2m1
from mpnb.core.fp8.fp4_gemm import FP4Operand, fp4_mm


def _te_qgemm(a, b):
    """TE's reference qgemm restated: fp32 per 16-wide K block, both scale levels."""
    qa, qb = a.codes_as_float(), b.codes_as_float()
    sa, sb = a.block_scale.float(), b.block_scale.float()
    y = torch.zeros(qa.shape[0], qb.shape[0])
    for k in range(qa.shape[1] // 16):
        blk = slice(16 * k, 16 * k + 16)
        y += torch.outer(sa[:, k], sb[:, k]) * (qa[:, blk] @ qb[:, blk].T)
    return (a.tensor_scale * b.tensor_scale) / (6.0 * 6.0 * 448.0 * 448.0) * y  # amaxes


def test_the_gemm_accumulates_per_k_block_with_both_scale_levels():
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(24, 96, generator=g), torch.randn(40, 96, generator=g) * 0.05
    a, b = nvfp4.quantize_nvfp4(x), nvfp4.quantize_nvfp4(w, tile_rows=1)
    y = fp4_mm(a, b, torch.float32)
    assert torch.equal(y, _te_qgemm(a, b))
    exact = a.dequantize().double() @ b.dequantize().double().T
    assert torch.allclose(y.double(), exact, rtol=1e-5, atol=1e-6)
    assert fp4_mm(a, b, torch.bfloat16).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="K"):
        fp4_mm(a, nvfp4.quantize_nvfp4(w[:, :64]), torch.float32)


def test_mxfp4_gemm_matches_the_dequantized_product():
    g = torch.Generator().manual_seed(6)
    a = mxfp4.quantize_mxfp4(torch.randn(16, 128, generator=g))
    b = mxfp4.quantize_mxfp4(torch.randn(24, 128, generator=g), stochastic=True, generator=1)
    y = fp4_mm(a, b, torch.float32)
    exact = a.dequantize().double() @ b.dequantize().double().T
    assert torch.allclose(y.double(), exact, rtol=1e-5, atol=1e-5)


def _operand(codes, block_scale, block, tensor_scale=1.0, divisor=1.0, label="test"):
    """An FP4Operand from E2M1 codes (``(rows, K)`` uint8 in 0..15) and float32 block scales."""
    return FP4Operand(
        pack_e2m1(codes),
        block_scale,
        torch.tensor(tensor_scale),
        divisor,
        block,
        label,
    )


def test_an_operand_decodes_its_codes_times_both_scale_levels():
    codes = torch.tensor([[2, 4, 6, 7, 9, 0, 1, 15]], dtype=torch.uint8)  # 1, 2, 4, 6, -0.5 ...
    op = _operand(codes, torch.tensor([[0.5, 4.0]]), block=4, tensor_scale=3.0, divisor=2.0)
    assert op.shape == (1, 8)
    assert op.codes_as_float().tolist() == [[1.0, 2.0, 4.0, 6.0, -0.5, 0.0, 0.5, -6.0]]
    assert op.block_decode().tolist() == [[0.75, 6.0]]  # block_scale * 3 / 2
    assert op.dequantize().tolist() == [[0.75, 1.5, 3.0, 4.5, -3.0, 0.0, 3.0, -36.0]]


def test_a_hand_worked_product_with_both_tensor_levels():
    a = _operand(torch.tensor([[2, 2, 4, 4]], dtype=torch.uint8), torch.tensor([[1.0, 2.0]]), 2)
    b = _operand(
        torch.tensor([[2, 0, 2, 0], [4, 4, 4, 4]], dtype=torch.uint8),
        torch.tensor([[1.0, 0.5], [1.0, 1.0]]),
        2,
        tensor_scale=6.0,
        divisor=4.0,
    )
    # a = [1, 1, 4, 4]; b = [[1, 0, 0.5, 0], [2, 2, 2, 2]] times 6/4
    y = fp4_mm(a, b, torch.float32)
    assert y.tolist() == [[(1 + 2) * 1.5, (2 + 2 + 8 + 8) * 1.5]]


def test_the_walk_over_k_blocks_in_chunks_gives_the_same_bits(monkeypatch):
    g = torch.Generator().manual_seed(3)
    a = nvfp4.quantize_nvfp4(torch.randn(8, 256, generator=g))
    b = nvfp4.quantize_nvfp4(torch.randn(16, 256, generator=g), tile_rows=16)
    whole = fp4_mm(a, b, torch.float32)
    monkeypatch.setattr(fp4_gemm, "_CHUNK_ELEMS", 8 * 16 * 3)  # 3 of the 16 blocks per chunk
    assert torch.equal(fp4_mm(a, b, torch.float32), whole)


def test_the_output_is_cast_once_to_out_dtype():
    g = torch.Generator().manual_seed(4)
    a = mxfp4.quantize_mxfp4(torch.randn(4, 64, generator=g))
    b = mxfp4.quantize_mxfp4(torch.randn(5, 64, generator=g))
    y32 = fp4_mm(a, b, torch.float32)
    for dtype in (torch.bfloat16, torch.float16):
        y = fp4_mm(a, b, dtype)
        assert y.dtype == dtype and torch.equal(y, y32.to(dtype))


def test_the_pair_is_checked_before_any_math():
    x = torch.randn(4, 64)
    nv, mx = nvfp4.quantize_nvfp4(x), mxfp4.quantize_mxfp4(x)
    with pytest.raises(TypeError, match="quantize_nvfp4"):
        fp4_mm(nv, x, torch.float32)
    with pytest.raises(ValueError, match="the same recipe") as e:
        fp4_mm(nv, mx, torch.float32)
    assert nv.label in str(e.value) and mx.label in str(e.value)
    with pytest.raises(ValueError, match="K=32"):
        fp4_mm(nv, nvfp4.quantize_nvfp4(x[:, :32]), torch.float32)
