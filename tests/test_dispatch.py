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
