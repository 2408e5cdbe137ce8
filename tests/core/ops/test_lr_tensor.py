"""The learning rate on the device (``lr_tensor``) of ``fused_adam_`` / ``fused_adam_bf16_``:
each implementation (the C++ kernel, the reference, the PyTorch-ops path of CUDA) steps with
the tensor's value exactly as with that value as a host number, reads it afresh each call (an
LR schedule writing into it reaches a captured step), and refuses a tensor it cannot read.
The Triton kernels' twin of this file is ``triton_kernels/test_lr_tensor.py``."""

from __future__ import annotations

import contextlib

import pytest
import torch

from mpnb.core.ops import use_torch_path
from mpnb.core.ops.adam import (
    fused_adam_,
    fused_adam_bf16_,
    reference_fused_adam_,
    reference_fused_adam_bf16_,
)

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
