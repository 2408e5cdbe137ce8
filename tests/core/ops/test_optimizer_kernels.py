"""The optimizer ops' semantics beyond the op table (which checks kernel == reference per dtype).

On the kernels and on the references (``op_impl``): the one-pass mixed-precision step equals
its separate-pass sequence bit for bit, a set ``found_inf`` writes nothing (step counts
included), a clear one advances each step count by exactly one, and bad lists raise errors
that name the fix. On the kernels: fp32 Adam/AdamW steps equal ``torch.optim``'s fused CPU
ones bit for bit and SGD steps ``torch.optim.SGD``'s (Adagrad's are within 2 ulp of its fused
op), and LAMB's bits do not depend on how tensors are grouped or on the threads.
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


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_fp32_adagrad_within_two_ulp_of_torch_fused_adagrad(kernels, weight_decay):
    """torch.optim.Adagrad(fused=True) contracts some products into fmas that the kernel keeps
    apart: after ten steps sums and weights agree to 2 ulp, the step counts exactly."""
    n = 1003
    h, st = torch.zeros(n), torch.tensor(0.0)

    def ours(w, g, k):
        ops.fused_adagrad_(
            [w],
            [g],
            [h],
            [],
            [st],
            lr=1e-2,
            eps=1e-10,
            weight_decay=weight_decay,
            lr_decay=0.01,
        )

    def make(p):
        return torch.optim.Adagrad(
            [p], lr=1e-2, weight_decay=weight_decay, lr_decay=0.01, fused=True
        )

    opt, p, w = _torch_run(make, ours, n, steps=10)
    s = opt.state[opt.param_groups[0]["params"][0]]
    assert torch.equal(st, s["step"])
    ulp2 = 2 * torch.finfo(torch.float32).eps
    torch.testing.assert_close(h, s["sum"], rtol=ulp2, atol=0.0)
    torch.testing.assert_close(w, p, rtol=ulp2, atol=1e-8)


def _pick(lists, idx):
    params, grads, masters, states, steps = lists
    pick = lambda xs: [xs[i] for i in idx] if xs else []  # noqa: E731
    return pick(params), pick(grads), pick(masters), [pick(s) for s in states], pick(steps)


@pytest.mark.parametrize("use_nvlamb", [False, True])
def test_lamb_bits_independent_of_grouping_and_threads(kernels, use_nvlamb):
    """LAMB's trust ratios are per tensor: one call over a list (tensors grouped for the cache,
    one larger than a group) equals one call per tensor, on 1 and 2 threads, bit for bit."""
    sizes = (3, 1_100_000, 384, 70_001, 600_000, 600_000, 2)  # group limit: 655_360
    base = lists_for(torch.bfloat16, torch.bfloat16, True, 2, sizes, seed=5, grad_scale=64.0)
    extra = dict(inv_scale=torch.tensor([1 / 64]))
    if use_nvlamb:
        extra |= dict(weight_decay=0.0, use_nvlamb=True)

    def run(per_tensor, threads):
        lists = copy.deepcopy(base)
        old = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            parts = [[i] for i in range(len(sizes))] if per_tensor else [list(range(len(sizes)))]
            for idx in parts:
                fn, args, kw = _call("lamb", _pick(lists, idx), **extra)
                fn(*args, **kw)
        finally:
            torch.set_num_threads(old)
        return _flat(lists)

    ref = run(True, 1)
    for per_tensor, threads in ((False, 1), (False, 2), (True, 2)):
        out = run(per_tensor, threads)
        assert all(torch.equal(a, b) for a, b in zip(out, ref, strict=True))


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
    "first_run count": (
        ValueError,
        "one flag per param",
        lambda: ops.fused_sgd_(
            [torch.randn(4)], [torch.randn(4)], [torch.zeros(4)], [], [], lr=0.1, momentum=0.9
        ),
    ),
    "two-element found_inf": (
        ValueError,
        "one-element tensor",
        lambda: ops.fused_sgd_(
            [torch.randn(4)], [torch.randn(4)], [], [], [True], lr=0.1, found_inf=torch.zeros(2)
        ),
    ),
    "lamb norm": (
        ValueError,
        "multi_tensor_l2norm",
        lambda: ops.fused_lamb_(
            [torch.randn(4)],
            [torch.randn(4)],
            [torch.zeros(4)],
            [torch.zeros(4)],
            [],
            [torch.tensor(0.0)],
            torch.ones(2),
            lr=1e-2,
            beta1=0.9,
            beta2=0.999,
            eps=1e-6,
            weight_decay=0.0,
        ),
    ),
    "novograd norm_type": (
        ValueError,
        "pass 0 or 2",
        lambda: ops.fused_novograd_(
            [torch.randn(4)],
            [torch.randn(4)],
            [torch.zeros(4)],
            [torch.tensor(0.0)],
            [],
            [torch.tensor(0.0)],
            torch.ones(1),
            lr=1e-2,
            beta1=0.9,
            beta2=0.98,
            eps=1e-8,
            weight_decay=0.0,
            norm_type=1,
        ),
    ),
    "novograd grad_norms": (
        ValueError,
        "one norm per param",
        lambda: ops.fused_novograd_(
            [torch.randn(4)],
            [torch.randn(4)],
            [torch.zeros(4)],
            [torch.tensor(0.0)],
            [],
            [torch.tensor(0.0)],
            torch.ones(3),
            lr=1e-2,
            beta1=0.9,
            beta2=0.98,
            eps=1e-8,
            weight_decay=0.0,
        ),
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_arguments_raise_errors_that_name_the_fix(op_impl, case):
    """The kernel and the reference raise the same exception type, naming the fix."""
    exc, fix, call = BAD[case]
    with pytest.raises(exc, match=fix):
        call()
