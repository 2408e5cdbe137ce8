"""Every op's tensors on one device: a meta tensor among real ones is refused, not a no-op.

A call whose tensors include a meta tensor dispatches to the op's fake (the Meta key), which
writes nothing: without the check a CPU list beside one meta tensor came back unchanged and
the step silently did nothing.
"""

from __future__ import annotations

import pytest
import torch

from mpnb.core.ops import _library
from mpnb.core.ops._checks import check_devices
from mpnb.core.ops.axpby import multi_tensor_axpby
from mpnb.core.ops.l2norm import multi_tensor_l2norm
from mpnb.core.ops.scale import multi_tensor_scale


def _meta(n: int = 4) -> torch.Tensor:
    return torch.ones(n, device="meta")


def test_scale_refuses_a_meta_tensor_in_a_cpu_list():
    dst = [torch.zeros(4), torch.zeros(4)]
    with pytest.raises(ValueError, match="'src' is on meta"):
        multi_tensor_scale(torch.zeros(1), [torch.ones(4), _meta()], dst, 2.0)
    assert all((d == 0).all() for d in dst)


def test_scale_refuses_a_meta_list_beside_a_cpu_list():
    with pytest.raises(ValueError, match="on one device"):
        multi_tensor_scale(torch.zeros(1), [_meta(), _meta()], [torch.zeros(4)] * 2, 2.0)


def test_a_meta_flag_beside_cpu_lists_is_refused():
    with pytest.raises(ValueError, match="noop_flag is on meta"):
        multi_tensor_l2norm(torch.zeros(1, device="meta"), [torch.ones(4)])


def test_direct_dispatcher_call_is_refused_too():
    """``torch.ops.mpnb.*`` skips the wrapper; the fake it reaches checks the devices."""
    with pytest.raises(ValueError, match="is on meta"):
        torch.ops.mpnb.multi_tensor_axpby(
            torch.zeros(1), [torch.ones(4)], [_meta()], [torch.zeros(4)], 1.0, 1.0, -1
        )


def test_all_meta_calls_still_run_as_shape_propagation():
    """Every tensor on meta is consistent (as torch's own ops): the fake runs, no error."""
    multi_tensor_scale(torch.zeros(1, device="meta"), [_meta()], [_meta()], 2.0)
    norm, per = multi_tensor_l2norm(torch.zeros(1, device="meta"), [_meta()], True)
    assert norm.device.type == "meta" and per.shape == (1,)


def test_fake_mode_tracing_is_not_refused():
    # the checks take fake tensors (torch.compile traces with them): a refusal would raise
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    with FakeTensorMode():
        src, dst = [torch.ones(4)], [torch.zeros(4)]
        multi_tensor_axpby(torch.zeros(1), src, dst, dst, 1.0, 1.0, -1)
    assert isinstance(dst[0], FakeTensor) and dst[0].shape == (4,)


def test_check_devices_covers_every_op_with_lists():
    """The one check sits in define: every op's fake goes through it."""
    for op in _library.all_ops():
        lists = [n for n, h in op.reference.__annotations__.items() if "Tensors" in str(h)]
        if not lists:
            continue
        with pytest.raises(ValueError, match="meta"):
            check_devices(op.Args(**_meta_args(op, lists[0])))


def _meta_args(op, meta_list: str) -> dict:
    """Arguments of ``op`` whose list ``meta_list`` is on meta and every other tensor on CPU."""
    import inspect

    out = {}
    for p in inspect.signature(op.reference).parameters.values():
        hint = str(op.reference.__annotations__[p.name])
        if "Tensors" in hint:
            out[p.name] = [_meta() if p.name == meta_list else torch.zeros(4)]
        elif hint.startswith("Tensor"):
            out[p.name] = torch.zeros(1) if "None" not in hint else None
        elif p.default is not inspect.Parameter.empty:
            out[p.name] = p.default
        else:
            out[p.name] = {"float": 1.0, "int": 1, "bool": False, "str": ""}.get(hint, 1)
    return out


# ---- the Triton launchers' one pass over their lists (csrc/cpu/list_facts.cpp) ---------------


@pytest.fixture
def facts():
    """:mod:`mpnb.core.ops.triton._checks` with the C++ pass loaded (skipped where it cannot
    be built)."""
    from mpnb.core.ops.triton import _checks

    if not _library.ensure_kernels() or _checks._native() is None:
        pytest.skip("the C++ library is not built here")
    return _checks


def _cases() -> list[list[torch.Tensor]]:
    base = [torch.ones(3), torch.ones(4, 4)]
    return [
        base,
        [torch.ones(3), torch.ones(16)],  # paired with base
        [torch.ones(3), torch.ones(15)],  # a size differs
        [torch.ones(3).half(), torch.ones(16)],  # two dtypes
        [torch.ones(3), torch.ones(4, 4).t()],  # not contiguous
        [torch.zeros(()), torch.zeros(1)],  # single values
        [torch.ones(3), torch.ones(16, device="meta")],  # two devices
        [torch.ones(3)],  # another length
    ]


def test_the_one_pass_reads_what_python_reads(facts):
    lists = _cases()
    flags, ids = facts.list_facts(lists)
    assert sorted(ids) == sorted(map(id, lists))
    assert flags == facts._python_flags(lists)
    want = facts.DATA | facts.ONE_DEVICE | facts.BELOW_2E32
    assert flags[0] & want == want and flags[1] & want == want
    assert not flags[2] & facts.PAIRED and not flags[3] & facts.ONE_DTYPE
    assert not flags[4] & facts.CONTIGUOUS and flags[5] & facts.SINGLES
    assert not flags[6] & facts.ONE_DEVICE and not flags[7] & facts.PAIRED


def test_equal_ids_mean_equal_lists(facts):
    a = [torch.ones(3), torch.ones(5)]

    def ident(lst):
        return facts.list_facts([lst])[1][id(lst)]

    first = ident(a)
    assert ident(list(a)) == first  # another list object, the same tensors
    assert ident(a[:1]) != first  # shorter
    a[1].resize_(6)
    assert ident(a) != first  # resized (same tensor object)
    b = [a[0], torch.ones(6)]
    assert ident(b) not in (first, ident(a))  # another address


def test_the_guard_holds_the_ops_per_tensor_checks(facts, monkeypatch):
    # Native or Python, the guard refuses exactly where the op's check names a tensor.
    op = _library.op_info("multi_tensor_scale")
    flag = torch.zeros(1)
    good = op.Args(flag, [torch.ones(3), torch.ones(2)], [torch.ones(3), torch.ones(2)], 1.0)
    bad = op.Args(flag, [torch.ones(3), torch.ones(2)], [torch.ones(3), torch.ones(5)], 1.0)
    for native in (True, False):
        if not native:
            monkeypatch.setattr(facts, "_NATIVE", [False])  # as a library without the pass
        assert (facts.guard_lists(good, data=("src", "dst")) is not None) == native
        with pytest.raises(RuntimeError, match="refused list 'dst'"):
            facts.guard_lists(bad, data=("src", "dst"))
        with pytest.raises(ValueError, match="'dst' has 5 elements"):
            op.validate(bad)  # what the op's check says instead


def test_what_the_pass_cannot_read_is_read_in_python(facts):
    from torch.testing._internal.two_tensor import TwoTensor

    plain = torch.ones(3)
    sub = TwoTensor(torch.ones(3), torch.ones(3))  # dispatches in Python: no address to read
    assert facts.list_facts([[plain, sub]]) is None  # a subclass behind a plain first tensor
    assert facts.list_facts([[plain, 1.0]]) is None  # not a tensor
    assert facts.list_facts([[plain]] * 9) is None  # more lists than the pass takes
    assert facts.list_facts([(plain,), [plain]])[0] == facts._python_flags([[plain], [plain]])


def test_the_pass_reads_plain_tensors_only_outside_modes(facts):
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    class Sub(torch.Tensor):  # a subclass that does not dispatch in Python: still refused
        pass

    plain, param = torch.ones(3), torch.nn.Parameter(torch.ones(3))
    assert facts.list_facts([[plain, param]]) is not None  # Parameter is a plain tensor
    assert facts.list_facts([[plain, plain.as_subclass(Sub)]]) is None
    for mode in (TorchDispatchMode, TorchFunctionMode):
        with mode():
            assert facts.list_facts([[plain]]) is None  # a tracer may be watching
    assert facts.list_facts([[plain]]) is not None


def test_an_id_is_of_one_device(facts):
    # Empty tensors have no address (0) on every device: the device tells their lists apart,
    # so a table made for one device is never found for another.
    cpu, meta = [torch.empty(0)], [torch.empty(0, device="meta")]
    flags, ids = facts.list_facts([cpu, meta])
    assert ids[id(cpu)] != ids[id(meta)]
    assert facts.list_facts([[torch.empty(0)]])[1].popitem()[1] == ids[id(cpu)]


def test_the_pass_is_no_op_call(facts):
    # The launchers call it from inside their op's kernel: an op here would send every tensor
    # through the dispatcher's argument stack a second time.
    lists = [[torch.ones(3), torch.ones(2)], [torch.ones(3), torch.ones(2)]]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        facts.list_facts(lists)
    assert [e.name for e in prof.events()] == []


def test_a_library_without_the_pass_reads_in_python(facts, monkeypatch):
    class NoPass:
        def __init__(self, path):
            pass

        def __getattr__(self, name):
            raise AttributeError(name)  # a library built without Python's headers

    monkeypatch.setattr(facts, "_NATIVE", [None])
    monkeypatch.setattr(facts.ctypes, "PyDLL", NoPass)
    assert facts._native() is None and facts._NATIVE == [False]  # looked up once
    assert facts.list_facts([[torch.ones(3)]]) is None
    args = _library.op_info("multi_tensor_scale").Args(
        torch.zeros(1), [torch.ones(3)], [torch.ones(3)], 1.0
    )
    assert facts.guard_lists(args, data=("src", "dst")) is None  # the flags, read in Python
