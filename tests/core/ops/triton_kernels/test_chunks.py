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
