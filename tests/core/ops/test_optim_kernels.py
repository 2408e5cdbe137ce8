"""Optimizer kernels: kernel vs reference on every dtype mix, the one-pass O2 step bitwise equal
to its separate-pass sequence, and overflow leaving everything bitwise unchanged."""

from __future__ import annotations

import pytest
import torch

from mpnb.core.ops import multi_tensor_check_finite, multi_tensor_scale
from mpnb.core.ops import optimizers as O
from mpnb.core.ops import optimizers_lamb as L

DT = [torch.float32, torch.float16, torch.bfloat16]
SIZES = [1, 7, 16, 33, 40000, 70001]  # tails, one block, several chunks


def _lists(pdt, gdt, master, nstate=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    ws = [torch.randn(n, generator=g) for n in SIZES]
    params = [w.to(pdt) for w in ws]
    grads = [torch.randn(n, generator=g).to(gdt) for n in SIZES]
    masters = [p.float() for p in params] if master else []
    states = [[torch.rand(n, generator=g) * 0.1 for n in SIZES] for _ in range(nstate)]
    steps = [torch.tensor(3.0) for _ in SIZES]
    return params, grads, masters, states, steps


def _clone(x):
    if isinstance(x, torch.Tensor):
        return x.clone()
    return [_clone(t) for t in x]


def _run(name, args, kw, use_ref):
    fn = {
        "adam": (O.fused_adam_, O.reference_fused_adam_),
        "adagrad": (O.fused_adagrad_, O.reference_fused_adagrad_),
        "sgd": (O.fused_sgd_, O.reference_fused_sgd_),
        "lamb": (L.fused_lamb_, L.reference_fused_lamb_),
        "novograd": (L.fused_novograd_, L.reference_fused_novograd_),
    }[name]
    if use_ref:
        fn[1](*args, **kw)
    else:
        fn[0](*args, **kw)


def _call(name, params, grads, masters, states, steps, **extra):
    if name == "adam":
        return (params, grads, states[0], states[1], masters, steps), dict(
            lr=1e-2,
            beta1=0.9,
            beta2=0.999,
            eps=1e-8,
            weight_decay=0.1,
            adam_w_mode=True,
            bias_correction=True,
            **extra,
        )
    if name == "adagrad":
        return (params, grads, states[0], masters, steps), dict(
            lr=1e-2, eps=1e-10, weight_decay=0.1, lr_decay=0.0, adagrad_w_mode=False, **extra
        )
    if name == "sgd":
        return (params, grads, states[0], masters, [False] * len(params)), dict(
            lr=0.1,
            momentum=0.9,
            dampening=0.1,
            weight_decay=0.01,
            nesterov=False,
            wd_after_momentum=False,
            **extra,
        )
    if name == "lamb":
        return (params, grads, states[0], states[1], masters, steps, torch.tensor([3.0])), dict(
            lr=1e-2,
            beta1=0.9,
            beta2=0.999,
            eps=1e-6,
            weight_decay=0.01,
            adam_w_mode=True,
            bias_correction=True,
            grad_averaging=True,
            max_grad_norm=1.0,
            use_nvlamb=False,
            **extra,
        )
    vs = [torch.tensor(0.5) for _ in params]
    return (
        params,
        grads,
        states[0],
        vs,
        masters,
        steps,
        torch.linspace(0.1, 2.0, len(params)),
    ), dict(
        lr=1e-2,
        beta1=0.95,
        beta2=0.98,
        eps=1e-8,
        weight_decay=0.01,
        bias_correction=True,
        grad_averaging=True,
        reg_inside_moment=False,
        norm_type=2,
        init_zero=False,
        **extra,
    )


OPS = ["adam", "adagrad", "sgd", "lamb", "novograd"]


@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("pdt", DT)
@pytest.mark.parametrize("gdt", DT)
def test_kernel_matches_reference(kernels, name, pdt, gdt):
    master = pdt != torch.float32
    base = _lists(pdt, gdt, master)
    outs = []
    for use_ref in (False, True):
        params, grads, masters, states, steps = _clone(base)
        args, kw = _call(name, params, grads, masters, states, steps, inv_scale=torch.tensor([0.5]))
        _run(name, args, kw, use_ref)
        outs.append((masters or params, states))
    (w_k, s_k), (w_r, s_r) = outs
    for a, b in zip(w_k, w_r, strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-6, atol=2e-7)
    for sa, sb in zip(s_k, s_r, strict=True):
        for a, b in zip(sa, sb, strict=True):
            torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-8)


@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
def test_one_pass_equals_unscale_check_update_cast(kernels, name, half):
    """One pass (half grad in, master + state + half param out) == the four-pass sequence."""
    base = _lists(half, half, True)
    inv = torch.tensor([1.0 / 1024])
    params, grads, masters, states, steps = _clone(base)
    found = torch.zeros(1)
    multi_tensor_check_finite(found, grads)
    args, kw = _call(name, params, grads, masters, states, steps, inv_scale=inv, found_inf=found)
    _run(name, args, kw, False)
    p2, g2, m2, s2, st2 = _clone(base)
    found2 = torch.zeros(1)
    g32 = [torch.empty_like(g, dtype=torch.float32) for g in g2]
    multi_tensor_scale(found2, g2, g32, 1.0, inv)  # unscale + check
    args, kw = _call(name, m2, g32, [], s2, st2, found_inf=found2)  # update the fp32 masters
    _run(name, args, kw, False)
    for p, m in zip(p2, m2, strict=True):  # cast back
        p.copy_(m)
    assert found.item() == 0 and found2.item() == 0
    for a, b in zip(params + masters + sum(states, []), p2 + m2 + sum(s2, []), strict=True):
        assert torch.equal(a, b)
    assert all(torch.equal(a, b) for a, b in zip(steps, st2, strict=True))


@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("use_ref", [False, True])
def test_overflow_writes_nothing(kernels, name, use_ref):
    base = _lists(torch.bfloat16, torch.bfloat16, True)
    params, grads, masters, states, steps = _clone(base)
    grads[-1][-1] = float("inf")
    found = torch.zeros(1)
    multi_tensor_check_finite(found, grads)
    assert found.item() == 1
    args, kw = _call(
        name, params, grads, masters, states, steps, inv_scale=torch.tensor([0.5]), found_inf=found
    )
    _run(name, args, kw, use_ref)
    _, _, m0, s0, st0 = base
    for a, b in zip(
        params + masters + sum(states, []) + steps, base[0] + m0 + sum(s0, []) + st0, strict=True
    ):
        assert torch.equal(a, b)


def test_adam_fp32_bitwise_state_vs_torch_fused(kernels):
    """The moments equal torch's fused CPU AdamW bit for bit; the weights to an ulp or two."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(1000))
    opt = torch.optim.AdamW([p], lr=1e-2, weight_decay=0.1, fused=True)
    w, m, v, st = p.detach().clone(), torch.zeros(1000), torch.zeros(1000), torch.tensor(0.0)
    for _ in range(10):
        g = torch.randn(1000)
        p.grad = g.clone()
        opt.step()
        O.fused_adam_(
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
            adam_w_mode=True,
            bias_correction=True,
        )
    s = opt.state[p]
    assert torch.equal(st, s["step"])
    torch.testing.assert_close(m, s["exp_avg"], rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(w, p.detach(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("use_nvlamb", [False, True])
def test_lamb_bits_independent_of_grouping_and_threads(kernels, use_nvlamb):
    """LAMB's trust ratios are per tensor: one call over a list (tensors grouped for the cache,
    one larger than a group) equals one call per tensor, on 1 and 2 threads, bit for bit."""
    sizes = [3, 1_100_000, 384, 70_001, 600_000, 600_000, 2]  # group limit: 655_360
    g = torch.Generator().manual_seed(5)
    params = [torch.randn(n, generator=g).bfloat16() for n in sizes]
    grads = [(torch.randn(n, generator=g) * 64).bfloat16() for n in sizes]
    base = (
        params,
        grads,
        [p.float() for p in params],
        [
            [torch.randn(n, generator=g) * 0.1 for n in sizes],
            [torch.rand(n, generator=g) for n in sizes],
        ],
        [torch.tensor(3.0) for _ in sizes],
    )
    kw = dict(inv_scale=torch.tensor([1 / 64]))
    if use_nvlamb:
        kw["weight_decay"], kw["use_nvlamb"] = 0.0, True

    def run(per_tensor, threads):
        params, grads, masters, states, steps = _clone(base)
        old = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            parts = [[i] for i in range(len(sizes))] if per_tensor else [list(range(len(sizes)))]
            for idx in parts:

                def pick(xs, idx=idx):
                    return [xs[i] for i in idx]

                args, k = _call(
                    "lamb", pick(params), pick(grads), pick(masters),
                    [pick(s) for s in states], pick(steps),
                )  # fmt: skip
                k.update(kw)
                _run("lamb", args, k, not kernels)
        finally:
            torch.set_num_threads(old)
        return params + masters + states[0] + states[1]

    ref = run(True, 1)
    for per_tensor, threads in ((False, 1), (False, 2), (True, 2)):
        out = run(per_tensor, threads)
        assert all(torch.equal(a, b) for a, b in zip(out, ref, strict=True))


def test_bad_lists_raise_clear_errors(kernels):
    p, g = [torch.randn(4)], [torch.randn(5)]
    with pytest.raises((RuntimeError, ValueError), match="same size"):
        O.fused_adam_(
            p,
            g,
            [torch.zeros(4)],
            [torch.zeros(4)],
            [],
            [torch.tensor(0.0)],
            lr=1e-3,
            beta1=0.9,
            beta2=0.999,
            eps=1e-8,
            weight_decay=0.0,
            adam_w_mode=True,
            bias_correction=True,
        )
    with pytest.raises((RuntimeError, TypeError), match="float32"):
        O.fused_adam_(
            [torch.randn(4)],
            [torch.randn(4)],
            [torch.zeros(4, dtype=torch.half)],
            [torch.zeros(4)],
            [],
            [torch.tensor(0.0)],
            lr=1e-3,
            beta1=0.9,
            beta2=0.999,
            eps=1e-8,
            weight_decay=0.0,
            adam_w_mode=True,
            bias_correction=True,
        )


# ---- opcheck ------------------------------------------------------------------------------


def _opcheck_cases():
    """One call per op: bf16 params with fp32 masters, a scale and a clear overflow flag."""
    sizes = [5, 40000]

    def lists(nstate):
        g = torch.Generator().manual_seed(11)
        params = [torch.randn(n, generator=g).bfloat16() for n in sizes]
        grads = [torch.randn(n, generator=g).bfloat16() for n in sizes]
        states = [[torch.rand(n, generator=g) for n in sizes] for _ in range(nstate)]
        steps = [torch.tensor(2.0) for _ in sizes]
        return params, grads, [p.float() for p in params], states, steps

    scale = dict(inv_scale=torch.tensor([0.5]), found_inf=torch.zeros(1))
    cases = {}
    for name, nstate in (("adam", 2), ("adagrad", 1), ("sgd", 1), ("lamb", 2), ("novograd", 1)):
        params, grads, masters, states, steps = lists(nstate)
        args, kw = _call(name, params, grads, masters, states, steps)
        cases[f"fused_{name}_"] = (*args, *kw.values(), *scale.values())
    return cases


@pytest.mark.parametrize("name", list(_opcheck_cases()))
def test_opcheck(kernels, name):
    if not kernels:
        pytest.skip("opcheck needs the compiled op (MPNB_DISABLE_EXT=1 runs the references)")
    op = getattr(torch.ops.mpnb, name).default
    torch.library.opcheck(op, _opcheck_cases()[name])


def test_every_optimizer_op_has_an_opcheck_case():
    from mpnb.core import ops

    names = {i.name for i in ops.all_ops() if i.family == "optimizer"}
    assert names == set(_opcheck_cases())
