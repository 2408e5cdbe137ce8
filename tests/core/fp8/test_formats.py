"""The FP8 number formats: the float8 dtypes' ranges, the two format names, E8M0's power-of-two
code, the MX element emax, and the amax floor that keeps an all-zero tensor's scale finite."""

import math

import pytest
import torch

from mpnb import fp8
from mpnb.core.fp8 import formats
from mpnb.core.fp8.formats import (
    AMAX_EPS,
    E4M3,
    E5M2,
    E8M0,
    E8M0_BIAS,
    FP8_FORMATS,
    MX_ELEMENT_EMAX,
    format_dtypes,
    fp8_max,
)


def test_the_dtypes_are_torchs_and_their_largest_values_are_the_specs():
    assert (E4M3, E5M2, E8M0) == (
        torch.float8_e4m3fn,
        torch.float8_e5m2,
        torch.float8_e8m0fnu,
    )
    assert fp8_max(E4M3) == 448.0 and fp8_max(E5M2) == 57344.0
    for dtype in (E4M3, E5M2):  # torch's own range, and the largest value survives the cast
        assert fp8_max(dtype) == torch.finfo(dtype).max
        top = torch.tensor(fp8_max(dtype))
        assert top.to(dtype).float() == top


def test_the_two_formats_name_their_forward_and_gradient_dtypes():
    assert format_dtypes("hybrid") == (E4M3, E5M2)  # TransformerEngine's default
    assert format_dtypes("e4m3") == (E4M3, E4M3)
    assert set(FP8_FORMATS) == {"hybrid", "e4m3"}
    with pytest.raises(ValueError, match="fp8_format='e5m2'") as e:
        format_dtypes("e5m2")
    assert "'hybrid'" in str(e.value) and "'e4m3'" in str(e.value)  # the two choices


def test_an_e8m0_code_is_two_to_the_code_minus_the_bias_and_255_is_nan():
    codes = torch.tensor([0, 1, 126, 127, 128, 254, 255], dtype=torch.uint8)
    values = codes.view(E8M0).float()
    want = [2.0 ** (int(c) - E8M0_BIAS) for c in codes[:-1]]
    assert values[:-1].tolist() == want and E8M0_BIAS == 127
    assert math.isnan(values[-1])


def test_the_mx_element_emax_is_the_exponent_of_the_largest_power_of_two():
    for dtype, emax in MX_ELEMENT_EMAX.items():
        assert 2.0**emax <= fp8_max(dtype) < 2.0 ** (emax + 1)
    assert MX_ELEMENT_EMAX == {E4M3: 8, E5M2: 15}  # OCP MX spec v1.0, section 5.3


def test_an_all_zero_tensor_gets_the_finite_scale_of_the_amax_floor():
    op = fp8.quantize_tensorwise(torch.zeros(4, 8), E4M3)
    assert torch.isfinite(op.dequant_scale).all()
    assert op.dequant_scale.item() == pytest.approx(AMAX_EPS / fp8_max(E4M3))
    assert (op.dequantize() == 0).all()


def test_the_public_names_are_the_package_names():
    assert all(hasattr(formats, name) for name in formats.__all__)
    for name in ("E4M3", "E5M2", "E8M0", "FP8_FORMATS", "format_dtypes", "fp8_max"):
        assert getattr(fp8, name) is getattr(formats, name)
