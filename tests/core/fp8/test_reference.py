"""The plain-PyTorch references every FP8 test compares the fast path with, checked on values
worked out by hand: a reference that drifted would let the fast path drift with it.

The fast path against these references, bit for bit: tests/core/fp8/test_quantize.py."""

import math

import pytest
import torch

from mpnb.core.fp8.reference import (
    reference_delayed_scales,
    reference_dequantize,
    reference_float8_linear,
    reference_quantize,
    reference_quantize_mx,
    reference_quantize_rowwise,
    reference_quantize_tensorwise,
    reference_scale,
)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def test_the_scale_is_fp8_max_over_amax_and_its_power_of_two_rounds_down():
    assert reference_scale(2.0, E4M3).item() == 224.0
    assert reference_scale(2.0, E4M3, power_of_2=True).item() == 128.0
    assert reference_scale(448.0, E4M3, power_of_2=True).item() == 1.0
    assert reference_scale(1.0, E5M2).item() == 57344.0
    assert reference_scale(1.0, E5M2, power_of_2=True).item() == 32768.0
    zero = reference_scale(0.0, E4M3)  # the amax floor: finite
    assert math.isfinite(zero.item()) and zero.item() == pytest.approx(448.0 / 1e-12)


def test_tensorwise_scales_the_amax_to_fp8_max_and_an_inf_becomes_nan():
    x = torch.tensor([[0.5, -1.0, 2.0, float("inf")]])
    q, inv = reference_quantize_tensorwise(x[:, :3], E4M3)
    assert q.float().tolist() == [[112.0, -224.0, 448.0]]
    assert inv.dtype == torch.float32 and inv.item() == pytest.approx(1 / 224.0, rel=2**-24)
    q, _ = reference_quantize_tensorwise(x, E4M3, scale=224.0)  # a given (delayed) scale
    assert q.float()[0, :3].tolist() == [112.0, -224.0, 448.0]
    assert math.isnan(q.float()[0, 3])
    q, _ = reference_quantize_tensorwise(torch.tensor([[10.0]]), E4M3, scale=224.0)
    assert q.float().item() == 448.0  # beyond the range: saturates


def test_rowwise_gives_each_row_its_own_power_of_two():
    x = torch.tensor([[3.0, -1.0], [0.25, 0.125]])
    q, inv = reference_quantize_rowwise(x, E4M3)
    # row 0: 448 / 3 = 149.3 -> 128; row 1: 448 / 0.25 = 1792 -> 1024
    assert inv.shape == (2, 1) and inv.flatten().tolist() == [1 / 128, 1 / 1024]
    assert q.float().tolist() == [[384.0, -128.0], [256.0, 128.0]]


@pytest.mark.parametrize(
    "amax, rceil, floor",
    [(1.0, 119, 119), (2.0, 120, 120), (1.9, 120, 119), (1.75, 119, 119)],
)
def test_an_mx_blocks_code_rounds_up_or_down(amax, rceil, floor):
    # E4M3's emax is 8: floor gives 2**(floor(log2(amax)) - 8); rceil the next power of two
    # when amax would exceed 448 times that (1.9 > 448 * 2**-8 = 1.75)
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 1] = amax, -amax / 4
    for rounding, code in (("rceil", rceil), ("floor", floor)):
        q, scales = reference_quantize_mx(x, E4M3, rounding=rounding)
        assert scales.view(torch.uint8).item() == code
        want = min(amax * 2.0 ** (127 - code), 448.0)  # the top saturates under floor
        assert q.float()[0, 0].item() == pytest.approx(want, rel=2**-3)


def test_an_mx_block_with_a_nan_gets_the_nan_code_and_dequantizes_to_nan():
    x = torch.ones(2, 64)
    x[1, 40] = float("nan")
    q, scales = reference_quantize_mx(x, E4M3)
    assert scales.view(torch.uint8).tolist() == [[119, 119], [119, 255]]
    values = reference_dequantize(q, scales, "mx")
    assert torch.equal(values[:, :32], torch.ones(2, 32, dtype=torch.float64))
    assert values[1, 32:].isnan().all() and not values[0].isnan().any()


def test_dequantize_multiplies_back_per_tensor_and_per_row():
    q = torch.tensor([[112.0, -224.0], [448.0, 1.0]]).to(E4M3)
    assert reference_dequantize(q, torch.tensor(0.5), "tensorwise").tolist() == [
        [56.0, -112.0],
        [224.0, 0.5],
    ]
    per_row = reference_dequantize(q, torch.tensor([[1.0], [0.25]]), "rowwise")
    assert per_row.tolist() == [[112.0, -224.0], [112.0, 0.25]]


def test_the_dispatcher_picks_by_granularity_and_names_the_choices():
    x = torch.randn(2, 32)
    assert torch.equal(
        reference_quantize(x, E4M3, "rowwise", power_of_2=True)[1],
        reference_quantize_rowwise(x, E4M3, power_of_2=True)[1],
    )
    assert torch.equal(
        reference_quantize(x, E4M3, "mx", mx_rounding="floor")[1].view(torch.uint8),
        reference_quantize_mx(x, E4M3, rounding="floor")[1].view(torch.uint8),
    )
    with pytest.raises(ValueError, match="'blockwise'") as e:
        reference_quantize(x, E4M3, "blockwise")
    assert all(name in str(e.value) for name in ("tensorwise", "rowwise", "mx"))


def test_delayed_scales_by_hand():
    # history of 2, max: 1 (start) -> 448/2 -> 448/max(4, 2) -> 0 keeps 112 -> inf not recorded
    amaxes = [2.0, 4.0, 0.0, float("inf"), 1.0]
    assert reference_delayed_scales(amaxes, E4M3, 2) == [1.0, 224.0, 112.0, 112.0, 112.0]
    # the 4 leaves a history of 2 once the 0 and the 1 are in: after the last step, 448 / 1
    assert reference_delayed_scales([*amaxes, 5.0], E4M3, 2)[-1] == 448.0
    assert reference_delayed_scales(amaxes, E4M3, 2, "most_recent") == [1, 224, 112, 112, 112]
    assert reference_delayed_scales([2.0, 8.0], E4M3, margin=1) == [1.0, 112.0]
    tiny = reference_delayed_scales([1e-40, 1.0], E4M3)[1]
    assert tiny == torch.finfo(torch.float32).max  # clamped to the largest finite float32


def test_the_linear_reference_is_exact_on_values_fp8_holds():
    # powers of two: quantized and scaled back without error (power-of-two scales), so the
    # reference's float64 GEMMs equal the plain ones
    g = torch.Generator().manual_seed(0)
    pick = torch.tensor([-2.0, -1.0, -0.5, 0.0, 0.5, 1.0, 2.0])
    x = pick[torch.randint(0, 7, (4, 8), generator=g)]
    w = pick[torch.randint(0, 7, (3, 8), generator=g)]
    dy = pick[torch.randint(1, 6, (4, 3), generator=g)]
    b = torch.tensor([0.1, -0.2, 0.3])
    for granularity in ("tensorwise", "rowwise"):
        y, gx, gw, gb = reference_float8_linear(
            x, w, b, dy, (E4M3, E5M2), granularity, power_of_2=True
        )
        xd, wd, dyd = x.double(), w.double(), dy.double()
        assert torch.equal(y, xd @ wd.T + b.double())
        assert torch.equal(gx, dyd @ wd) and torch.equal(gw, dyd.T @ xd)
        assert torch.equal(gb, dyd.sum(0))
    y, *_ = reference_float8_linear(x * 0.3, w, None, dy, (E4M3, E5M2), "tensorwise")
    assert not torch.equal(y, (x * 0.3).double() @ w.double().T)  # 0.3 * x is quantized
