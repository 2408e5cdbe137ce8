"""Each recipe's quantize/dequantize math: the fast path equals the plain reference bit for bit;
power-of-two scales a few ulps above ``fp8_max / 2**k``; and MXFP8's E8M0 block scales, rounded
up by default (RCEIL), down on request (FLOOR), compared with torchao's MX quantization
(``torchao.prototype.mx_formats``, a test-only dependency: these comparisons skip without it)
bit for bit, in both modes."""

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


def _just_above(top: float, k: int, ulps: int) -> torch.Tensor:
    a = torch.tensor(top / 2.0**k, dtype=torch.float32)
    for _ in range(ulps):
        a = torch.nextafter(a, torch.tensor(float("inf")))
    return a


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_power_of_two_scales_equal_the_reference_a_few_ulps_above_max_over_2k(dtype):
    top = fp8.fp8_max(dtype)
    amaxes = [_just_above(top, k, n) for k in range(-12, 30) for n in range(0, 5)]
    x = torch.zeros(len(amaxes), 16)
    x[:, 3] = torch.stack(amaxes)
    x[:, 7] = -x[:, 3] / 3
    op = fp8.quantize_rowwise(x, dtype, power_of_2=True)
    q, inv = fp8.reference_quantize_rowwise(x, dtype, power_of_2=True)
    assert torch.equal(op.dequant_scale, inv)
    assert torch.equal(op.data.view(torch.uint8), q.view(torch.uint8))
    # the scale is the largest power of two under which the row's amax does not clip
    scale = op.dequant_scale.reciprocal().flatten()
    assert (x[:, 3] * scale <= top).all() and (x[:, 3] * scale * 2 > top).all()
    for a in amaxes[::7]:
        t = fp8.quantize_tensorwise(torch.stack([a, -a / 3]), dtype, power_of_2=True)
        assert torch.equal(t.dequant_scale, 1.0 / fp8.reference_scale(a.item(), dtype, True))


# ---- MXFP8's E8M0 scales: RCEIL (default) and FLOOR ------------------------------------


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


@pytest.mark.parametrize("data", DATA)
def test_rceil_clips_no_block_and_errs_less_than_floor(data):
    x = DATA[data]()
    rec = fp8.recipe("mxfp8")
    default = rec.quantize(None, x, "input", False)  # what a default MXFP8 layer does
    floor = fp8.quantize_mx(x, E4M3, "floor")
    assert _clipped_blocks(x, default) == 0
    assert _clipped_blocks(x, floor) > 0
    assert _rel_error(x, default) < _rel_error(x, floor)


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
