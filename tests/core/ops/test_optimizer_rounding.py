"""Pure-bf16 optimizer ops (``fused_{adam,sgd,lamb}_bf16_``): the rounding's math and bits.

The op-table test already compares each kernel with its reference bitwise on its samples;
here: the rounding functions themselves, special values through the kernels, unbiasedness,
Kahan's accumulation, reproducibility (seeds, threads) and the errors.
"""

from __future__ import annotations

import pytest
import torch

from mpnb.core.ops import use_reference
from mpnb.core.ops._rounding import (
    element_bits,
    round_nearest,
    round_stochastic,
    tensor_key,
)
from mpnb.core.ops.adam import fused_adam_bf16_
from mpnb.core.ops.sgd import fused_sgd_, fused_sgd_bf16_

BF16_MAX = torch.finfo(torch.bfloat16).max


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


def _sgd_x(w: torch.Tensor, x: torch.Tensor, rounding: str, seed: int = 3) -> torch.Tensor:
    """Store the fp32 values ``x`` into bf16 params ``w`` through the op (lr=1, g = w - x)."""
    p = w.clone()
    comps = [torch.zeros_like(p)] if rounding == "kahan" else []
    fused_sgd_bf16_(
        [p], [w.float() - x], [], comps, [], lr=1.0, rounding=rounding, seed=seed, rng_step=1
    )
    return p


def test_special_values_kernel_equals_reference(op_impl):
    w = torch.tensor([1.0, 1.0, -1.0, 0.0] + [BF16_MAX] * 64, dtype=torch.bfloat16)
    past_max = BF16_MAX + torch.arange(64, dtype=torch.float64) * 2.0**113
    x = torch.cat([torch.tensor([float("inf"), float("nan"), -float("inf"), 1e-40]), past_max])
    g = x.float()
    for rounding in ("stochastic", "kahan"):
        p = _sgd_x(w, g, rounding)
        with use_reference():
            q = _sgd_x(w, g, rounding)
        assert torch.equal(_bits(p), _bits(q)), rounding
        assert p[0].item() == float("inf") and p[2].item() == -float("inf")
        assert _bits(p)[1].item() == 0x7FC0 if rounding == "stochastic" else p[1].isnan()
    p = _sgd_x(w, g, "stochastic")
    tail = p[4:].float()
    assert set(tail.unique().tolist()) <= {BF16_MAX, float("inf")}
    assert (tail == BF16_MAX).any() and (tail == float("inf")).any()


def _tiny_sgd(rounding: str | None, steps: int = 200, seed: int = 0):
    """bf16 params at 1.0 pushed by updates of a third of an ulp per step."""
    p = torch.ones(4096, dtype=torch.bfloat16)
    g = torch.full((4096,), -1.0)
    lr = 2.0**-7 / 3  # a third of bf16's ulp at 1 (2^-7)
    comps = [torch.zeros_like(p)] if rounding == "kahan" else []
    for s in range(steps):
        if rounding is None:
            fused_sgd_([p], [g], [], [], [], lr=lr)
        else:
            fused_sgd_bf16_(
                [p], [g], [], comps, [], lr=lr, rounding=rounding, seed=seed, rng_step=s
            )
    return p.float(), 1.0 + steps * torch.tensor(lr).item()


def test_tiny_updates_vanish_to_nearest_but_accumulate_with_sr_and_kahan(op_impl):
    nearest, exact = _tiny_sgd(None)
    assert (nearest == 1.0).all()  # round to nearest loses every update
    sr, _ = _tiny_sgd("stochastic")
    ulp = 2.0**-7
    # the mean over 4096 independent walks is within a few sigma of the exact sum
    assert abs(sr.double().mean().item() - exact) < 0.1 * ulp * 5
    kahan, _ = _tiny_sgd("kahan")
    assert (kahan - exact).abs().max().item() <= ulp  # within an ulp of the fp32 result


def _adam_step(n: int, seed: int, rounding: str = "stochastic"):
    g = torch.Generator().manual_seed(0)
    p = torch.randn(n, generator=g).bfloat16()
    grad = torch.randn(n, generator=g)
    m, v, st = torch.zeros(n), torch.zeros(n), torch.tensor(0.0)
    comps = [torch.zeros_like(p)] if rounding == "kahan" else []
    fused_adam_bf16_(
        [p],
        [grad],
        [m],
        [v],
        comps,
        [st],
        lr=1e-3,
        beta1=0.9,
        beta2=0.999,
        eps=1e-8,
        weight_decay=0.0,
        adam_w_mode=True,
        bias_correction=True,
        rounding=rounding,
        seed=seed,
        rng_step=1,
    )
    return p


def test_bits_depend_on_the_seed_not_on_threads(kernels):
    n = (1 << 18) + 5  # parallel chunks
    a, b = _adam_step(n, seed=11), _adam_step(n, seed=11)
    assert torch.equal(_bits(a), _bits(b))
    assert not torch.equal(_bits(a), _bits(_adam_step(n, seed=12)))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _adam_step(n, seed=11)
        torch.set_num_threads(2)
        two = _adam_step(n, seed=11)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(_bits(one), _bits(a)) and torch.equal(_bits(two), _bits(a))


def test_errors_name_the_fix(op_impl):
    p32, g = [torch.zeros(4)], [torch.zeros(4)]
    with pytest.raises(TypeError, match="bfloat16 params"):
        fused_sgd_bf16_(p32, g, [], [], [], lr=0.1, rounding="stochastic", seed=0, rng_step=0)
    p = [torch.zeros(4, dtype=torch.bfloat16)]
    with pytest.raises(ValueError, match="one of"):
        fused_sgd_bf16_(p, g, [], [], [], lr=0.1, rounding="nearest", seed=0, rng_step=0)
    with pytest.raises(ValueError, match="compensation buffer per param"):
        fused_sgd_bf16_(p, g, [], [], [], lr=0.1, rounding="kahan", seed=0, rng_step=0)
    with pytest.raises(ValueError, match="no compensation"):
        fused_sgd_bf16_(
            p,
            g,
            [],
            [torch.zeros(4, dtype=torch.bfloat16)],
            [],
            lr=0.1,
            rounding="stochastic",
            seed=0,
            rng_step=0,
        )
    with pytest.raises(TypeError, match="contiguous bfloat16"):
        fused_sgd_bf16_(
            p, g, [], [torch.zeros(4)], [], lr=0.1, rounding="kahan", seed=0, rng_step=0
        )
