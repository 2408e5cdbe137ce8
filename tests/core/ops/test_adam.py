"""``mpnb::fused_adam_`` and ``fused_adam_bf16_`` (``mpnb/core/ops/adam.py``).

* fp32 Adam/AdamW steps equal ``torch.optim``'s fused CPU ones bit for bit, at any size, and
  the kernel divides as PyTorch does at every step count.
* The learning rate on the device (``lr_tensor``): each implementation (the C++ kernel, the
  reference, the PyTorch-ops path of CUDA) steps with the tensor's value exactly as with that
  value as a host number, reads it afresh each call (an LR schedule writing into it reaches a
  captured step), and refuses a tensor it cannot read. The Triton kernels' twin is
  ``triton/test_adam.py``.
* The pure-bf16 step's random bits depend on the seed, not on the threads.

The route of large fp32 tensors to PyTorch's fused op: ``test_adam_route.py``.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import mpnb.core.ops as ops
from mpnb.core.ops import use_torch_path
from mpnb.core.ops.adam import (
    fused_adam_,
    fused_adam_bf16_,
    reference_fused_adam_,
    reference_fused_adam_bf16_,
)
from tests.core.ops.test_optim import TORCH_SIZES, _torch_run

SIZES = (1, 7, 4099)
LR = 3e-3  # not an fp32 value: the tensor holds fp32(LR), the host number is set to that
HYPER = dict(beta1=0.9, beta2=0.999, eps=1e-8)


def _lists(pdt, bf16: bool, seed=0):
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(n, generator=g).to(pdt) for n in SIZES]
    grads = [torch.randn(n, generator=g) for n in SIZES]
    m = [torch.rand(n, generator=g) * 0.1 for n in SIZES]
    v = [torch.rand(n, generator=g) * 0.1 for n in SIZES]
    fourth = [] if bf16 or pdt == torch.float32 else [p.float() for p in params]
    steps = [torch.tensor(2.0) for _ in SIZES]
    return [params, grads, m, v, fourth, steps]


ADAM_CASES = {
    "adamw": dict(weight_decay=0.1, adam_w_mode=True, bias_correction=True),
    "adam L2": dict(weight_decay=0.1, adam_w_mode=False, bias_correction=True),
    "no bias correction": dict(weight_decay=0.0, adam_w_mode=True, bias_correction=False),
}
BF16_CASES = {
    f"{r}: {name}": kw | dict(rounding=r, seed=5, rng_step=2)
    for r in ("stochastic", "kahan")
    for name, kw in ADAM_CASES.items()
}


def _paths():
    return {
        "kernel": (fused_adam_, fused_adam_bf16_, contextlib.nullcontext),
        "reference": (reference_fused_adam_, reference_fused_adam_bf16_, contextlib.nullcontext),
        "torch path": (fused_adam_, fused_adam_bf16_, use_torch_path),
    }


def _step(fn, lists, ctx, **kw):
    with ctx():
        fn(*lists, **HYPER, **kw)
    return lists


def _same(a, b):
    for x, y in zip(a, b, strict=True):
        if isinstance(x, list):
            _same(x, y)
        else:
            assert torch.equal(x, y), "the two steps differ"


@pytest.mark.parametrize("path", list(_paths()))
@pytest.mark.parametrize("case", list(ADAM_CASES))
@pytest.mark.parametrize("pdt", [torch.float32, torch.bfloat16, torch.float16])
def test_adam_lr_tensor_steps_as_its_value(path, case, pdt):
    fn, _, ctx = _paths()[path]
    lr_t = torch.tensor(LR)
    kw = ADAM_CASES[case]
    on_device = _step(fn, _lists(pdt, False), ctx, lr=0.0, lr_tensor=lr_t, **kw)
    on_host = _step(fn, _lists(pdt, False), ctx, lr=float(lr_t), **kw)
    _same(on_device, on_host)


@pytest.mark.parametrize("path", ["kernel", "reference"])
@pytest.mark.parametrize("case", list(BF16_CASES))
def test_adam_bf16_lr_tensor_steps_as_its_value(path, case):
    _, fn, ctx = _paths()[path]
    lr_t = torch.tensor(LR)
    kw = dict(BF16_CASES[case])
    lists = _lists(torch.bfloat16, True)
    if kw["rounding"] == "kahan":
        lists[4] = [torch.zeros(n, dtype=torch.bfloat16) for n in SIZES]
    twin = [[t.clone() for t in lst] for lst in lists]
    _step(fn, lists, ctx, lr=0.0, lr_tensor=lr_t, **kw)
    _step(fn, twin, ctx, lr=float(lr_t), **kw)
    _same(lists, twin)


@pytest.mark.parametrize("path", list(_paths()))
def test_the_tensor_is_read_at_each_call(path):
    # What a schedule does between two replays: fill the same tensor; the next step uses it.
    fn, _, ctx = _paths()[path]
    lr_t = torch.tensor(LR)
    kw = ADAM_CASES["adamw"]
    a = _lists(torch.float32, False)
    _step(fn, a, ctx, lr=0.0, lr_tensor=lr_t, **kw)
    lr_t.fill_(LR / 10)
    _step(fn, a, ctx, lr=0.0, lr_tensor=lr_t, **kw)
    b = _lists(torch.float32, False)
    _step(fn, b, ctx, lr=float(torch.tensor(LR)), **kw)
    _step(fn, b, ctx, lr=float(torch.tensor(LR / 10)), **kw)
    _same(a, b)


def test_the_kernel_matches_the_reference_with_a_tensor_lr():
    lr_t = torch.tensor(LR)
    kw = ADAM_CASES["adamw"]
    got = _step(
        fused_adam_,
        _lists(torch.bfloat16, False),
        contextlib.nullcontext,
        lr=0.0,
        lr_tensor=lr_t,
        **kw,
    )
    want = _step(
        reference_fused_adam_,
        _lists(torch.bfloat16, False),
        contextlib.nullcontext,
        lr=0.0,
        lr_tensor=lr_t,
        **kw,
    )
    for g, w in zip(got[4], want[4], strict=True):  # the fp32 masters
        torch.testing.assert_close(g, w, rtol=2 * 2**-23, atol=2e-8)


@pytest.mark.parametrize(
    "bad, match",
    [
        (torch.tensor(LR, dtype=torch.float64), "float32"),
        (torch.tensor([LR, LR]), "one-element"),
    ],
)
def test_a_tensor_the_kernels_cannot_read_is_refused(bad, match):
    with pytest.raises(TypeError, match=match):
        fused_adam_(
            *_lists(torch.float32, False), **HYPER, lr=0.0, lr_tensor=bad, **ADAM_CASES["adamw"]
        )


def test_a_tensor_on_another_device_is_refused():
    lists = _lists(torch.float32, False)
    with pytest.raises(ValueError, match="lr_tensor is on meta"):
        fused_adam_(
            *lists,
            **HYPER,
            lr=0.0,
            lr_tensor=torch.tensor(LR, device="meta"),
            **ADAM_CASES["adamw"],
        )


@pytest.mark.parametrize("adam_w_mode", [True, False])
@pytest.mark.parametrize("n", TORCH_SIZES)
def test_fp32_adam_equals_torch_fused_adam_bitwise(kernels, adam_w_mode, n):
    """fp32 steps equal torch.optim.AdamW/Adam(fused=True) bit for bit: weights, moments, step
    counts, at any size (the last partial vector rounds as PyTorch's scalar tail)."""
    if not kernels:
        pytest.skip("the bitwise claim is the kernel's (MPNB_DISABLE_EXT=1 runs the references)")
    m, v, st = torch.zeros(n), torch.zeros(n), torch.tensor(0.0)
    cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam

    def ours(w, g, k):
        ops.fused_adam_(
            [w],
            [g],
            [m],
            [v],
            [],
            [st],
            lr=1e-2,
            beta1=0.9,
            beta2=0.999,
            eps=1e-8,
            weight_decay=0.1,
            adam_w_mode=adam_w_mode,
            bias_correction=True,
        )

    opt, p, w = _torch_run(lambda p: cls([p], lr=1e-2, weight_decay=0.1, fused=True), ours, n)
    s = opt.state[opt.param_groups[0]["params"][0]]
    assert torch.equal(st, s["step"])
    assert torch.equal(m, s["exp_avg"]) and torch.equal(v, s["exp_avg_sq"])
    assert torch.equal(w, p)


@pytest.mark.parametrize("beta2", [0.999, 0.95, 0.0, 1.0, 1.5])
def test_fp32_adam_divides_like_torch_at_every_step_count(kernels, beta2):
    """The kernel divides sqrt(exp_avg_sq) by sqrt(bias_correction2) with a multiply and two
    fmas (opt_common.h's ScalarDivisor): bit for bit PyTorch's division at 1200 step counts (as
    many divisors where bias_correction2 still rounds apart), exp_avg_sq over 2^-149..2^127 with
    0 and inf among them, and for betas no optimizer accepts (beta2 1.0 divides by 0, 1.5 by
    NaN: the plain division)."""
    if not kernels:
        pytest.skip("the bitwise claim is the kernel's (MPNB_DISABLE_EXT=1 runs the references)")
    gen = torch.Generator().manual_seed(5)
    n, count = 1500, 1200  # per tensor: under the route to PyTorch's op, one scalar tail
    steps = torch.unique(torch.logspace(0, 6, 4000).round())[:count]
    exps = torch.randint(-149, 128, (count, n), generator=gen).float()
    v = torch.rand(count, n, generator=gen).add(1).mul(torch.exp2(exps)).clamp(max=3e38)
    v[:, :3] = torch.tensor([0.0, float("inf"), 2.0**-149])
    lists = [
        [torch.randn(n, generator=gen) for _ in range(count)],  # params
        [torch.randn(n, generator=gen) * 1e3 for _ in range(count)],  # grads
        [torch.randn(n, generator=gen) for _ in range(count)],  # exp_avg
        [row.clone() for row in v],  # exp_avg_sq
        [s.reshape(()) - 1 for s in steps.float()],  # the kernels advance the counts first
    ]
    ref = [[t.clone() for t in ts] for ts in lists]
    p, g, m, v_, st = lists
    ops.fused_adam_(
        p,
        g,
        m,
        v_,
        [],
        st,
        lr=1e-3,
        beta1=0.9,
        beta2=beta2,
        eps=1e-8,
        weight_decay=0.0,
        adam_w_mode=True,
        bias_correction=True,
    )
    p, g, m, v_, st = ref
    for s in st:
        s.add_(1)
    torch._fused_adamw_(
        p,
        g,
        m,
        v_,
        [],
        st,
        lr=1e-3,
        beta1=0.9,
        beta2=beta2,
        weight_decay=0.0,
        eps=1e-8,
        amsgrad=False,
        maximize=False,
    )
    for ours, theirs in zip(lists[0] + lists[2] + lists[3], ref[0] + ref[2] + ref[3], strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0, equal_nan=True)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


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
