"""What the optimizer op families share (``mpnb/core/ops/_optim.py``), beyond the op table
(which checks kernel == reference per dtype).

On the kernels and on the references (``op_impl``), for every optimizer op: the one-pass
mixed-precision step equals its separate-pass sequence bit for bit, a set ``found_inf`` writes
nothing (step counts included), a clear one advances each step count by exactly one, and bad
lists raise the errors of ``check_step`` that name the fix. The PyTorch path (``via_torch``,
registered for CUDA) equals the op on CPU tensors and runs the reference for what PyTorch's
fused ops lack. Each op's own claims (bitwise parity with ``torch.optim``, its own argument
errors) are in its unit file (``test_adam.py``, ``test_sgd.py``, ...).
"""

from __future__ import annotations

import copy

import pytest
import torch

import mpnb.core.ops as ops
from mpnb.core.ops._optim import lists_for

SIZES = (1, 7, 16, 33, 40000, 70001)  # tails, one block, several chunks


def _call(name, lists, **extra):
    """``(wrapper, args, kwargs)`` of one call of ``fused_<name>_`` on ``lists_for``'s lists."""
    params, grads, masters, states, steps = lists
    if name == "adam":
        kw = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)
        kw |= dict(adam_w_mode=True, bias_correction=True)
        return ops.fused_adam_, (params, grads, *states, masters, steps), kw | extra
    if name == "adagrad":
        kw = dict(lr=1e-2, eps=1e-10, weight_decay=0.1, lr_decay=0.0, adagrad_w_mode=False)
        return ops.fused_adagrad_, (params, grads, states[0], masters, steps), kw | extra
    if name == "sgd":
        kw = dict(lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01, nesterov=False)
        first = [False] * len(params)
        return ops.fused_sgd_, (params, grads, states[0], masters, first), kw | extra
    if name == "lamb":
        kw = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.01)
        gnorm = torch.tensor([3.0])
        return ops.fused_lamb_, (params, grads, *states, masters, steps, gnorm), kw | extra
    kw = dict(lr=1e-2, beta1=0.95, beta2=0.98, eps=1e-8, weight_decay=0.01)
    vs = [torch.tensor(0.5) for _ in params]
    norms = torch.linspace(0.1, 2.0, len(params))
    return ops.fused_novograd_, (params, grads, states[0], vs, masters, steps, norms), kw | extra


NSTATE = {"adam": 2, "adagrad": 1, "sgd": 1, "lamb": 2, "novograd": 1}
OPS = list(NSTATE)


def _flat(lists):
    params, grads, masters, states, steps = lists
    return [*params, *grads, *masters, *sum(states, []), *steps]


@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
def test_one_pass_equals_unscale_check_update_cast(op_impl, name, half):
    """One pass (half grad in, master + state + half param out) == the four-pass sequence."""
    base = lists_for(half, half, True, NSTATE[name], SIZES, grad_scale=1024.0)
    inv = torch.tensor([1.0 / 1024])
    one = copy.deepcopy(base)
    found = torch.zeros(1)
    ops.multi_tensor_check_finite(found, one[1])
    fn, args, kw = _call(name, one, inv_scale=inv, found_inf=found)
    fn(*args, **kw)

    params, grads, masters, states, steps = seq = copy.deepcopy(base)
    found2 = torch.zeros(1)
    g32 = [torch.empty_like(g, dtype=torch.float32) for g in grads]
    ops.multi_tensor_scale(found2, grads, g32, 1.0, inv)  # unscale + check
    fn, args, kw = _call(name, (masters, g32, [], states, steps), found_inf=found2)
    fn(*args, **kw)  # update the fp32 masters
    for p, m in zip(params, masters, strict=True):  # cast back
        p.copy_(m)
    assert found.item() == 0 and found2.item() == 0
    assert all(torch.equal(a, b) for a, b in zip(_flat(one), _flat(seq), strict=True))


@pytest.mark.parametrize("name", OPS)
def test_set_found_inf_writes_nothing_and_a_clear_one_counts_one_step(op_impl, name):
    base = lists_for(torch.bfloat16, torch.bfloat16, True, NSTATE[name], SIZES)
    base[1][-1][-1] = float("inf")
    lists = copy.deepcopy(base)
    found = torch.zeros(1)
    ops.multi_tensor_check_finite(found, lists[1])
    assert found.item() == 1
    fn, args, kw = _call(name, lists, inv_scale=torch.tensor([0.5]), found_inf=found)
    fn(*args, **kw)
    assert all(torch.equal(a, b) for a, b in zip(_flat(lists), _flat(base), strict=True))

    clean = lists_for(torch.bfloat16, torch.bfloat16, True, NSTATE[name], SIZES)
    fn, args, kw = _call(name, clean, found_inf=torch.zeros(1))
    fn(*args, **kw)
    if name != "sgd":  # SGD has no step count
        assert all(s.item() == 4.0 for s in clean[4])  # lists_for's steps hold 3
    assert not torch.equal(clean[0][-1], base[0][-1])


TORCH_SIZES = (1, 9, 1003, 40003)  # PyTorch's scalar tail, one vector, chunks of ours


def _torch_run(make, ours, n, steps=8):
    """``steps`` steps of a torch.optim optimizer built by ``make(param)`` and of ``ours(w, g,
    k)`` on copies of one fp32 param, with the same grads; returns (optimizer, param, w)."""
    torch.manual_seed(n)
    p = torch.nn.Parameter(torch.randn(n))
    opt, w = make(p), p.detach().clone()
    for k in range(steps):
        g = torch.randn(n)
        p.grad = g.clone()
        opt.step()
        ours(w, g, k)
    return opt, p.detach(), w


def _adam_kw():
    return dict(
        lr=1e-3,
        beta1=0.9,
        beta2=0.999,
        eps=1e-8,
        weight_decay=0.0,
        adam_w_mode=True,
        bias_correction=True,
    )


BAD = {
    "sizes": (
        ValueError,
        "same size",
        lambda: ops.fused_adam_(
            [torch.randn(4)],
            [torch.randn(5)],
            [torch.zeros(4)],
            [torch.zeros(4)],
            [],
            [torch.tensor(0.0)],
            **_adam_kw(),
        ),
    ),
    "half state": (
        TypeError,
        "keep state in fp32",
        lambda: ops.fused_adam_(
            [torch.randn(4)],
            [torch.randn(4)],
            [torch.zeros(4, dtype=torch.half)],
            [torch.zeros(4)],
            [],
            [torch.tensor(0.0)],
            **_adam_kw(),
        ),
    ),
    "fp64 params": (
        TypeError,
        "float32, float16 or bfloat16",
        lambda: ops.fused_adam_(
            [torch.randn(4, dtype=torch.float64)],
            [torch.randn(4, dtype=torch.float64)],
            [torch.zeros(4)],
            [torch.zeros(4)],
            [],
            [torch.tensor(0.0)],
            **_adam_kw(),
        ),
    ),
    "masters count": (
        ValueError,
        "one fp32 tensor per param",
        lambda: ops.fused_adam_(
            [torch.randn(4).bfloat16()] * 2,
            [torch.randn(4)] * 2,
            [torch.zeros(4)] * 2,
            [torch.zeros(4)] * 2,
            [torch.zeros(4)],
            [torch.tensor(0.0)] * 2,
            **_adam_kw(),
        ),
    ),
    "int step": (
        TypeError,
        r"torch.tensor\(0.0\)",
        lambda: ops.fused_adagrad_(
            [torch.randn(4)],
            [torch.randn(4)],
            [torch.zeros(4)],
            [],
            [torch.tensor(0)],
            lr=1e-2,
            eps=1e-10,
            weight_decay=0.0,
        ),
    ),
    "steps count": (
        ValueError,
        "one tensor per param",
        lambda: ops.fused_adagrad_(
            [torch.randn(4)],
            [torch.randn(4)],
            [torch.zeros(4)],
            [],
            [],
            lr=1e-2,
            eps=1e-10,
            weight_decay=0.0,
        ),
    ),
    "two-element found_inf": (
        ValueError,
        "one-element tensor",
        lambda: ops.fused_sgd_(
            [torch.randn(4)], [torch.randn(4)], [], [], [True], lr=0.1, found_inf=torch.zeros(2)
        ),
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_arguments_raise_errors_that_name_the_fix(op_impl, case):
    """The kernel and the reference raise the same exception type, naming the fix."""
    exc, fix, call = BAD[case]
    with pytest.raises(exc, match=fix):
        call()


# ---- the PyTorch path (``torch_path=``, registered for CUDA): PyTorch's own fused optimizer
# ops behind mpnb's op signatures, exercised on CPU tensors against the op on the CPU
# (kernel or reference); the GPU cases run where CUDA is.
PATH_SIZES = (1, 7, 33, 4000)
PATH_NSTATE = {"adam": 2, "adagrad": 1, "sgd": 1}


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
    base = lists_for(pdt, pdt, master, PATH_NSTATE[name], PATH_SIZES, grad_scale=64.0)
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    scale = (torch.tensor([1 / 64]), torch.zeros(1))
    _path(name)(*_args(name, a, **kw), *scale)
    _op(name)(*_args(name, b, **kw), *scale)
    assert all(torch.equal(x, y) for x, y in zip(a[1], base[1], strict=True))  # grads read only
    for x, y in zip(_flat(a), _flat(b), strict=True):
        torch.testing.assert_close(x.float(), y.float(), rtol=2e-6, atol=2e-7)
    if master:  # the half params are the rounded masters
        assert all(torch.equal(p, m.to(p.dtype)) for p, m in zip(a[0], a[2], strict=True))


@pytest.mark.parametrize("name", list(PATH_NSTATE))
def test_torch_path_set_found_inf_changes_nothing(kernels, name):
    base = lists_for(torch.bfloat16, torch.bfloat16, True, PATH_NSTATE[name], PATH_SIZES)
    a = copy.deepcopy(base)
    _path(name)(*_args(name, a), torch.tensor([0.5]), torch.ones(1))
    assert all(torch.equal(x, y) for x, y in zip(_flat(a), _flat(base), strict=True))


@pytest.mark.parametrize(
    "name,kw", [("adam", {"bc": False}), ("adagrad", {"w_mode": True}), ("sgd", {"wd_after": True})]
)
def test_torch_path_runs_the_reference_for_what_torch_lacks(name, kw):
    """Options PyTorch's ops cannot express (no bias correction, adagrad_w_mode,
    wd_after_momentum): the path runs the reference, bit for bit."""
    base = lists_for(torch.bfloat16, torch.float32, True, PATH_NSTATE[name], PATH_SIZES)
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
@pytest.mark.parametrize("name", list(PATH_NSTATE))
@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16])
def test_cuda_one_pass_matches_cpu(kernels, name, half):
    base = lists_for(half, half, True, PATH_NSTATE[name], PATH_SIZES, grad_scale=64.0)
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
