"""How calls reach the list kernels (csrc/cpu/dispatch.cpp): the Autograd-key kernels and the
extension's direct Python caller. The direct caller must give the same bits as torch.ops, bump
the version counters autograd relies on, leave every refcount as it found it, be seen by
TorchDispatchModes, and step aside wherever torch.ops would do more than convert."""

from __future__ import annotations

import sys

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from mpnb.core.ops import cpu_extension
from mpnb.core.ops import multi_tensor as mt
from mpnb.core.ops import optimizers as opt
from mpnb.core.ops._registry import op_caller

pytestmark = pytest.mark.usefixtures("kernels")

LIST_OPS = [
    "multi_tensor_scale",
    "multi_tensor_axpby",
    "multi_tensor_l2norm",
    "multi_tensor_check_finite",
    "update_scale_hysteresis",
    "update_loss_scale_",
    "fused_adam_",
    "fused_adagrad_",
    "fused_sgd_",
    "fused_lamb_",
    "fused_novograd_",
]


def _needs_kernels():
    if cpu_extension().disabled:
        pytest.skip("MPNB_DISABLE_EXT=1: no compiled kernels, the references run instead")


def direct(name):
    _needs_kernels()
    fn = cpu_extension().status().module.caller(name)
    assert fn is not None, f"no direct caller for {name}"
    return fn


def grads(n=5, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(7 + 13 * i, generator=g).to(dtype) for i in range(n)]


def adam_args(n=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    sizes = [5 + 11 * i for i in range(n)]
    params = [torch.randn(s, generator=g).bfloat16() for s in sizes]
    return (
        params,
        [torch.randn(s, generator=g).bfloat16() for s in sizes],
        [torch.zeros(s) for s in sizes],
        [torch.zeros(s) for s in sizes],
        [p.float() for p in params],
        [torch.zeros((), dtype=torch.float32) for _ in sizes],
        1e-3,
        0.9,
        0.999,
        1e-8,
        0.01,
        True,
        True,
        torch.tensor([0.5]),
        torch.zeros(1),
    )


def clone_args(args):
    def c(x):
        if isinstance(x, torch.Tensor):
            return x.clone()
        if isinstance(x, list):
            return [c(t) for t in x]
        return x

    return tuple(c(a) for a in args)


def test_every_list_op_has_a_direct_caller_and_the_wrappers_use_it():
    _needs_kernels()
    module = cpu_extension().status().module
    for name in LIST_OPS:
        assert module.caller(name) is not None, name
        assert op_caller(name) is not getattr(torch.ops.mpnb, name).default, name
    assert module.caller("layer_norm_fwd") is None  # few tensors: torch.ops is as fast
    assert op_caller("layer_norm_fwd") is torch.ops.mpnb.layer_norm_fwd.default


def test_scale_direct_equals_torch_ops_bitwise():
    src = grads()
    src[2][3] = float("inf")
    a_flag, b_flag = torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    a = [torch.empty(t.numel()) for t in src]
    b = [torch.empty(t.numel()) for t in src]
    assert direct("multi_tensor_scale")(a_flag, src, a, 0.25, torch.tensor([2.0])) is None
    torch.ops.mpnb.multi_tensor_scale(b_flag, src, b, 0.25, torch.tensor([2.0]))
    assert a_flag.item() == b_flag.item() == 1
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True)


def test_l2norm_direct_returns_the_same_tuple():
    ts = grads(dtype=torch.float32)
    f = torch.zeros(1, dtype=torch.int32)
    got = direct("multi_tensor_l2norm")(f, ts, True, None)
    want = torch.ops.mpnb.multi_tensor_l2norm(f, ts, True, None)
    assert isinstance(got, tuple) and len(got) == 2
    for x, y in zip(got, want, strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


def test_adam_direct_equals_torch_ops_bitwise():
    a, b = adam_args(), adam_args()
    assert direct("fused_adam_")(*a) is None
    torch.ops.mpnb.fused_adam_(*b)
    for la, lb in zip(a[:6], b[:6], strict=True):
        for x, y in zip(la, lb, strict=True):
            torch.testing.assert_close(x, y, rtol=0, atol=0)


def test_sgd_direct_takes_bool_lists():
    g = torch.Generator().manual_seed(1)
    params = [torch.randn(9, generator=g) for _ in range(3)]
    gr = [torch.randn(9, generator=g) for _ in range(3)]
    bufs = [torch.zeros(9) for _ in range(3)]
    args = (params, gr, bufs, [], [True, True, True], 0.1, 0.9, 0.0, 0.0, False, False, None, None)
    ref = clone_args(args)
    assert direct("fused_sgd_")(*args) is None
    torch.ops.mpnb.fused_sgd_(*ref)
    for x, y in zip(args[0] + args[2], ref[0] + ref[2], strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


@pytest.mark.parametrize("path", ["direct", "torch.ops"])
def test_written_tensors_get_new_versions(path):
    _needs_kernels()
    args = adam_args()
    call = direct("fused_adam_") if path == "direct" else torch.ops.mpnb.fused_adam_
    written = [*args[0], *args[2], *args[3], *args[4], *args[5]]
    read_only = args[1]
    before = [t._version for t in written]
    before_ro = [t._version for t in read_only]
    call(*args)
    assert all(t._version > v for t, v in zip(written, before, strict=True))
    assert [t._version for t in read_only] == before_ro


def test_mutation_of_a_saved_tensor_is_caught_by_autograd():
    _needs_kernels()
    w = torch.randn(8, requires_grad=True)
    x = torch.randn(8)
    y = (w * x).sum()  # saves x for backward
    with torch.no_grad():
        op_caller("multi_tensor_scale")(torch.zeros(1, dtype=torch.int32), [x], [x], 2.0, None)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


def test_refcounts_are_untouched_on_success_and_on_error():
    src, dst = grads(), [torch.empty(7 + 13 * i) for i in range(5)]
    f = torch.zeros(1, dtype=torch.int32)
    before = [sys.getrefcount(t) for t in src + dst]
    for _ in range(50):
        direct("multi_tensor_scale")(f, src, dst, 0.5, None)
    with pytest.raises(ValueError, match="pair tensors of the same size"):
        direct("multi_tensor_scale")(f, src, dst[:-1] + [torch.empty(1)], 0.5, None)
    with pytest.raises(ValueError, match="pass lists of equal length"):
        direct("multi_tensor_scale")(f, src, dst[:-1], 0.5, None)
    assert [sys.getrefcount(t) for t in src + dst] == before


def test_errors_name_the_problem_like_torch_ops():
    f = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(TypeError, match="every tensor of one list must share a dtype"):
        direct("multi_tensor_check_finite")(f, [torch.ones(2), torch.ones(2).double()])


def test_a_dispatch_mode_sees_the_op():
    seen = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    f = torch.zeros(1, dtype=torch.int32)
    with Record():
        direct("multi_tensor_check_finite")(f, grads())
    assert "mpnb.multi_tensor_check_finite.default" in seen


class Sub(torch.Tensor):
    pass


def test_steps_aside_for_subclasses_function_modes_and_keywords():
    call = direct("multi_tensor_check_finite")
    f = torch.zeros(1, dtype=torch.int32)
    sub = torch.ones(3).as_subclass(Sub)
    assert call(f, [torch.ones(3), sub]) is NotImplemented
    assert call(f, tensors=[torch.ones(3)]) is NotImplemented
    assert call(f, "not a list") is NotImplemented
    assert direct("multi_tensor_l2norm")(f, [torch.ones(3)]) is NotImplemented  # default omitted

    class PassThrough(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    ones = [torch.ones(3)]
    with PassThrough():
        assert call(f, ones) is NotImplemented
    # The wrapper then takes torch.ops, which gives the same result.
    bad = [torch.ones(3), torch.tensor([1.0, float("nan")]).as_subclass(Sub)]
    mt.multi_tensor_check_finite(f, bad)
    assert f.item() == 1


def test_l2norm_refuses_to_drop_a_gradient():
    _needs_kernels()
    w = torch.randn(5, requires_grad=True)
    f = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="not differentiable.*torch.no_grad"):
        torch.ops.mpnb.multi_tensor_l2norm(f, [w], False, None)
    with torch.no_grad():
        norm, _ = torch.ops.mpnb.multi_tensor_l2norm(f, [w], False, None)
    torch.testing.assert_close(norm, w.detach().norm().reshape(norm.shape))


def test_wrappers_agree_with_the_reference_through_the_direct_path():
    a, b = adam_args(seed=3), adam_args(seed=3)
    names = ("lr", "beta1", "beta2", "eps", "weight_decay", "adam_w_mode", "bias_correction")
    names += ("inv_scale", "found_inf")
    opt.fused_adam_(*a[:6], **dict(zip(names, a[6:], strict=True)))
    opt.reference_fused_adam_(*b)
    for la, lb in zip(a[:5], b[:5], strict=True):
        for x, y in zip(la, lb, strict=True):
            torch.testing.assert_close(x, y, rtol=0, atol=0)


def test_read_grads_matches_python_reads():
    from mpnb.core.ops._registry import read_grads

    ps = [torch.nn.Parameter(torch.zeros(3)) for _ in range(4)] + [torch.zeros(2).as_subclass(Sub)]
    ps[0].grad = torch.ones(3)
    ps[2].grad = torch.full((3,), 2.0)
    ps[4].grad = torch.ones(2)
    got = read_grads(ps)
    assert len(got) == 5 and got[1] is None and got[3] is None
    assert all(g is p.grad for g, p in zip(got, ps, strict=True))
    kept = read_grads(tuple(ps), drop_none=True)
    assert [id(g) for g in kept] == [id(ps[0].grad), id(ps[2].grad), id(ps[4].grad)]
    before = sys.getrefcount(ps[0].grad)
    for _ in range(20):
        read_grads(ps)
    after = sys.getrefcount(ps[0].grad)  # outside the assert: pytest keeps its operands alive
    assert after == before


# ---- amp's grad work in C++: any_grad and unscale_grads -------------------------------------


def _params(n=6, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    ps = [torch.nn.Parameter(torch.zeros(3 + 5 * i, dtype=dtype)) for i in range(n)]
    for i, p in enumerate(ps):
        if i != 2:  # one param unused by the backward
            p.grad = (torch.randn(p.shape, generator=g) * 1024).to(dtype)
    return ps


def _scaler_state(scale=1024.0):
    scale_t = torch.tensor([scale])
    return (
        torch.zeros(1),
        torch.reciprocal(scale_t),
        scale_t,
        torch.zeros(1, dtype=torch.int32),
        torch.ones(1, dtype=torch.int32),
    )


def test_any_grad_matches_python_reads():
    from mpnb.core.ops._registry import any_grad

    ps = [torch.nn.Parameter(torch.zeros(2)) for _ in range(3)]
    assert any_grad(ps) is False and any_grad([]) is False
    ps[2].grad = torch.ones(2)
    assert any_grad(ps) is True and any_grad(tuple(ps)) is True
    sub = [torch.zeros(2).as_subclass(Sub)]
    assert any_grad(sub) is False
    sub[0].grad = torch.ones(2)
    assert any_grad(sub) is True


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_unscale_grads_equals_multi_tensor_scale_and_the_update(dtype):
    from mpnb.core.ops._registry import unscale_grads

    _needs_kernels()
    a, b = _params(dtype=dtype), _params(dtype=dtype)
    b[4].grad[1] = float("inf")
    a[4].grad[1] = float("inf")
    fa, inva, sa, ga, ha = _scaler_state()
    fb, invb, sb, gb, hb = _scaler_state()
    versions = [p.grad._version for p in a if p.grad is not None]
    assert unscale_grads(a, fa, inva, (sa, ga, ha, 2.0, 0.5, 2000, 1, 1.0, 2.0**24)) is True
    assert [p.grad._version for p in a if p.grad is not None] == [v + 1 for v in versions]
    set_b = [p.grad for p in b if p.grad is not None]
    mt.multi_tensor_scale(fb, set_b, set_b, 1.0, scale_tensor=invb)
    mt.update_loss_scale_(sb, invb, gb, hb, fb, 2.0, 0.5, 2000, 1, 1.0, 2.0**24)
    assert a[2].grad is None
    for pa, pb in zip(a, b, strict=True):
        if pa.grad is not None:
            assert torch.equal(pa.grad, pb.grad)
    for x, y in ((fa, fb), (inva, invb), (sa, sb), (ga, gb), (ha, hb)):
        assert torch.equal(x, y)
    assert fa.item() == 1.0 and sa.item() == 512.0 and inva.item() == 1.0 / 512.0


def test_unscale_grads_leaves_the_python_path_everything_it_cannot_do_alike():
    from mpnb.core.ops._registry import unscale_grads

    _needs_kernels()

    def untouched(ps, update=None):
        before = [None if p.grad is None else p.grad.clone() for p in ps]
        f, inv, scale, growth, hyst = _scaler_state()
        args = None if update is None else (scale, growth, hyst, *update)
        assert unscale_grads(ps, f, inv, args) is False
        for p, g in zip(ps, before, strict=True):
            assert (p.grad is None and g is None) or torch.equal(p.grad, g)
        assert f.item() == 0.0 and scale.item() == 1024.0 and inv.item() == 1.0 / 1024.0

    mixed = _params() + _params(n=2, dtype=torch.float32)
    untouched(mixed, (2.0, 0.5, 2000, 1, 0.0, 1e9))  # two dtypes: grouped in Python
    strided = _params()
    strided[1].grad = torch.zeros(2 * strided[1].numel(), dtype=torch.bfloat16)[::2]
    untouched(strided)  # a non-contiguous grad
    sub_param = _params()
    sub_param.append(torch.zeros(3, dtype=torch.bfloat16).as_subclass(Sub))
    untouched(sub_param)
    sub_grad = _params()
    sub_grad[0].grad = sub_grad[0].grad.as_subclass(Sub)
    untouched(sub_grad)
    untouched(_params(), (2.0, 0.5, "2000", 1, 0.0, 1e9))  # an argument of another type

    class PassThrough(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with PassThrough():
        untouched(_params())


def test_unscale_grads_keeps_refcounts_and_is_seen_by_modes():
    from mpnb.core.ops._registry import unscale_grads

    _needs_kernels()
    ps = _params(dtype=torch.float32)
    f, inv, scale, growth, hyst = _scaler_state()
    upd = (scale, growth, hyst, 2.0, 0.5, 2000, 1, 0.0, 2.0**24)
    before = [sys.getrefcount(p.grad) for p in ps if p.grad is not None]
    for _ in range(20):
        unscale_grads(ps, f, inv, upd)
    after = [sys.getrefcount(p.grad) for p in ps if p.grad is not None]
    assert after == before
    seen = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    with Record():
        assert unscale_grads(ps, f, inv, upd) is True
    assert seen == ["mpnb.multi_tensor_scale.default", "mpnb.update_loss_scale_.default"]


def test_env_reader_follows_os_environ(monkeypatch):
    from mpnb.core.ops._build import env_reader

    read = env_reader("MPNB_TEST_ENV_READER")
    monkeypatch.delenv("MPNB_TEST_ENV_READER", raising=False)
    assert read() is None
    monkeypatch.setenv("MPNB_TEST_ENV_READER", "1")
    assert read() == "1" == __import__("os").environ.get("MPNB_TEST_ENV_READER")
    monkeypatch.setenv("MPNB_TEST_ENV_READER", "")
    assert read() == ""
    monkeypatch.delenv("MPNB_TEST_ENV_READER")
    assert read() is None
    monkeypatch.setenv("MPNB_DISABLE_EXT", "1")
    assert cpu_extension().disabled
    monkeypatch.setenv("MPNB_DISABLE_EXT", "0")
    assert not cpu_extension().disabled
