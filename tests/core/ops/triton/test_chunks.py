"""The chunk table is built once per list and kept on the device (keyed by what it holds: the
element counts, the addresses and the per-tensor columns), a cached table is the one a fresh
build gives, and ``counting_launches`` runs a launcher's host work without its kernels."""

from __future__ import annotations

import pytest
import torch

from .triton_cases import bitwise, kernel


@pytest.fixture
def chunks(triton_kernels):
    from mpnb.core.ops.triton import _chunks

    _chunks.clear_cache()
    yield _chunks
    _chunks.clear_cache()


def _lists(sizes=(1, 7, 9000, 20000), k=2):
    return [[torch.randn(n) for n in sizes] for _ in range(k)]


def _builds(chunks, monkeypatch) -> list:
    made = []
    real = chunks.ChunkTable._make.__func__

    def counted(cls, *args):
        made.append(args)
        return real(cls, *args)

    monkeypatch.setattr(chunks.ChunkTable, "_make", classmethod(counted))
    return made


def test_a_list_seen_again_reuses_its_table(chunks, monkeypatch):
    made = _builds(chunks, monkeypatch)
    lists = _lists()
    first = chunks.ChunkTable.build(lists)
    again = chunks.ChunkTable.build([list(lists[0]), list(lists[1])])  # new lists, same tensors
    assert again is first and len(made) == 1


def test_the_cached_table_is_the_one_a_fresh_build_gives(chunks):
    lists = _lists()
    cached = chunks.ChunkTable.build(lists, cols=[[1, 0, 1, 0]])
    cached = chunks.ChunkTable.build(lists, cols=[[1, 0, 1, 0]])
    chunks.clear_cache()
    fresh = chunks.ChunkTable.build(lists, cols=[[1, 0, 1, 0]])
    assert fresh is not cached
    assert torch.equal(fresh.table, cached.table)
    assert (fresh.n_chunks, fresh.row, fresh.n_tensors) == (cached.n_chunks, cached.row, 4)


@pytest.mark.parametrize("change", ["a tensor moved", "a tensor resized", "other columns"])
def test_what_the_table_holds_is_its_key(chunks, monkeypatch, change):
    made = _builds(chunks, monkeypatch)
    lists, cols = _lists(), [[0, 0, 0, 0]]
    chunks.ChunkTable.build(lists, cols=cols)
    if change == "a tensor moved":
        lists[1][2] = lists[1][2].clone()
    elif change == "a tensor resized":
        lists[0][3], lists[1][3] = torch.randn(30000), torch.randn(30000)
    else:
        cols = [[1, 0, 0, 0]]
    tab = chunks.ChunkTable.build(lists, cols=cols)
    assert len(made) == 2
    ptrs = tab.table[: tab.n_tensors * tab.row].reshape(tab.n_tensors, tab.row)
    assert ptrs[:, 0].tolist() == [t.numel() for t in lists[0]]
    assert ptrs[:, 2].tolist() == cols[0]
    assert ptrs[:, 4].tolist() == [t.data_ptr() for t in lists[1]]


def test_the_cache_keeps_the_tables_used_last(chunks):
    alive = [_lists((5,), k=1) for _ in range(chunks.CACHE_SIZE + 3)]  # distinct addresses
    kept = [chunks.ChunkTable.build(lists) for lists in alive]
    assert len(chunks._TABLES) == chunks.CACHE_SIZE
    assert kept[-1] in chunks._TABLES.values() and kept[0] not in chunks._TABLES.values()


def test_a_hit_computes_the_same_step_as_a_miss(chunks, device):
    # The kernel on a cached table: the second call's data is new, its addresses are not.
    from mpnb.core.ops.scale import reference_multi_tensor_scale

    src, dst = _lists(k=2)
    src, dst = [t.to(device) for t in src], [t.to(device) for t in dst]
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    for seed in (0, 1):
        g = torch.Generator().manual_seed(seed)
        for t in src:
            t.copy_(torch.randn(t.shape, generator=g))
        kernel("multi_tensor_scale")(flag, src, dst, 0.25)
        want = [torch.empty_like(t).cpu() for t in src]
        reference_multi_tensor_scale(
            torch.zeros(1, dtype=torch.int32), [t.cpu() for t in src], want, 0.25
        )
        bitwise(dst, want)
    assert len(chunks._TABLES) == 1


def test_counting_launches_runs_the_host_work_and_no_kernel(chunks):
    from mpnb.core.ops.triton._common import counting_launches

    src, dst = _lists()
    before = [t.clone() for t in dst]
    flag = torch.zeros(1, dtype=torch.int32)
    with counting_launches() as names:
        kernel("multi_tensor_scale")(flag, src, dst, 0.5)
    assert names == ["_scale_kernel"]
    bitwise(dst, before)  # nothing ran
    p, g, m, v = _lists(k=4)
    steps = [torch.zeros(()) for _ in p]
    with counting_launches() as names:
        kernel("fused_adam_")(p, g, m, v, [], steps, 1e-3, 0.9, 0.999, 1e-8, 0.0, True, True)
    assert names == ["_adam_kernel", "_advance_kernel"]  # one launch for the list, one for steps
    assert all(float(s) == 0.0 for s in steps)
    with pytest.raises(ValueError, match="elements"):  # the op's checks still run
        with counting_launches():
            kernel("multi_tensor_scale")(flag, src, dst[:-1] + [torch.zeros(3)], 0.5)


def test_nested_counting_blocks_keep_their_own_lists(chunks):
    # blocks nest: the inner one records the launches inside it, and when it ends the outer
    # one records again, even when both lists are equal (left by identity, not by value)
    from mpnb.core.ops.triton._common import counting_launches

    src, dst = _lists()
    flag = torch.zeros(1, dtype=torch.int32)
    with counting_launches() as outer:
        with counting_launches() as inner:
            pass
        kernel("multi_tensor_scale")(flag, src, dst, 0.5)
        with counting_launches() as inner:
            kernel("multi_tensor_scale")(flag, src, dst, 0.5)
        kernel("multi_tensor_scale")(flag, src, dst, 0.5)
    assert outer == ["_scale_kernel"] * 2 and inner == ["_scale_kernel"]
    from mpnb.core.ops.triton import _common

    assert _common._COUNTING == []


@pytest.mark.parametrize("name", ["scale", "check_finite", "adam", "sgd", "sgd momentum", "l2norm"])
def test_a_steady_call_allocates_nothing_but_its_outputs(chunks, name):
    # With its table cached a launch's host work runs no torch op and allocates nothing (the
    # profiler records both without turning the C++ pass off, as a dispatch mode would);
    # l2norm's outputs and the chunks' partials are its only tensors
    from torch.profiler import ProfilerActivity, profile

    from mpnb.core.ops._library import ensure_kernels
    from mpnb.core.ops.triton._common import counting_launches

    ensure_kernels()
    p, g, m, v = _lists((5, 9000, 20000), k=4)
    steps = [torch.zeros(()) for _ in p]
    flag = torch.zeros(1, dtype=torch.int32)
    call = {
        "scale": lambda: kernel("multi_tensor_scale")(flag, p, g, 0.5),
        "check_finite": lambda: kernel("multi_tensor_check_finite")(flag, p),
        "adam": lambda: kernel("fused_adam_")(
            p, g, m, v, [], steps, 1e-3, 0.9, 0.999, 1e-8, 0.0, True, True
        ),
        "sgd": lambda: kernel("fused_sgd_")(p, g, [], [], [], 0.1),
        "sgd momentum": lambda: kernel("fused_sgd_")(p, g, m, [], [False] * 3, 0.1, 0.9),
        "l2norm": lambda: kernel("multi_tensor_l2norm")(flag, p, True),
    }[name]
    with counting_launches():
        call()
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            call()
    seen = [e.name for e in prof.events()]
    assert seen == (["aten::empty"] * 4 + ["[memory]"] * 4 if name == "l2norm" else [])


@pytest.fixture(params=["C++ pass", "Python pass"])
def one_pass(request, monkeypatch):
    """The launchers' per-tensor pass in C++ (``csrc/cpu/list_facts.cpp``), or read in Python
    (as without a compiler)."""
    from mpnb.core.ops._library import ensure_kernels
    from mpnb.core.ops.triton import _checks

    if request.param == "C++ pass":
        if not ensure_kernels() or _checks._native() is None:
            pytest.skip("the C++ library is not built here")
    else:
        monkeypatch.setattr(_checks, "_NATIVE", [False])  # as a library without the pass
    return request.param


def _scaled(src: list, scale: float) -> list:
    from mpnb.core.ops.scale import reference_multi_tensor_scale

    want = [torch.empty_like(t).cpu() for t in src]
    reference_multi_tensor_scale(
        torch.zeros(1, dtype=torch.int32), [t.cpu() for t in src], want, scale
    )
    return want


@pytest.mark.parametrize(
    "change", ["resized in place", "set to other storage", "replaced in the list", "none"]
)
def test_a_changed_tensor_is_never_launched_with_a_stale_table(
    chunks, monkeypatch, one_pass, change
):
    # The launcher's one-pass ids key the table: the same list objects, changed under the
    # cache, must get a new table (and the kernel must write exactly the new tensors).
    made = _builds(chunks, monkeypatch)
    src, dst = _lists((5, 9000, 20000), k=2)
    flag = torch.zeros(1, dtype=torch.int32)
    kernel("multi_tensor_scale")(flag, src, dst, 0.5)
    if change == "resized in place":  # same tensor objects, more elements (a new address)
        src[1].resize_(30000).normal_()
        dst[1].resize_(30000)
    elif change == "set to other storage":  # same objects and sizes, other addresses
        src[2].set_(torch.randn(20000))
        dst[2].set_(torch.empty(20000))
    elif change == "replaced in the list":
        src[0] = torch.randn(5)
    kernel("multi_tensor_scale")(flag, src, dst, 0.5)
    assert len(made) == (1 if change == "none" else 2)
    bitwise(dst, _scaled(src, 0.5))


@pytest.mark.parametrize(
    "change,err",
    [
        ("a transposed view at the same address", "not contiguous"),
        ("another dtype at the same address", "must share a dtype"),
    ],
)
def test_a_tensor_changed_at_its_address_is_checked_again(chunks, one_pass, change, err):
    # Same address and element count: the table would be the same, but the checks are not.
    src = [torch.randn(3), torch.randn(4, 4)]
    dst = [torch.empty(3), torch.empty(16)]
    flag = torch.zeros(1, dtype=torch.int32)
    kernel("multi_tensor_scale")(flag, src, dst, 2.0)
    ptr = src[1].data_ptr()
    if change.startswith("a transposed"):
        src[1] = src[1].t()
    else:
        src[1] = src[1].view(torch.int32)
    assert src[1].data_ptr() == ptr and src[1].numel() == 16
    with pytest.raises((ValueError, TypeError), match=err):
        kernel("multi_tensor_scale")(flag, src, dst, 2.0)


def test_every_single_tensor_a_launcher_reads_lives_on_the_data_device(triton_kernels):
    # The raw-address rule, held by the guard for every list launcher: each flag, scale and
    # learning-rate tensor on another device than the lists is refused, by its name, before
    # anything is read.
    import importlib

    from mpnb.core.ops import _library

    seen = []
    for op in _library.all_ops():
        if not op.triton or op.sample_inputs is None:
            continue
        module = importlib.import_module(f"mpnb.core.ops.triton.{op.triton}")
        if not getattr(getattr(module, op.name), "guards_lists", False):
            continue
        schema = torch._C.parse_schema(op.schema)
        kinds = ("Tensor", "Optional[Tensor]")
        singles = [a.name for a in schema.arguments if str(a.type) in kinds]
        sample = next(iter(op.sample_inputs(op.dtypes[0])))
        for field in singles:
            args = dict(sample.kwargs)
            given = args.get(field)
            dtype = given.dtype if given is not None else torch.float32
            args[field] = torch.zeros(1, dtype=dtype, device="meta")
            with pytest.raises(ValueError, match=f"{field} is on meta"):
                op.triton_kernel()(*op.Args(**args))
            seen.append(f"{op.name}.{field}")
    assert len(seen) == 21, seen  # the nine list launchers' single tensors
