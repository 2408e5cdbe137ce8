"""Casting control inside O1 regions (:mod:`mpnb.core.amp.casts`): ``half_function``,
``float_function`` and ``promote_function`` cast inside autocast and change nothing outside it;
``disable_casts`` turns the region off; ``register_*_function`` patches a name for O1 forwards
only and restores it, also when the forward raises."""

import warnings

import pytest
import torch

from mpnb import amp
from mpnb.core.amp._initialize import EmulatedHalfWarning

HALVES = [torch.bfloat16, torch.float16]


def _init(m, opt, level, half=torch.bfloat16, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EmulatedHalfWarning)
        return amp.initialize(m, opt, opt_level=level, half_dtype=half, verbosity=0, **kw)


@pytest.mark.parametrize("half", HALVES)
def test_o1_casts_and_disable_casts_and_decorators(half):
    m = torch.nn.Linear(4, 4)
    seen = {}

    @amp.float_function
    def f32(a):
        seen["float"] = (a.dtype, (a @ a.T).dtype)
        return a

    @amp.half_function
    def f16(a):
        seen["half"] = a.dtype
        return a

    @amp.promote_function
    def prom(a, b):
        seen["promote"] = (a.dtype, b.dtype)
        return a

    def fwd_hook(mod, args, out):
        f32(out)
        f16(args[0])
        prom(out, args[0])
        with amp.disable_casts():
            seen["disabled"] = (args[0] @ args[0].T).dtype
        seen["plain"] = (args[0] @ args[0].T).dtype

    m.register_forward_hook(fwd_hook)
    m = _init(m, None, "O1", half, cast_model_outputs=False)
    assert m(torch.randn(2, 4)).dtype == half  # outputs left as autocast made them
    assert seen == {
        "float": (torch.float32, torch.float32),
        "half": half,
        "promote": (torch.float32, torch.float32),
        "disabled": torch.float32,
        "plain": half,
    }
    f16(torch.ones(1))  # outside O1 the wrappers change nothing
    assert seen["half"] == torch.float32


class _Lib:
    @staticmethod
    def mm(a, b):
        return a @ b


class _Net(torch.nn.Module):
    def __init__(self, fail=False):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.fail = fail

    def forward(self, x):
        y = _Lib.mm(self.lin(x), torch.ones(4, 4))
        if self.fail:
            raise RuntimeError("boom")
        return y


def test_register_float_function_only_inside_o1_forward_and_restored_on_error():
    original = _Lib.__dict__["mm"]
    amp.register_float_function(_Lib, "mm")
    try:
        net = _init(_Net(), None, "O1")
        assert net(torch.randn(2, 4)).dtype == torch.float32  # float_function ran mm in fp32
        assert _Lib.__dict__["mm"] is original and isinstance(original, staticmethod)
        bad = _init(_Net(fail=True), None, "O1")
        with pytest.raises(RuntimeError, match="boom"):
            bad(torch.randn(2, 4))
        assert _Lib.__dict__["mm"] is original and not torch.is_autocast_enabled("cpu")
        with pytest.raises(ValueError, match="no attribute"):
            amp.register_half_function(_Lib, "nope")
    finally:
        from mpnb.core.amp.casts import default_registry

        default_registry.entries.clear()


def test_promote_casts_to_the_widest_dtype_and_keeps_containers_and_non_floats():
    from mpnb.core.amp.casts import promote_function

    seen = {}

    @promote_function
    def f(pair, idx, rest=None):
        seen["dtypes"] = (pair[0].dtype, pair[1].dtype, rest["w"].dtype)
        seen["idx"], seen["type"] = idx.dtype, type(pair)
        return pair[0]

    with torch.autocast("cpu", dtype=torch.bfloat16):
        f(
            [torch.ones(1, dtype=torch.bfloat16), torch.ones(1, dtype=torch.float16)],
            torch.arange(2),
            rest={"w": torch.ones(1, dtype=torch.float64)},
        )
        assert torch.is_autocast_enabled("cpu")  # on again after the call
    assert seen == {
        "dtypes": (torch.float64,) * 3,
        "idx": torch.int64,
        "type": list,
    }


def test_without_floating_tensors_promote_calls_the_function_as_it_is():
    from mpnb.core.amp.casts import promote_function

    inside = []

    @promote_function
    def f(n):
        inside.append(torch.is_autocast_enabled("cpu"))
        return n + 1

    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert f(1) == 2
    assert inside == [True]  # nothing to cast: autocast was left on


def test_wrapping_twice_keeps_the_first_policy():
    from mpnb.core.amp.casts import float_function, half_function

    def g(x):
        return x

    once = half_function(g)
    assert float_function(once) is once and once.__wrapped__ is g


def test_a_registry_snapshot_and_installed_restore_on_error():
    from mpnb.core.amp.casts import CastRegistry

    reg = CastRegistry()
    reg.register(_Lib, "mm", "half")
    snap = reg.copy()
    reg.entries.clear()
    original = _Lib.__dict__["mm"]
    a = torch.ones(2, 2)
    with pytest.raises(RuntimeError, match="inside"):
        with snap.installed(), torch.autocast("cpu", dtype=torch.bfloat16):
            assert _Lib.mm(a, a).dtype == torch.bfloat16  # the wrapper runs it in half
            raise RuntimeError("inside")
    assert _Lib.__dict__["mm"] is original  # put back, a staticmethod still
    with pytest.raises(ValueError, match="not callable"):
        reg.register(torch.nn.Linear(2, 2), "weight", "float")
