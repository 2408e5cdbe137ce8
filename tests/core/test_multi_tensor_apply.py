"""Apex's ``multi_tensor_applier`` (:mod:`mpnb.core.multi_tensor_apply`): it calls an
``amp_C``-style op as ``op(chunk_size, noop_flag, tensor_lists, *args)``, with Apex's default
chunk size, and drives mpnb's ``amp_C`` ops for real."""

from __future__ import annotations

import pytest
import torch

from mpnb import amp_C
from mpnb.core.multi_tensor_apply import MultiTensorApply, multi_tensor_applier


def test_the_op_gets_the_chunk_size_the_flag_the_lists_and_the_extra_args():
    calls = []

    def op(*args):
        calls.append(args)
        return "result"

    flag, lists = torch.zeros(1, dtype=torch.int32), [[torch.ones(2)], [torch.zeros(2)]]
    assert MultiTensorApply(128)(op, flag, lists, 0.5, True) == "result"
    assert calls == [(128, flag, lists, 0.5, True)]


def test_the_shared_applier_has_apexs_chunk_size_and_is_always_available():
    assert multi_tensor_applier.chunk_size == 2048 * 32
    assert MultiTensorApply.available
    multi_tensor_applier.check_avail()  # Apex's check: never raises here


@pytest.mark.parametrize("chunk_size", [0, -1])
def test_a_chunk_size_that_is_not_positive_is_refused(chunk_size):
    with pytest.raises(ValueError, match="chunk_size"):
        MultiTensorApply(chunk_size)


def test_it_runs_amp_cs_scale():
    src = [torch.full((5,), 4.0), torch.full((3,), 2.0)]
    dst = [torch.empty(5), torch.empty(3)]
    flag = torch.zeros(1, dtype=torch.int32)
    multi_tensor_applier(amp_C.multi_tensor_scale, flag, [src, dst], 0.25)
    assert [d.tolist() for d in dst] == [[1.0] * 5, [0.5] * 3] and flag.item() == 0


def test_it_runs_amp_cs_l2norm():
    xs = [torch.tensor([3.0, 0.0]), torch.tensor([4.0])]
    flag = torch.zeros(1, dtype=torch.int32)
    norm, per_tensor = multi_tensor_applier(amp_C.multi_tensor_l2norm, flag, [xs], True)
    torch.testing.assert_close(norm.reshape(()), torch.tensor(5.0))
    torch.testing.assert_close(per_tensor, torch.tensor([3.0, 4.0]))
