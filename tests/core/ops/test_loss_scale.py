"""The loss-scale ops (``mpnb/core/ops/loss_scale.py``): ``update_scale_hysteresis`` and
``update_loss_scale_``.

``update_scale_hysteresis`` is held to Apex's kernel (``csrc/update_scale_hysteresis.cu``).
Apex's CUDA kernel is built with ``--use_fast_math``, so a scale that a backoff (or growth)
would leave below float32's smallest normal number is flushed to zero, which Apex's own
``test_update_scale_hysteresis.py::test_fuzz`` expects; ours kept the subnormal and grew it
back. The model below is that kernel, line for line, in Python; every step's scale, growth
tracker and hysteresis tracker must match it on the C++ kernel and on the reference. With a
hysteresis of 1 the rule is ``torch._amp_update_scale_``'s.

``update_loss_scale_`` is the rule, the clamp to ``[min_scale, max_scale]`` and the inverse in
one op: it equals the three calls it replaces, matches its reference, and refuses bad state.
"""

from __future__ import annotations

import math

import pytest
import torch

from mpnb.core import amp_C, ops
from tests.core.ops.test_scale import _on, flag

mt = ops  # the references are exported beside the wrappers

_TINY = torch.finfo(torch.float32).tiny


def _f32_ftz(x: float) -> float:
    """``x`` rounded to float32 as Apex's fast-math kernel stores it: subnormals become 0."""
    y = float(torch.tensor(x, dtype=torch.float64).to(torch.float32))
    return math.copysign(0.0, y) if abs(y) < _TINY else y


def _apex_step(state, inf, growth_factor, backoff_factor, growth_interval, hysteresis):
    """One call of Apex's ``update_scale_hysteresis_cuda_kernel`` on ``(scale, growth, hyst)``."""
    scale, growth, hyst = state
    if inf > 0:
        hyst -= 1
        if hyst > 0:
            return scale, 0, hyst
    if inf != 0:  # NaN is truthy in C
        scale, growth = _f32_ftz(scale * backoff_factor), 0
    else:
        successful = growth + 1
        if successful == growth_interval:
            grown = _f32_ftz(scale * growth_factor)
            scale = grown if math.isfinite(grown) else scale
            growth = 0
        else:
            growth = successful
    if inf <= 0:
        hyst = hysteresis
    return scale, growth, hyst


def _tensors(scale, growth, hyst):
    return (
        torch.tensor([scale], dtype=torch.float32),
        torch.tensor([growth], dtype=torch.int32),
        torch.tensor([hyst], dtype=torch.int32),
    )


def _read(t):
    return t[0].item(), t[1].item(), t[2].item()


def test_backoff_below_the_smallest_normal_gives_zero_as_apex(op_impl):
    """Apex's fuzz case: init 1, backoff 0.5 for 131 overflowed steps. Before: the scale was
    the subnormal 2**-131 (and grew back to 2**-130); Apex's kernel gives 0 and keeps it."""
    hysteresis, interval = 10, 10
    t = _tensors(1.0, 0, hysteresis)
    inf = torch.ones(1)
    for _ in range(hysteresis - 1 + 1 + 130):
        amp_C.update_scale_hysteresis(*t, inf, 2.0, 0.5, interval, hysteresis)
    assert t[0].item() == 0.0
    inf.zero_()
    for _ in range(interval):
        amp_C.update_scale_hysteresis(*t, inf, 2.0, 0.5, interval, hysteresis)
    assert t[0].item() == 0.0


FLAGS = (0.0, 1.0, float("nan"), -1.0, float("inf"))


@pytest.mark.parametrize(
    ("init", "growth_factor", "backoff_factor", "interval", "hysteresis"),
    [(1.0, 2.0, 0.25, 3, 2), (2.0**-120, 4.0, 0.5, 2, 1), (2.0**126, 2.0, 0.5, 2, 3)],
    ids=["quarter", "near-tiny", "near-max"],
)
def test_every_step_matches_apexs_kernel(
    op_impl, init, growth_factor, backoff_factor, interval, hysteresis
):
    """A fixed sequence of flags (clean, overflow, NaN, negative, inf) through the smallest
    normal and the largest float32: scale, growth tracker and hysteresis tracker after each
    step equal Apex's kernel's."""
    g = torch.Generator().manual_seed(interval * 10 + hysteresis)
    # Runs of overflows and of clean steps, so the scale reaches both ends of the range.
    picks = torch.randint(0, 8, (400,), generator=g).tolist()
    run = [0.0] * 60 + [1.0] * 80 + [0.0] * 120
    flags = run + [FLAGS[p] if p < len(FLAGS) else 0.0 for p in picks]
    t = _tensors(init, 0, hysteresis)
    want = (init, 0, hysteresis)
    rule = (growth_factor, backoff_factor, interval, hysteresis)
    for i, f in enumerate(flags):
        ops.update_scale_hysteresis(*t, torch.tensor([f]), *rule)
        want = _apex_step(want, f, *rule)
        got = _read(t)
        both_nan = math.isnan(got[0]) and math.isnan(want[0])
        same = got[1:] == want[1:] and (both_nan or got[0] == want[0])
        assert same and math.copysign(1, got[0]) == math.copysign(1, want[0]), (i, f, got, want)


def _state(scale=65536.0, growth=0, hyst=2):
    return (
        torch.tensor([scale]),
        torch.tensor([growth], dtype=torch.int32),
        torch.tensor([hyst], dtype=torch.int32),
    )


@pytest.mark.parametrize("hysteresis", [1, 2, 4])
def test_update_scale_hysteresis_sequence(kernels, hysteresis):
    g = torch.Generator().manual_seed(hysteresis)
    k, r = _state(hyst=hysteresis), _state(hyst=hysteresis)
    for _ in range(300):
        found = torch.tensor([float(torch.rand(1, generator=g).item() < 0.3)])
        ops.update_scale_hysteresis(*k, found, 2.0, 0.5, 3, hysteresis)
        mt.reference_update_scale_hysteresis(*r, found, 2.0, 0.5, 3, hysteresis)
        for a, b in zip(k, r, strict=True):
            assert torch.equal(a, b)


def test_update_scale_hysteresis_one_is_gradscaler(kernels):
    g = torch.Generator().manual_seed(0)
    scale, growth, hyst = _state(hyst=1)
    t_scale, t_growth = scale.clone(), growth.clone()
    for _ in range(200):
        found = torch.tensor([float(torch.rand(1, generator=g).item() < 0.2)])
        ops.update_scale_hysteresis(scale, growth, hyst, found, 2.0, 0.5, 4, 1)
        torch._amp_update_scale_(t_scale, t_growth, found, 2.0, 0.5, 4)
        assert torch.equal(scale, t_scale) and torch.equal(growth, t_growth)


def test_update_scale_hysteresis_semantics(kernels):
    scale, growth, hyst = _state(scale=8.0, growth=5, hyst=2)
    inf = torch.ones(1)
    ops.update_scale_hysteresis(scale, growth, hyst, inf, 2.0, 0.5, 10, 2)
    assert (scale.item(), growth.item(), hyst.item()) == (8.0, 0, 1)  # held by hysteresis
    ops.update_scale_hysteresis(scale, growth, hyst, inf, 2.0, 0.5, 10, 2)
    assert (scale.item(), growth.item(), hyst.item()) == (4.0, 0, 0)  # backed off
    ops.update_scale_hysteresis(scale, growth, hyst, torch.zeros(1), 2.0, 0.5, 1, 2)
    assert (scale.item(), growth.item(), hyst.item()) == (8.0, 0, 2)  # grew, hysteresis refilled
    huge = _state(scale=3e38, hyst=1)
    ops.update_scale_hysteresis(*huge, torch.zeros(1), 2.0, 0.5, 1, 1)
    assert huge[0].item() == pytest.approx(3e38)  # never grows to inf


@pytest.mark.parametrize(("lo", "hi"), [(0.0, 2.0**24), (2.0, 64.0), (1.0, 1.0)])
def test_update_loss_scale_sequence_matches_reference(kernels, lo, hi):
    g = torch.Generator().manual_seed(int(hi))
    k = (*_state(scale=16.0, hyst=2), torch.empty(1))
    r = (*_state(scale=16.0, hyst=2), torch.empty(1))
    for _ in range(300):
        found = torch.tensor([float(torch.rand(1, generator=g).item() < 0.4)])
        ops.update_loss_scale_(k[0], k[3], k[1], k[2], found, 2.0, 0.5, 2, 2, lo, hi)
        mt.reference_update_loss_scale_(r[0], r[3], r[1], r[2], found, 2.0, 0.5, 2, 2, lo, hi)
        for a, b in zip(k, r, strict=True):
            assert torch.equal(a, b)
        assert lo <= k[0].item() <= hi and k[3].item() == 1.0 / k[0].item()


def test_update_loss_scale_is_the_three_calls_it_replaces(kernels):
    g = torch.Generator().manual_seed(3)
    scale, growth, hyst = _state(scale=3.0, hyst=1)
    inv = torch.empty(1)
    t_scale, t_growth, t_hyst = (t.clone() for t in (scale, growth, hyst))
    for _ in range(200):
        found = torch.tensor([float(torch.rand(1, generator=g).item() < 0.3)])
        ops.update_loss_scale_(scale, inv, growth, hyst, found, 2.0, 0.5, 3, 1, 0.75, 96.0)
        ops.update_scale_hysteresis(t_scale, t_growth, t_hyst, found, 2.0, 0.5, 3, 1)
        t_scale.clamp_(0.75, 96.0)
        assert torch.equal(scale, t_scale) and torch.equal(growth, t_growth)
        assert torch.equal(inv, torch.reciprocal(t_scale))


@pytest.mark.parametrize("path", ["kernel", "reference"])
def test_update_loss_scale_errors(kernels, path):
    with _on(path):
        _update_loss_scale_errors(ops.update_loss_scale_)


def _update_loss_scale_errors(fn):
    scale, growth, hyst = _state()
    with pytest.raises(TypeError, match="inv_scale must"):
        fn(
            scale,
            torch.empty(1, dtype=torch.float64),
            growth,
            hyst,
            flag(),
            2.0,
            0.5,
            10,
            1,
            0.0,
            1.0e6,
        )
    with pytest.raises(ValueError, match="min_scale <= max_scale"):
        fn(scale, torch.empty(1), growth, hyst, flag(), 2.0, 0.5, 10, 1, 8.0, 4.0)
    with pytest.raises(TypeError, match="growth_tracker must"):
        fn(scale, torch.empty(1), growth.float(), hyst, flag(), 2.0, 0.5, 10, 1, 0.0, 1.0e6)
