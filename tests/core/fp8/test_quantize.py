"""Each recipe's quantize/dequantize math: the fast path equals the plain reference bit for bit."""

import pytest
import torch

from mpnb import fp8

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
DTYPES = [E4M3, E5M2]


def _inputs(rows=7, k=70, seed=0):
    """Normal values, a zero row, a row far past the fp8 range, a row of fp32 subnormals."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g) * torch.logspace(-3, 3, rows).view(-1, 1)
    x[1] = 0.0
    x[2] = x[2] * 1e6
    x[3] = torch.randn(k, generator=g) * 1e-40
    return x


def _bits(t):
    return t.view(torch.uint8)


@pytest.mark.parametrize("power_of_2", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_tensorwise_matches_reference_bitwise(dtype, power_of_2):
    x = _inputs()
    op = fp8.quantize_tensorwise(x, dtype, power_of_2)
    q, inv = fp8.reference_quantize_tensorwise(x, dtype, power_of_2=power_of_2)
    assert op.data.dtype == dtype and op.dequant_scale.dtype == torch.float32
    assert torch.equal(_bits(op.data), _bits(q))
    assert torch.equal(op.dequant_scale, inv)
    # the largest magnitude maps to the format's max (or just below it with a 2**k scale)
    top = op.data.float().abs().max().item()
    assert (top == fp8.fp8_max(dtype)) if not power_of_2 else (fp8.fp8_max(dtype) / 2 < top)


@pytest.mark.parametrize("power_of_2", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rowwise_matches_reference_bitwise(dtype, power_of_2):
    x = _inputs()
    op = fp8.quantize_rowwise(x, dtype, power_of_2)
    q, inv = fp8.reference_quantize_rowwise(x, dtype, power_of_2)
    assert op.dequant_scale.shape == (x.shape[0], 1)
    assert torch.equal(_bits(op.data), _bits(q))
    assert torch.equal(op.dequant_scale, inv)
    assert torch.equal(op.data[1].float(), torch.zeros(x.shape[1]))  # a zero row stays zero


@pytest.mark.parametrize("rounding", ["rceil", "floor"])
@pytest.mark.parametrize("k", [64, 70, 5])
@pytest.mark.parametrize("dtype", DTYPES)
def test_mx_matches_reference_bitwise(dtype, k, rounding):
    x = _inputs(k=k)
    x[4, :3] = float("nan")  # a NaN block gets the NaN scale (0xFF)
    op = fp8.quantize_mx(x, dtype, rounding)
    q, scales = fp8.reference_quantize_mx(x, dtype, rounding=rounding)
    assert op.dequant_scale.dtype == torch.float8_e8m0fnu
    assert op.dequant_scale.shape == (x.shape[0], -(-k // 32))
    assert torch.equal(_bits(op.data), _bits(q))
    assert torch.equal(_bits(op.dequant_scale), _bits(scales))
    assert _bits(op.dequant_scale)[4, 0] == 255
    assert torch.isnan(op.dequantize()[4, :3]).all()


def test_mx_shared_exponent_follows_the_ocp_spec_with_floor():
    """X = 2**(floor(log2(amax)) - emax): 1.0 -> 2**-8 (E4M3), 500 -> 2**0 and clips to 448."""
    x = torch.zeros(3, 32)
    x[0, 0], x[1, 0], x[1, 1], x[2, 0] = 1.0, 500.0, 3.0, 1.0
    op = fp8.quantize_mx(x, E4M3, rounding="floor")
    assert _bits(op.dequant_scale).flatten().tolist() == [127 - 8, 127, 127 - 15 + 7]
    assert op.data[0, 0].item() == 256.0
    assert op.data[1, 0].item() == 448.0 and op.data[1, 1].item() == 3.0
    e5 = fp8.quantize_mx(x[2:], E5M2, rounding="floor")
    assert _bits(e5.dequant_scale).item() == 127 - 15  # E5M2's emax is 15


def test_mx_shared_exponent_rounds_up_with_rceil():
    """X = 2**ceil(log2(amax / fp8_max)): 448 -> 2**0 (exact), 449 and 500 -> 2**1, no clip."""
    x = torch.zeros(3, 32)
    x[0, 0], x[1, 0], x[2, 0], x[2, 1] = 448.0, 449.0, 500.0, 3.0
    op = fp8.quantize_mx(x, E4M3)  # the default
    assert _bits(op.dequant_scale).flatten().tolist() == [127, 128, 128]
    assert op.data[0, 0].item() == 448.0 and op.data[1, 0].item() == 224.0
    assert op.data[2, 0].item() == 256.0 and op.data[2, 1].item() == 1.5  # 250 -> 256 in E4M3
    y = torch.zeros(2, 32)
    y[0, 0], y[1, 0] = 57344.0, 57352.0  # E5M2's max, and the next float32 up by 8
    assert _bits(fp8.quantize_mx(y, E5M2).dequant_scale).flatten().tolist() == [127, 128]


@pytest.mark.parametrize(
    "quant, gran",
    [
        (lambda x, d: fp8.quantize_tensorwise(x, d), "tensorwise"),
        (lambda x, d: fp8.quantize_rowwise(x, d, False), "rowwise"),
        (lambda x, d: fp8.quantize_mx(x, d), "mx"),
    ],
)
@pytest.mark.parametrize("dtype", DTYPES)
def test_dequantize_matches_reference(quant, gran, dtype):
    x = _inputs(k=45)
    op = quant(x, dtype)
    ref = fp8.reference_dequantize(op.data, op.dequant_scale, gran)
    # float32 product of two float32 numbers == the exact (float64) product rounded once
    assert torch.equal(op.dequantize(), ref.float())
    # every value that lands in the format's normal range without saturating is within half
    # an ulp: relative 2**-4 for E4M3 (3 mantissa bits), 2**-3 for E5M2 (2 bits)
    scale = op.dequant_scale.float()
    if gran == "mx":
        scale = scale.repeat_interleave(32, dim=1)[:, : x.shape[1]]
    units = x.abs() / scale
    fi = torch.finfo(dtype)
    normal = (units >= fi.smallest_normal) & (units <= fi.max)
    half_ulp = 2.0 ** -(4 if dtype == E4M3 else 3)
    err = (op.dequantize() - x).abs()
    assert normal.sum() >= x.shape[1]  # at least a row of values is checked
    assert (err[normal] <= half_ulp * x.abs()[normal]).all()


def test_transposed_operand_only_for_per_tensor_scales():
    x = torch.randn(4, 6)
    op = fp8.quantize_tensorwise(x, E4M3)
    assert torch.equal(_bits(op.t().data), _bits(op.data.t().contiguous()))
    with pytest.raises(ValueError, match="quantize the transposed"):
        fp8.quantize_rowwise(x, E4M3).t()


@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("history_len, margin", [(3, 0), (1024, 1)])
def test_delayed_scales_follow_the_amax_history(algo, history_len, margin):
    """Per step, the scale a layer used equals the reference over the same amaxes."""
    rec = fp8.DelayedScaling(amax_history_len=history_len, amax_compute_algo=algo, margin=margin)
    layer = fp8.Float8Linear(16, 16, bias=False, recipe=rec)
    amaxes = [2.0, 40.0, 0.5, 0.0, 3.0, 0.25, 7.0]
    used = []
    for a in amaxes:
        used.append(layer.fp8_scale[0].item())
        x = torch.zeros(4, 16)
        x[0, 0] = a
        layer(x)
    ref = fp8.reference_delayed_scales(amaxes, E4M3, history_len, algo, margin)
    assert used == ref
    assert layer.fp8_amax_history[: min(history_len, 7), 0].tolist() == amaxes[::-1][:history_len]
    layer.eval()  # eval forwards use the scales without recording
    before = layer.fp8_amax_history.clone()
    layer(torch.randn(4, 16) * 100)
    assert torch.equal(layer.fp8_amax_history, before)


def test_delayed_quantization_uses_the_previous_steps_scale():
    layer = fp8.Float8Linear(16, 16, bias=False, recipe="delayed")
    x = torch.full((2, 16), 1000.0)  # step 1: scale 1.0, so 1000 saturates at 448
    layer(x)
    s = layer.fp8_scale[0]
    assert s.item() == pytest.approx(448 / 1000)
    op = fp8.quantize_with_scale(x, s, E4M3, "tensorwise")
    q, inv = fp8.reference_quantize_tensorwise(x, E4M3, scale=s)
    assert torch.equal(_bits(op.data), _bits(q)) and torch.equal(op.dequant_scale, inv)


def test_recipe_errors_name_the_fix():
    with pytest.raises(ValueError, match="valid choices: tensorwise, delayed, rowwise, mxfp8"):
        fp8.recipe("blockwise")
    with pytest.raises(ValueError, match="'max' or 'most_recent'"):
        fp8.DelayedScaling(amax_compute_algo="mean")
    with pytest.raises(ValueError, match="int >= 1"):
        fp8.DelayedScaling(amax_history_len=0)
    with pytest.raises(ValueError, match="'hybrid'"):
        fp8.TensorwiseScaling(fp8_format="e5m2")
    with pytest.raises(ValueError, match="see help"):
        fp8.recipe("rowwise", amax_history_len=3)
    assert fp8.recipe("delayed").amax_history_len == 1024  # TransformerEngine's defaults
    assert fp8.recipe("delayed").amax_compute_algo == "max" and fp8.recipe("delayed").margin == 0
