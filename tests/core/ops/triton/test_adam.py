"""The Triton Adam kernels' learning rate on the device (``lr_tensor``): a step with the tensor
equals the step with its value as a host number, bit for bit, reads the tensor afresh at each
launch, and matches the reference given the same tensor."""

from __future__ import annotations

import pytest
import torch

from .triton_cases import bitwise, close, gen, kernel, on, randn, reference

SIZES = (1, 7, 1025, 8193)
LR = 3e-3
HYPER = dict(beta1=0.9, beta2=0.999, eps=1e-8)
CASES = {
    "adamw": dict(weight_decay=0.1, adam_w_mode=True, bias_correction=True),
    "adam L2": dict(weight_decay=0.1, adam_w_mode=False, bias_correction=True),
    "no bias correction": dict(weight_decay=0.1, adam_w_mode=True, bias_correction=False),
}
MIXES = {"fp32": (torch.float32, False), "O2 bf16": (torch.bfloat16, True)}


def _lists(pdt, master: bool, seed=0, fourth=None):
    g = gen(seed)
    params = [randn(n, pdt, g) for n in SIZES]
    grads = [randn(n, pdt, g) for n in SIZES]
    m = [torch.rand(n, generator=g) * 0.1 for n in SIZES]
    v = [torch.rand(n, generator=g) * 0.1 for n in SIZES]
    if fourth is None:
        fourth = [p.float() for p in params] if master else []
    return [params, grads, m, v, fourth, [torch.tensor(2.0) for _ in SIZES]]


def _bf16_kw(rounding):
    return dict(rounding=rounding, seed=3, rng_step=1)


def _run(fn, device, lists, **kw):
    lists = on(device, lists)
    fn(*lists, **HYPER, **kw)
    return lists


@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize("case", list(CASES))
def test_adam_tensor_lr_is_the_host_lr(device, mix, case):
    lists = _lists(*MIXES[mix])
    lr_t = torch.tensor(LR, device=device)
    got = _run(kernel("fused_adam_"), device, lists, lr=0.0, lr_tensor=lr_t, **CASES[case])
    want = _run(kernel("fused_adam_"), device, lists, lr=float(lr_t), **CASES[case])
    bitwise(got, [[t.cpu() for t in lst] for lst in want])


@pytest.mark.parametrize("rounding", ["stochastic", "kahan"])
@pytest.mark.parametrize("case", list(CASES))
def test_adam_bf16_tensor_lr_is_the_host_lr(device, rounding, case):
    comps = [torch.zeros(n, dtype=torch.bfloat16) for n in SIZES] if rounding == "kahan" else []
    lists = _lists(torch.bfloat16, False, fourth=comps)
    lr_t = torch.tensor(LR, device=device)
    fn, kw = kernel("fused_adam_bf16_"), CASES[case] | _bf16_kw(rounding)
    got = _run(fn, device, lists, lr=0.0, lr_tensor=lr_t, **kw)
    want = _run(fn, device, lists, lr=float(lr_t), **kw)
    bitwise(got, [[t.cpu() for t in lst] for lst in want])


def test_adam_reads_the_tensor_at_each_launch(device):
    lr_t = torch.tensor(LR, device=device)
    kw = CASES["adamw"]
    a = on(device, _lists(torch.float32, False))
    kernel("fused_adam_")(*a, **HYPER, lr=0.0, lr_tensor=lr_t, **kw)
    lr_t.fill_(LR / 10)  # as an LR schedule writes between two replays
    kernel("fused_adam_")(*a, **HYPER, lr=0.0, lr_tensor=lr_t, **kw)
    b = on(device, _lists(torch.float32, False))
    for lr in (float(torch.tensor(LR)), float(torch.tensor(LR / 10))):
        kernel("fused_adam_")(*b, **HYPER, lr=lr, **kw)
    bitwise(a, [[t.cpu() for t in lst] for lst in b])


@pytest.mark.parametrize("case", list(CASES))
def test_adam_tensor_lr_matches_the_reference(device, ulps, case):
    lists = _lists(torch.float32, False)
    got = _run(
        kernel("fused_adam_"),
        device,
        lists,
        lr=0.0,
        lr_tensor=torch.tensor(LR, device=device),
        **CASES[case],
    )
    want = _run(
        reference("fused_adam_"), "cpu", lists, lr=0.0, lr_tensor=torch.tensor(LR), **CASES[case]
    )
    close(got[0], want[0], 2 * ulps)
    close(got[2:4], want[2:4], 2 * ulps)
    bitwise(got[5], want[5])
