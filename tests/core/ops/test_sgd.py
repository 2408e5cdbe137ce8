"""``mpnb::fused_sgd_`` and ``fused_sgd_bf16_`` (``mpnb/core/ops/sgd.py``).

* fp32 steps with momentum, dampening and decay equal ``torch.optim.SGD``'s bit for bit; the
  PyTorch path splits mixed ``first_run`` lists into two calls of ``torch._fused_sgd_``.
* Pure bf16 (``fused_sgd_bf16_``): special values through the kernel equal the reference's,
  updates too small for round-to-nearest accumulate with stochastic rounding and Kahan
  summation, and bad arguments raise errors that name the fix. (The rounding functions
  themselves: ``test_rounding.py``; each kernel vs its reference on the op table's samples:
  ``test_library.py``.)
"""

from __future__ import annotations

import copy

import pytest
import torch

import mpnb.core.ops as ops
from mpnb.core.ops import use_reference
from mpnb.core.ops._optim import lists_for
from mpnb.core.ops.sgd import fused_sgd_, fused_sgd_bf16_
from tests.core.ops.test_optim import PATH_SIZES, TORCH_SIZES, _args, _path, _torch_run

BF16_MAX = torch.finfo(torch.bfloat16).max


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


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


def test_errors_name_the_fix(op_impl):
    p32, g = [torch.zeros(4)], [torch.zeros(4)]
    with pytest.raises(TypeError, match="bfloat16 params"):
        fused_sgd_bf16_(p32, g, [], [], [], lr=0.1, rounding="stochastic", seed=0, rng_step=0)
    p = [torch.zeros(4, dtype=torch.bfloat16)]
    with pytest.raises(ValueError, match="one of"):
        fused_sgd_bf16_(p, g, [], [], [], lr=0.1, rounding="nearest", seed=0, rng_step=0)
    with pytest.raises(ValueError, match="Kahan summation needs"):
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


@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("n", TORCH_SIZES)
def test_fp32_sgd_equals_torch_sgd_bitwise(kernels, nesterov, n):
    """fp32 steps with momentum, dampening and decay equal torch.optim.SGD's bit for bit."""
    if not kernels:
        pytest.skip("the bitwise claim is the kernel's (MPNB_DISABLE_EXT=1 runs the references)")
    buf = torch.zeros(n)
    damp = 0.0 if nesterov else 0.1  # nesterov needs zero dampening

    def ours(w, g, k):
        ops.fused_sgd_(
            [w],
            [g],
            [buf],
            [],
            [k == 0],
            lr=0.1,
            momentum=0.9,
            dampening=damp,
            weight_decay=0.01,
            nesterov=nesterov,
        )

    def make(p):
        return torch.optim.SGD(
            [p], lr=0.1, momentum=0.9, dampening=damp, weight_decay=0.01, nesterov=nesterov
        )

    opt, p, w = _torch_run(make, ours, n)
    assert torch.equal(buf, opt.state[opt.param_groups[0]["params"][0]]["momentum_buffer"])
    assert torch.equal(w, p)


def test_sgd_torch_path_first_run_per_param(kernels):
    """torch._fused_sgd_ takes one is_first_step flag: mixed lists are split into two calls."""
    base = lists_for(torch.float32, torch.float32, False, 1, PATH_SIZES)
    for first in ([True] * 4, [False] * 4, [True, False, False, True]):
        a, b = copy.deepcopy(base), copy.deepcopy(base)
        _path("sgd")(*_args("sgd", a, first=first))
        ops.op_info("fused_sgd_").reference_kernel(*_args("sgd", b, first=first))
        for x, y in zip(a[0] + a[3][0], b[0] + b[3][0], strict=True):
            torch.testing.assert_close(x, y, rtol=2e-6, atol=2e-7)


# The argument checks every optimizer op shares (``check_step``) are in test_optim.py; these are
# SGD's own.
BAD = {
    "first_run count": (
        ValueError,
        "one flag per param",
        lambda: ops.fused_sgd_(
            [torch.randn(4)], [torch.randn(4)], [torch.zeros(4)], [], [], lr=0.1, momentum=0.9
        ),
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_arguments_raise_errors_that_name_the_fix(op_impl, case):
    """The kernel and the reference raise the same exception type, naming the fix."""
    exc, fix, call = BAD[case]
    with pytest.raises(exc, match=fix):
        call()
