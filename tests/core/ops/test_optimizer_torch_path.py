"""The optimizer ops' PyTorch path (``torch_path=``, registered for CUDA): PyTorch's own fused
optimizer ops behind mpnb's op signatures.

PyTorch's fused ops exist on the CPU too, so the path is exercised here on CPU tensors, called
from the op table, against the op on the CPU (kernel or reference); the GPU cases run where
CUDA is.
"""

from __future__ import annotations

import copy

import pytest
import torch

import mpnb.core.ops as ops
from mpnb.core.ops._optim import lists_for

SIZES = (1, 7, 33, 4000)
NSTATE = {"adam": 2, "adagrad": 1, "sgd": 1}


def _args(name, lists, first=None, **kw):
    """Positional args of ``fused_<name>_`` (without ``inv_scale``/``found_inf``)."""
    params, grads, masters, states, steps = lists
    if name == "adam":
        hyper = (1e-2, 0.9, 0.999, 1e-8, kw.get("wd", 0.1), kw.get("adam_w_mode", True))
        return (params, grads, *states, masters, steps, *hyper, kw.get("bc", True))
    if name == "adagrad":
        hyper = (1e-2, 1e-10, kw.get("wd", 0.1), kw.get("lr_decay", 0.01), kw.get("w_mode", False))
        return (params, grads, states[0], masters, steps, *hyper)
    first = first if first is not None else [i % 2 == 0 for i in range(len(params))]
    hyper = (0.1, kw.get("momentum", 0.9), 0.0, kw.get("wd", 0.01), kw.get("nesterov", False))
    return (params, grads, states[0], masters, first, *hyper, kw.get("wd_after", False))


def _path(name):
    return ops.op_info(f"fused_{name}_").torch_path


def _op(name):
    return ops.op_info(f"fused_{name}_").overload


def _flat(lists):
    params, grads, masters, states, steps = lists
    return [*params, *grads, *masters, *sum(states, []), *steps]


VARIANTS = [
    ("adam", {}),
    ("adam", {"adam_w_mode": False}),
    ("adagrad", {}),
    ("sgd", {}),
    ("sgd", {"nesterov": True}),
    ("sgd", {"momentum": 0.0}),
]


@pytest.mark.parametrize("name,kw", VARIANTS, ids=[f"{n}-{k}" for n, k in VARIANTS])
@pytest.mark.parametrize(
    "pdt,master",
    [(torch.float32, False), (torch.bfloat16, True), (torch.float16, False)],
    ids=["fp32", "bf16-master", "fp16"],
)
def test_torch_path_matches_the_op(kernels, name, kw, pdt, master):
    base = lists_for(pdt, pdt, master, NSTATE[name], SIZES, grad_scale=64.0)
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    scale = (torch.tensor([1 / 64]), torch.zeros(1))
    _path(name)(*_args(name, a, **kw), *scale)
    _op(name)(*_args(name, b, **kw), *scale)
    assert all(torch.equal(x, y) for x, y in zip(a[1], base[1], strict=True))  # grads read only
    for x, y in zip(_flat(a), _flat(b), strict=True):
        torch.testing.assert_close(x.float(), y.float(), rtol=2e-6, atol=2e-7)
    if master:  # the half params are the rounded masters
        assert all(torch.equal(p, m.to(p.dtype)) for p, m in zip(a[0], a[2], strict=True))


@pytest.mark.parametrize("name", list(NSTATE))
def test_torch_path_set_found_inf_changes_nothing(kernels, name):
    base = lists_for(torch.bfloat16, torch.bfloat16, True, NSTATE[name], SIZES)
    a = copy.deepcopy(base)
    _path(name)(*_args(name, a), torch.tensor([0.5]), torch.ones(1))
    assert all(torch.equal(x, y) for x, y in zip(_flat(a), _flat(base), strict=True))


def test_sgd_torch_path_first_run_per_param(kernels):
    """torch._fused_sgd_ takes one is_first_step flag: mixed lists are split into two calls."""
    base = lists_for(torch.float32, torch.float32, False, 1, SIZES)
    for first in ([True] * 4, [False] * 4, [True, False, False, True]):
        a, b = copy.deepcopy(base), copy.deepcopy(base)
        _path("sgd")(*_args("sgd", a, first=first))
        ops.op_info("fused_sgd_").reference_kernel(*_args("sgd", b, first=first))
        for x, y in zip(a[0] + a[3][0], b[0] + b[3][0], strict=True):
            torch.testing.assert_close(x, y, rtol=2e-6, atol=2e-7)


@pytest.mark.parametrize(
    "name,kw", [("adam", {"bc": False}), ("adagrad", {"w_mode": True}), ("sgd", {"wd_after": True})]
)
def test_torch_path_runs_the_reference_for_what_torch_lacks(name, kw):
    """Options PyTorch's ops cannot express (no bias correction, adagrad_w_mode,
    wd_after_momentum): the path runs the reference, bit for bit."""
    base = lists_for(torch.bfloat16, torch.float32, True, NSTATE[name], SIZES)
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    _path(name)(*_args(name, a, **kw), torch.tensor([0.5]), None)
    ref = ops.op_info(f"fused_{name}_").reference_kernel  # positional, as the schema
    ref(*_args(name, b, **kw), torch.tensor([0.5]), None)
    assert all(torch.equal(x, y) for x, y in zip(_flat(a), _flat(b), strict=True))
    assert not torch.equal(a[0][-1], base[0][-1])


def test_cuda_key_takes_pytorch_fused_ops_where_pytorch_has_them():
    """The dispatcher's CUDA kernel: PyTorch's fused ops for Adam, Adagrad and SGD; LAMB and
    NovoGrad (no fused PyTorch op) run their references there."""
    for name in ("fused_adam_", "fused_adagrad_", "fused_sgd_"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"mpnb::{name}", "CUDA"), name
        assert ops.op_path(name, "cuda").startswith("PyTorch's fused CUDA ops")
    for name in ("fused_lamb_", "fused_novograd_"):
        assert not torch._C._dispatch_has_kernel_for_dispatch_key(f"mpnb::{name}", "CUDA")
        assert ops.op_path(name, "cuda").startswith("reference")


# ---- on a GPU ------------------------------------------------------------------------------

_KW = {
    "adam": ("lr", "beta1", "beta2", "eps", "weight_decay", "adam_w_mode", "bias_correction"),
    "adagrad": ("lr", "eps", "weight_decay", "lr_decay", "adagrad_w_mode"),
    "sgd": ("lr", "momentum", "dampening", "weight_decay", "nesterov", "wd_after_momentum"),
}


def _to(x, device):
    if isinstance(x, torch.Tensor):
        return x.to(device)
    return type(x)(_to(t, device) for t in x)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(NSTATE))
@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16])
def test_cuda_one_pass_matches_cpu(kernels, name, half):
    base = lists_for(half, half, True, NSTATE[name], SIZES, grad_scale=64.0)
    cpu, gpu = copy.deepcopy(base), _to(base, "cuda")
    scale = (torch.tensor([1 / 64]), torch.zeros(1))
    _op(name)(*_args(name, cpu), *scale)
    args = _args(name, gpu)
    wrapper = getattr(ops, f"fused_{name}_")
    nlists = 6 if name == "adam" else 5  # the list arguments, before the hyper-parameters
    wrapper(
        *args[:nlists],
        **dict(zip(_KW[name], args[nlists:], strict=True)),
        inv_scale=scale[0].cuda(),
        found_inf=scale[1].cuda(),
    )
    for x, y in zip(cpu[2] + sum(cpu[3], []), gpu[2] + sum(gpu[3], []), strict=True):
        torch.testing.assert_close(x, y.cpu(), rtol=1e-5, atol=1e-6)
