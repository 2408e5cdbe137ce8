"""The paths that serve devices without a kernel of ours (CUDA): PyTorch's fused optimizer ops
behind mpnb's op signatures. Exercised here on CPU tensors (PyTorch's fused ops exist on the
CPU too) against the kernels/references; GPU cases run where CUDA is."""

from __future__ import annotations

import copy

import pytest
import torch

from mpnb.core.ops import optimizers as O

SIZES = [1, 7, 33, 4000]
HALF = [torch.float16, torch.bfloat16]


def _lists(pdt, master, nstate, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(n, generator=g).to(pdt) for n in SIZES]
    grads = [(torch.randn(n, generator=g) * 64).to(pdt) for n in SIZES]
    masters = [p.float() for p in params] if master else []
    states = [[torch.rand(n, generator=g) * 0.1 for n in SIZES] for _ in range(nstate)]
    steps = [torch.tensor(3.0) for _ in SIZES]
    out = (params, grads, masters, states, steps)
    return out if device == "cpu" else copy.deepcopy(_to(out, device))


def _to(x, device):
    if isinstance(x, torch.Tensor):
        return x.to(device)
    return type(x)(_to(t, device) for t in x)


def _args(name, params, grads, masters, states, steps, first=None, **kw):
    if name == "adam":
        return (
            params,
            grads,
            states[0],
            states[1],
            masters,
            steps,
            1e-2,
            0.9,
            0.999,
            1e-8,
            kw.get("wd", 0.1),
            kw.get("adam_w_mode", True),
            kw.get("bc", True),
        )
    if name == "adagrad":
        return (
            params,
            grads,
            states[0],
            masters,
            steps,
            1e-2,
            1e-10,
            kw.get("wd", 0.1),
            kw.get("lr_decay", 0.01),
            kw.get("w_mode", False),
        )
    first = first if first is not None else [i % 2 == 0 for i in range(len(params))]
    return (
        params,
        grads,
        states[0],
        masters,
        first,
        0.1,
        kw.get("momentum", 0.9),
        0.0,
        kw.get("wd", 0.01),
        kw.get("nesterov", False),
        kw.get("wd_after", False),
    )


PATHS = {
    "adam": (O._torch_fused_adam_, O.fused_adam_, O.reference_fused_adam_, 2),
    "adagrad": (O._torch_fused_adagrad_, O.fused_adagrad_, O.reference_fused_adagrad_, 1),
    "sgd": (O._torch_fused_sgd_, O.fused_sgd_, O.reference_fused_sgd_, 1),
}
VARIANTS = [
    ("adam", {}),
    ("adam", {"adam_w_mode": False}),
    ("adagrad", {}),
    ("sgd", {}),
    ("sgd", {"nesterov": True}),
    ("sgd", {"momentum": 0.0}),
]


def _dispatch(name, args, scale):
    """The CPU kernel when built, else the reference (positional call of the same op)."""
    _, _, ref, _ = PATHS[name]
    if O.use_kernel(args[0]):
        getattr(torch.ops.mpnb, f"fused_{name}_")(*args, *scale)
    else:
        ref(*args, *scale)


@pytest.mark.parametrize("name,kw", VARIANTS, ids=[f"{n}-{k}" for n, k in VARIANTS])
@pytest.mark.parametrize(
    "pdt,master",
    [(torch.float32, False), (torch.bfloat16, True), (torch.float16, False)],
    ids=["fp32", "bf16-master", "fp16"],
)
def test_torch_path_matches_kernel(kernels, name, kw, pdt, master):
    path, _, _, nstate = PATHS[name]
    base = _lists(pdt, master, nstate)
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    grads_before = [g.clone() for g in a[1]]
    scale = (torch.tensor([1 / 64]), torch.zeros(1))
    assert path(*_args(name, *a, **kw), *scale)
    _dispatch(name, _args(name, *b, **kw), scale)
    assert all(torch.equal(x, y) for x, y in zip(a[1], grads_before, strict=True))  # read only
    for x, y in zip(
        a[0] + a[2] + sum(a[3], []) + a[4], b[0] + b[2] + sum(b[3], []) + b[4], strict=True
    ):
        torch.testing.assert_close(x.float(), y.float(), rtol=2e-6, atol=2e-7)
    if master:  # the half params are the rounded masters
        assert all(torch.equal(p, m.to(p.dtype)) for p, m in zip(a[0], a[2], strict=True))


@pytest.mark.parametrize("name", list(PATHS))
def test_torch_path_overflow_changes_nothing(kernels, name):
    path, _, _, nstate = PATHS[name]
    base = _lists(torch.bfloat16, True, nstate)
    a = copy.deepcopy(base)
    assert path(*_args(name, *a), torch.tensor([0.5]), torch.ones(1))
    flat = lambda x: x[0] + x[1] + x[2] + sum(x[3], []) + x[4]  # noqa: E731
    assert all(torch.equal(x, y) for x, y in zip(flat(a), flat(base), strict=True))


def test_sgd_torch_path_first_run_per_param(kernels):
    """torch._fused_sgd_ takes one is_first_step flag: mixed lists are split into two calls."""
    base = _lists(torch.float32, False, 1)
    for first in ([True] * 4, [False] * 4, [True, False, False, True]):
        a, b = copy.deepcopy(base), copy.deepcopy(base)
        assert O._torch_fused_sgd_(*_args("sgd", *a, first=first))
        O.reference_fused_sgd_(*_args("sgd", *b, first=first))
        for x, y in zip(a[0] + a[3][0], b[0] + b[3][0], strict=True):
            torch.testing.assert_close(x, y, rtol=2e-6, atol=2e-7)


@pytest.mark.parametrize(
    "name,kw", [("adam", {"bc": False}), ("adagrad", {"w_mode": True}), ("sgd", {"wd_after": True})]
)
def test_torch_path_declines_what_torch_lacks(name, kw):
    path, _, _, nstate = PATHS[name]
    a = _lists(torch.float32, False, nstate)
    before = copy.deepcopy(a)
    assert not path(*_args(name, *a, **kw))
    assert all(torch.equal(x, y) for x, y in zip(a[0], before[0], strict=True))


def test_dispatcher_routes_other_devices_to_torch_path(monkeypatch):
    """A device without our kernel takes PyTorch's fused op, or the reference when declined."""
    calls = []
    monkeypatch.setattr(O, "use_kernel", lambda *a: False)
    monkeypatch.setattr(O, "_on_other_device", lambda params: True)
    for name in ("adam", "adagrad", "sgd"):
        real = getattr(O, f"_torch_fused_{name}_")
        monkeypatch.setattr(
            O, f"_torch_fused_{name}_", lambda *a, _r=real, _n=name: calls.append(_n) or _r(*a)
        )
    a = _lists(torch.float32, False, 2)
    O.fused_adam_(
        a[0],
        a[1],
        a[3][0],
        a[3][1],
        [],
        a[4],
        lr=1e-3,
        beta1=0.9,
        beta2=0.99,
        eps=1e-8,
        weight_decay=0.0,
        adam_w_mode=True,
        bias_correction=True,
    )
    O.fused_adagrad_(a[0], a[1], a[3][0], [], a[4], lr=1e-3, eps=1e-10, weight_decay=0.0)
    O.fused_sgd_(
        a[0], a[1], a[3][0], [], [False] * 4, lr=0.1, momentum=0.9, wd_after_momentum=True
    )  # declined: the reference runs
    assert calls == ["adam", "adagrad", "sgd"]


# ---- on a GPU ------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(PATHS))
@pytest.mark.parametrize("half", HALF)
def test_cuda_one_pass_matches_cpu(kernels, name, half):
    _, wrapper, _, nstate = PATHS[name]
    base = _lists(half, True, nstate)
    cpu, gpu = copy.deepcopy(base), _lists(half, True, nstate, device="cuda")
    scale = (torch.tensor([1 / 64]), torch.zeros(1))
    _dispatch(name, _args(name, *cpu), scale)
    args = _args(name, *gpu)
    wrapper(
        *args[:5],
        **dict(zip(_KW[name], args[5:], strict=True)),
        inv_scale=scale[0].cuda(),
        found_inf=scale[1].cuda(),
    )
    for x, y in zip(cpu[2] + sum(cpu[3], []), gpu[2] + sum(gpu[3], []), strict=True):
        torch.testing.assert_close(x, y.cpu(), rtol=1e-5, atol=1e-6)


_KW = {
    "adam": ("lr", "beta1", "beta2", "eps", "weight_decay", "adam_w_mode", "bias_correction"),
    "adagrad": ("lr", "eps", "weight_decay", "lr_decay", "adagrad_w_mode"),
    "sgd": ("lr", "momentum", "dampening", "weight_decay", "nesterov", "wd_after_momentum"),
}


@pytest.mark.gpu
@pytest.mark.parametrize(
    "cls", ["FusedAdam", "FusedSGD", "FusedAdagrad", "FusedLAMB", "FusedNovoGrad"]
)
def test_cuda_optimizers_step_and_skip(cls):
    from mpnb import optimizers

    torch.manual_seed(0)
    model = torch.nn.Linear(16, 8).cuda().to(torch.bfloat16)
    kw = {"lr": 0.1} if cls == "FusedSGD" else {}
    opt = getattr(optimizers, cls)(model.parameters(), master_weights=True, **kw)
    model(torch.randn(4, 16, device="cuda", dtype=torch.bfloat16)).float().sum().backward()
    before = [p.detach().clone() for p in model.parameters()]
    model.weight.grad[0, 0] = float("inf")
    found = torch.zeros(1, device="cuda")
    opt._mpnb_set_scale(torch.ones(1, device="cuda"), found)
    opt.step()
    assert found.item() == 1
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    model.weight.grad[0, 0] = 0.0
    opt.step()
    assert not torch.equal(before[0], model.weight)
