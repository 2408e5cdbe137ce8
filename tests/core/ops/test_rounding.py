"""The rounding of the pure-bf16 optimizer ops (``mpnb/core/ops/_rounding.py``): round to nearest
is torch's conversion, the random bits are uniform and distinct per element, and stochastic
rounding is unbiased. (Through the ops: ``test_sgd.py``, ``test_adam.py``.)"""

from __future__ import annotations

import pytest
import torch

from mpnb.core.ops._rounding import element_bits, round_nearest, round_stochastic, tensor_key


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def test_round_nearest_is_torchs_conversion_on_finite_and_inf():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(100_000, generator=g) * torch.logspace(-40, 38, 100_000)
    x = torch.cat([x, torch.tensor([float("inf"), -float("inf"), 0.0, -0.0, 3.3961e38])])
    assert torch.equal(_bits(round_nearest(x)), _bits(x.to(torch.bfloat16)))
    assert _bits(round_nearest(torch.tensor([float("nan")]))).item() == 0x7FC0


def test_random_bits_are_uniform_and_distinct_per_element():
    r = element_bits(1 << 16, tensor_key(1, 2, 3))
    assert r.min() >= 0 and r.max() < 1 << 16
    counts = torch.bincount(r >> 12, minlength=16).double()  # 16 bins of 4096 each
    assert ((counts - 4096).abs() < 5 * 64).all()  # within 5 sigma of uniform
    assert tensor_key(1, 2, 3) != tensor_key(1, 2, 4) != tensor_key(1, 3, 3) != tensor_key(2, 2, 3)


@pytest.mark.parametrize("x", [1.0 + 2.0**-10, -3.0 - 3 * 2.0**-9, 1e-39 * 1.37, 7.1e-3])
def test_stochastic_rounding_is_unbiased(x):
    n = 1 << 16
    xs = torch.full((n,), x)
    out = round_stochastic(xs, element_bits(n, tensor_key(5, 1, 0))).float()
    lo, hi = out.min().item(), out.max().item()
    ulp = hi - lo
    assert ulp > 0 and lo <= x <= hi  # only the two neighbours
    bound = 5 * ulp / (2 * n**0.5)  # 5 sigma of the mean of n two-point draws
    assert abs(out.double().mean().item() - x) < bound
