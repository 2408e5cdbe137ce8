"""HostReads: which reads of tensor values it counts, in which threads, and what it leaves."""

import sys
import threading

import pytest
import torch

from mpnb.lab.host_reads import HostReads

ITEM, TOLIST = torch.Tensor.item, torch.Tensor.tolist


@torch.library.custom_op("mpnb_test::reads_inside", mutates_args=())
def _reads_inside(x: torch.Tensor) -> torch.Tensor:
    """An op whose Python kernel reads a value on the host (the dispatch mode cannot see it)."""
    return x * x.sum().item()


def test_item_tolist_and_bool_are_counted_with_their_kind_and_line():
    with HostReads() as r:
        torch.ones(2).sum().item()
        torch.ones(3).tolist()
        bool(torch.ones(1))
        torch.ones(4) * 2  # no read
    assert r.count == 3 and r.kinds == {"item": 2, "tolist": 1}
    assert all(w.startswith(__file__) for w in r.where)


def test_an_item_inside_an_ops_python_kernel_counts_once():
    with HostReads() as r:
        _reads_inside(torch.ones(3))
    assert r.count == 1 and r.kinds == {"item": 1}


def test_nested_counters_each_count_what_ran_inside_them():
    with HostReads() as outer:
        torch.ones(1).item()
        with HostReads() as inner:
            torch.ones(1).tolist()
        torch.ones(1).item()
    assert (outer.count, inner.count) == (3, 1)


def test_reads_of_another_thread_are_not_counted():
    done = threading.Event()

    def other():
        torch.ones(1).item()
        done.set()

    with HostReads() as r:
        t = threading.Thread(target=other)
        t.start()
        assert done.wait(30)
        t.join()
    assert r.count == 0


def test_no_profile_hook_and_the_methods_are_restored_also_after_an_error():
    before = sys.getprofile()
    with pytest.raises(RuntimeError, match="boom"), HostReads():
        assert sys.getprofile() is before  # no per-call hook: a step runs at its own speed
        assert torch.Tensor.item is not ITEM
        raise RuntimeError("boom")
    assert torch.Tensor.item is ITEM and torch.Tensor.tolist is TOLIST
    with HostReads() as r:
        pass
    assert r.count == 0 and torch.Tensor.item is ITEM
