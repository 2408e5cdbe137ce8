"""Triton Adam/AdamW, SGD and LAMB steps against their references (CPU interpreter, or the GPU
when there is one): every param/grad dtype mix, the O2 one pass equal to its separate passes,
a flagged overflow writing nothing, and inf/NaN grads propagating as in the reference."""

from __future__ import annotations

import pytest
import torch

from .triton_cases import SIZES, bitwise, clone, close, gen, kernel, on, poison, randn, reference

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
REFERENCES = {name: reference(name) for name in ("fused_adam_", "fused_sgd_", "fused_lamb_")}
# (param dtype, grad dtype, fp32 masters): O0, O2 with bf16 and fp16, fp32 grads into half
# params, and half params updated without masters.
MIXES = [
    (F32, F32, False),
    (BF16, BF16, True),
    (F16, F16, True),
    (F16, F32, True),
    (BF16, BF16, False),
]


def _state(pdt, gdt, master, seed=0):
    g = gen(seed)
    params = [randn(n, pdt, g) for n in SIZES]
    grads = [randn(n, gdt, g) for n in SIZES]
    masters = [p.float() for p in params] if master else []
    moments = [[torch.rand(n, generator=g) * 0.1 for n in SIZES] for _ in range(2)]
    steps = [torch.tensor(float(k + 2)) for k in range(len(SIZES))]
    return [params, grads, masters, moments, steps]


def _args(name, st, opts, inv, found) -> dict:
    """The keyword arguments of one call of op ``name`` on the state ``st``."""
    params, grads, masters, (m, v), steps = st
    flags = dict(inv_scale=inv, found_inf=found)
    lists = dict(params=params, grads=grads, exp_avgs=m, exp_avg_sqs=v, masters=masters)
    if name == "fused_adam_":
        lr, wd, adam_w, bias = opts
        return dict(
            **lists,
            steps=steps,
            lr=lr,
            beta1=0.9,
            beta2=0.999,
            eps=1e-8,
            weight_decay=wd,
            adam_w_mode=adam_w,
            bias_correction=bias,
            **flags,
        )
    if name == "fused_sgd_":
        momentum, nesterov, wd_after = opts
        # without momentum the optimizer passes no buffers and no first_run flags
        return dict(
            params=params,
            grads=grads,
            momentum_buffers=m if momentum else [],
            masters=masters,
            first_run=[k % 2 == 0 for k in range(len(params))] if momentum else [],
            lr=0.1,
            momentum=momentum,
            dampening=0.1,
            weight_decay=0.01,
            nesterov=nesterov,
            wd_after_momentum=wd_after,
            **flags,
        )
    gnorm, max_norm, adam_w, nvlamb, wd = opts
    return dict(
        **lists,
        steps=steps,
        global_grad_norm=gnorm,
        lr=1e-2,
        beta1=0.9,
        beta2=0.999,
        eps=1e-6,
        weight_decay=wd,
        adam_w_mode=adam_w,
        bias_correction=True,
        grad_averaging=True,
        max_grad_norm=max_norm,
        use_nvlamb=nvlamb,
        **flags,
    )


def _run(name, device, base, opts, inv=0.5, found=None):
    """The kernel's and the reference's state after one step from ``base``."""
    out = []
    for fn, dev in ((kernel(name), device), (REFERENCES[name], "cpu")):
        st = on(dev, base)
        opts_dev = tuple(o.to(dev) if isinstance(o, torch.Tensor) else o for o in opts)
        fn(
            **_args(
                name,
                st,
                opts_dev,
                None if inv is None else torch.tensor([inv], device=dev),
                None if found is None else torch.tensor([found], device=dev),
            )
        )
        out.append(st)
    return out


def _check(got, want, ulps):
    params, _, masters, moments, steps = got
    rparams, _, rmasters, rmoments, rsteps = want
    close(masters, rmasters, 2 * ulps)
    close(moments, rmoments, 2 * ulps)
    # A half param is the rounded fp32 weight: an fp32 ulp apart can round one half ulp apart.
    close(params, rparams, 2 * ulps if params[0].dtype == F32 else 1.0)
    bitwise(steps, rsteps)


ADAM = [(1e-2, 0.1, True, True), (1e-2, 0.1, False, True), (3e-3, 0.0, True, False)]
SGD = [(0.0, False, False), (0.9, False, False), (0.9, True, False), (0.9, False, True)]
LAMB = [  # (global grad norm, max_grad_norm, adam_w_mode, use_nvlamb, weight_decay)
    (torch.tensor([3.0]), 1.0, True, False, 0.01),
    (torch.tensor([3.0]), 0.0, False, False, 0.01),
    (torch.tensor([0.5]), 1.0, True, True, 0.0),
    (torch.tensor([3.0]), 1.0, True, False, 0.0),
]
CASES = (
    [("fused_adam_", o) for o in ADAM]
    + [("fused_sgd_", o) for o in SGD]
    + [("fused_lamb_", o) for o in LAMB]
)


@pytest.mark.parametrize(
    "mix", MIXES, ids=lambda m: f"{m[0]}-{m[1]}-{'master' if m[2] else 'no-master'}"
)
@pytest.mark.parametrize("name,opts", CASES, ids=[f"{n}{i}" for i, (n, _) in enumerate(CASES)])
def test_step_matches_reference(device, ulps, name, opts, mix):
    base = _state(*mix)
    got, want = _run(name, device, base, opts)
    _check(got, want, ulps)


@pytest.mark.parametrize("name,opts", [CASES[0], CASES[4], CASES[7]])
def test_flagged_step_writes_nothing(device, name, opts):
    base = _state(BF16, BF16, True)
    got, _ = _run(name, device, base, opts, found=1.0)
    bitwise(got, base)


@pytest.mark.parametrize("gdt", [F32, F16, BF16])
@pytest.mark.parametrize("name,opts", [CASES[1], CASES[5], CASES[8]])
def test_inf_nan_grads_propagate_as_in_reference(device, ulps, name, opts, gdt):
    base = _state(F32, gdt, False, seed=3)
    poison(base[1], gen(4))
    got, want = _run(name, device, base, opts, inv=None)
    _check(got, want, ulps)


@pytest.mark.parametrize("name,opts", [CASES[0], CASES[5], CASES[7]])
@pytest.mark.parametrize("half", [BF16, F16])
def test_one_pass_equals_unscale_then_fp32_step_then_cast(device, name, opts, half):
    """O2 in one pass (half grads in, fp32 master + state + half param out) is bitwise the
    sequence unscale-into-fp32 -> fp32 step -> cast, all in Triton."""
    base = on(device, _state(half, half, True))
    one = clone(base)
    opts = tuple(o.to(device) if isinstance(o, torch.Tensor) else o for o in opts)
    inv = torch.tensor([1 / 1024], device=device)
    kernel(name)(**_args(name, one, opts, inv, torch.zeros(1, device=device)))
    params, grads, masters, moments, steps = clone(base)
    g32 = [torch.empty_like(g, dtype=F32) for g in grads]
    found = torch.zeros(1, device=device)
    kernel("multi_tensor_scale")(found, grads, g32, 1.0, inv)
    kernel(name)(**_args(name, [masters, g32, [], moments, steps], opts, None, found))
    for p, w in zip(params, masters, strict=True):
        p.copy_(w)
    bitwise([one[0], one[2], one[3], one[4]], on("cpu", [params, masters, moments, steps]))


@pytest.mark.parametrize("name", list(REFERENCES))
def test_refuses_bad_lists(device, name):
    params, grads, masters, moments, steps = on(device, _state(BF16, BF16, True))
    masters[2] = masters[2].half()
    opts = {"fused_adam_": ADAM[0], "fused_sgd_": SGD[1], "fused_lamb_": LAMB[0]}[name]
    opts = tuple(o.to(device) if isinstance(o, torch.Tensor) else o for o in opts)
    with pytest.raises(TypeError, match="tensor 2 of 'masters'"):
        kernel(name)(**_args(name, [params, grads, masters, moments, steps], opts, None, None))
    masters[2] = masters[2].float()
    steps[1] = torch.tensor([1.0, 2.0], device=device)
    if name != "fused_sgd_":
        with pytest.raises(TypeError, match="one-element"):
            kernel(name)(**_args(name, [params, grads, masters, moments, steps], opts, None, None))
