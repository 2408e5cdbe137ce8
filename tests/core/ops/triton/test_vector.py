"""The list kernels' two spans (``mpnb/core/ops/triton/_vector.py``): 16-byte accesses on the
aligned span and element-wise ones on the rest, with the same results bit for bit.

Every list op runs twice on the same values: once on tensors of their own (aligned: the
vector span, then the scalar rest of each tensor) and once on views at odd addresses of flat
buffers (the scalar span alone, which is the single loop the kernels had before the split).
The sizes put the end of the vector span inside a step, on a step's edge, and below one
16-byte group. That the compiled kernels do use vector accesses on the aligned span is
checked on their sm_90 PTX by ``test_compiles.py``.
"""

from __future__ import annotations

import pytest
import torch

from .triton_cases import bitwise, gen, kernel, randn

F32, BF16 = torch.float32, torch.bfloat16
#: one element, under a 16-byte group, one group and one over, a span ending inside a step,
#: and a second chunk of 13 (8192 elements per chunk)
SIZES = (1, 7, 9, 1100, 8205)


def _lists(g, *dtypes, scale=1.0):
    return [[randn(n, dt, g, scale) for n in SIZES] for dt in dtypes]


def _case(name, g) -> dict:
    """The keyword arguments of one call of ``name``: tensors, lists and numbers (the second
    argument of every op is a list of data)."""
    one = torch.ones(1)
    flag = torch.zeros(1, dtype=torch.int32)
    steps = [torch.tensor(float(k + 2)) for k in range(len(SIZES))]
    if name == "multi_tensor_scale":
        src, dst = _lists(g, BF16, F32)
        return dict(noop_flag=flag, src=src, dst=dst, scale=0.5, scale_tensor=one)
    if name == "multi_tensor_l2norm":
        ts = _lists(g, F32, scale=30.0)[0]
        return dict(noop_flag=flag, tensors=ts, per_tensor=True, inv_scale=torch.tensor([0.25]))
    if name == "multi_tensor_check_finite":
        (ts,) = _lists(g, BF16)
        ts[3][1099] = float("inf")  # in the scalar rest of an aligned tensor
        return dict(noop_flag=flag, tensors=ts)
    p, gr, w = _lists(g, BF16, BF16, F32)
    m, v = ([t.abs() * 0.1 for t in ts] for ts in _lists(g, F32, F32))
    lists = dict(params=p, grads=gr, exp_avgs=m, exp_avg_sqs=v)
    flags = dict(inv_scale=torch.tensor([0.5]), found_inf=None)
    sr = dict(rounding="stochastic", seed=1, rng_step=3)
    adam = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)
    adam |= dict(adam_w_mode=True, bias_correction=True)
    if name == "fused_adam_":
        return dict(**lists, masters=w, steps=steps, **adam, **flags | dict(found_inf=one * 0))
    if name == "fused_adam_bf16_":
        return dict(**lists, compensations=[], steps=steps, **adam, **sr, **flags)
    sgd = dict(
        params=p, grads=gr, momentum_buffers=m, first_run=[k % 2 == 0 for k in range(len(SIZES))]
    )
    sgd |= dict(lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01)
    if name == "fused_sgd_":
        return dict(**sgd, masters=w, nesterov=True, wd_after_momentum=False, **flags)
    if name == "fused_sgd_bf16_":
        comps = _lists(g, BF16, scale=1e-3)[0]
        sgd |= dict(nesterov=False, wd_after_momentum=True, rounding="kahan", seed=1, rng_step=3)
        return dict(**sgd, compensations=comps, **flags)
    lamb = dict(global_grad_norm=torch.tensor([3.0]), **adam, grad_averaging=True)
    lamb |= dict(eps=1e-6, weight_decay=0.01, max_grad_norm=1.0, use_nvlamb=False)
    if name == "fused_lamb_":
        return dict(**lists, masters=w, steps=steps, **lamb, **flags)
    return dict(**lists, compensations=[], steps=steps, **lamb, **sr, **flags)


OPS = (
    "multi_tensor_scale",
    "multi_tensor_l2norm",
    "multi_tensor_check_finite",
    "fused_adam_",
    "fused_adam_bf16_",
    "fused_sgd_",
    "fused_sgd_bf16_",
    "fused_lamb_",
    "fused_lamb_bf16_",
)


def _at_odd_addresses(ts, device):
    """Copies of ``ts`` as views of one flat buffer, each one element past a 64-byte line."""
    at, starts = 0, []
    for t in ts:
        starts.append(at + 1)
        at = -(-(at + 1 + t.numel()) // 32) * 32
    flat = torch.zeros(at + 32, dtype=ts[0].dtype, device=device)
    views = [flat[s : s + t.numel()].view(t.shape) for s, t in zip(starts, ts, strict=True)]
    for view, t in zip(views, ts, strict=True):
        view.copy_(t)
    assert all(v.data_ptr() % 16 for v in views)
    return views


def _placed(args: dict, device, odd) -> dict:
    """``args`` on ``device``: the lists of data as views at odd addresses when ``odd`` (the
    one-element steps stay as they are: their column is no part of the aligned row)."""
    out = {}
    for k, a in args.items():
        if isinstance(a, torch.Tensor):
            out[k] = a.to(device, copy=True)
        elif isinstance(a, list) and a and isinstance(a[0], torch.Tensor):
            copies = [t.to(device, copy=True) for t in a]
            data = a[-1].numel() == SIZES[-1]
            out[k] = _at_odd_addresses(copies, device) if odd and data else copies
        else:
            out[k] = a
    return out


def _state(args: dict, result):
    values = list(args.values())
    tensors = [a for a in values if isinstance(a, torch.Tensor)]
    tensors += [t for a in values if isinstance(a, list) for t in a if isinstance(t, torch.Tensor)]
    if isinstance(result, tuple):
        tensors += list(result)
    return [t.cpu() for t in tensors]


@pytest.mark.parametrize("odd", ["all", "grads"])
@pytest.mark.parametrize("name", OPS)
def test_views_at_odd_addresses_match_aligned_tensors_bitwise(device, name, odd):
    args = _case(name, gen(7))
    aligned = _placed(args, device, odd=False)
    views = _placed(args, device, odd=True)
    if odd == "grads":  # one list misaligned (argument 1: a list of data in every op) sends
        views = _placed(args, device, odd=False)  # the whole row to the scalar span
        second = list(args)[1]
        views[second] = _placed({second: args[second]}, device, odd=True)[second]
    want = _state(aligned, kernel(name)(**aligned))
    got = _state(views, kernel(name)(**views))
    bitwise(got, want)
    assert any(bool(torch.any(t != 0)) for t in want)  # the call did something


def test_the_odd_views_really_are_unaligned(device):
    views = _placed(_case("fused_adam_", gen(0)), device, odd=True)
    assert all(t.data_ptr() % 16 for lst in list(views.values())[:5] for t in lst)
