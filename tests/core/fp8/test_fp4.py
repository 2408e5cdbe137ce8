"""E2M1 (FP4) elements: the grid, round-to-nearest-even, stochastic rounding, nibble packing."""

import pytest
import torch

from mpnb.core.fp8 import fp4

GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def test_the_sixteen_codes_decode_to_the_e2m1_grid_with_a_sign_bit():
    values = fp4.e2m1_to_float(torch.arange(16, dtype=torch.uint8))
    assert values[:8].tolist() == GRID
    assert values[8:].tolist() == [-v for v in GRID]
    assert torch.signbit(values[8])  # code 8 is -0.0


def test_rne_rounds_every_tie_to_the_even_code_and_saturates():
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    # 0.25 -> 0, 0.75 -> 1.0, 1.25 -> 1.0, 1.75 -> 2.0, 2.5 -> 2.0, 3.5 -> 4.0, 5.0 -> 4.0
    assert fp4.round_to_e2m1(ties).tolist() == [0, 2, 2, 4, 4, 6, 6]
    assert fp4.round_to_e2m1(-ties).tolist() == [8, 10, 10, 12, 12, 14, 14]
    big = torch.tensor([6.0, 7.0, 1e30, float("inf"), -float("inf"), -0.0, float("nan")])
    assert fp4.round_to_e2m1(big).tolist() == [7, 7, 7, 7, 15, 8, 0]
    near = torch.tensor([0.2500001, 0.7499999, 5.0000005, 4.9999995])
    assert fp4.round_to_e2m1(near).tolist() == [1, 1, 7, 6]


def test_packing_puts_the_even_element_in_the_low_nibble():
    codes = torch.tensor([[1, 2, 3, 15]], dtype=torch.uint8)
    packed = fp4.pack_e2m1(codes)
    assert packed.tolist() == [[0x21, 0xF3]]
    assert torch.equal(fp4.unpack_e2m1(packed), codes)
    with pytest.raises(ValueError, match="even"):
        fp4.pack_e2m1(torch.zeros(2, 3, dtype=torch.uint8))
    with pytest.raises(TypeError, match="uint8"):
        fp4.pack_e2m1(torch.zeros(2, 4))


def test_rounding_rejects_non_float_input():
    with pytest.raises(TypeError, match="floating"):
        fp4.round_to_e2m1(torch.arange(4))


def _sr_values():
    return torch.tensor([0.3, 1.1, 1.9, 2.7, 3.2, 4.9, 5.99, -0.1, -2.2, -4.5, 0.5, 6.0])


def test_stochastic_rounding_is_unbiased_within_three_standard_errors():
    x = _sr_values()
    draws = 100_000
    xs = x.repeat(draws, 1)
    q = fp4.e2m1_to_float(fp4.stochastic_round_to_e2m1(xs, generator=1234)).double()
    err = q - xs.double()
    mean = err.mean(0)
    se = err.std(0) / draws**0.5
    assert (mean.abs() <= 3 * se + 1e-12).all(), (mean, se)
    on_grid = (x == 0.5) | (x == 6.0)
    assert (err[:, on_grid] == 0).all()  # a value on the grid is never moved
    # only the two neighbours are ever drawn
    lo = fp4.e2m1_to_float(fp4.round_toward_zero_e2m1(x)).double()
    assert ((q - lo).abs() <= 2.0).all()


def test_stochastic_rounding_with_a_fixed_seed_reproduces():
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(0)) * 3
    a = fp4.stochastic_round_to_e2m1(x, generator=7)
    b = fp4.stochastic_round_to_e2m1(x, generator=torch.Generator().manual_seed(7))
    c = fp4.stochastic_round_to_e2m1(x, generator=8)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


@pytest.mark.parametrize("seed", [float("nan"), 1.5, True, -1, "3"])
def test_stochastic_rounding_rejects_a_bad_seed(seed):
    with pytest.raises((TypeError, ValueError), match="seed"):
        fp4.stochastic_round_to_e2m1(torch.ones(4), generator=seed)


def test_stochastic_rounding_needs_an_explicit_generator():
    with pytest.raises(TypeError, match="generator"):
        fp4.stochastic_round_to_e2m1(torch.ones(4), generator=None)
