"""The ``cuda`` bench suite's cases build and every candidate runs, at tiny sizes, on the test
device (the CPU interpreter here): the suite is ready for the first GPU. The large size and the
suite's own sizes never run here (``cuda.cases`` needs a GPU)."""

from __future__ import annotations

import math

import pytest
import torch

from mpnb.lab.bench import _cuda_layers as layers
from mpnb.lab.bench import cuda
from mpnb.lab.bench._cuda_lists import list_cases


def _tiny_cases(device):
    cases = list(list_cases("tiny", [5, 3000], device))
    shape = cuda.shapes(dict(d=32, heads=2, seq=8, batch=1))
    return cases + list(cuda._layers(shape, device))


def test_every_kernel_has_a_case_and_every_candidate_runs(device, triton_kernels):
    cases = _tiny_cases(device)
    names = [c.name for c in cases]
    assert len(names) == len(set(names)) == 21
    kernels = {
        c.candidates[1].name.split()[1] for c in cases if c.candidates[1].name[:7] == "triton "
    }
    assert kernels == set(triton_kernels.LAUNCHERS)  # every Triton kernel, the five new ones too
    for case in cases:
        base, ours = case.candidates
        assert base.bytes == ours.bytes > 0 and case.bandwidth_numel > 0 and case.device == device
        assert case.enough is layers.ENOUGH and case.round_time == layers.ROUND_TIME
        base.fn(), ours.fn()  # each was already run once when the case was built


def test_the_o2_step_case_runs_what_mpnbs_step_runs_and_keeps_both_sides_equal(device):
    (bf16, fp16) = [c for c in list_cases("tiny", [5, 3000], device) if c.name.startswith("O2")]
    assert (bf16.name, fp16.name) == ("O2 step AdamW bf16", "O2 step AdamW fp16")
    for case in (bf16, fp16):
        base, ours = case.candidates
        assert ours.target == 1.5 and base.bytes == 28 * 3005
        assert not ours.name.startswith("triton ")  # not one kernel's decision: the whole step
        for _ in range(3):
            base.fn(), ours.fn()  # repeatable: finite grads, no step skipped


def test_the_large_size_is_256_mib_of_bf16_for_every_layer_case():
    gpt = dict(d=1024, heads=8, seq=1024, batch=4)
    assert cuda.shapes(gpt) == dict(
        norm=(4096, 1024), softmax=(4, 8, 1024, 1024), rope=(1024, 4, 8, 128)
    )
    large = cuda.shapes(gpt, elems=cuda.LARGE_ELEMS)
    for shape in large.values():
        assert 2 * math.prod(shape) >= 256 * 2**20
    assert cuda.LARGE_ELEMS * 2 == 256 * 2**20


def test_a_workload_that_does_not_fit_is_one_skipped_row(monkeypatch):
    from mpnb.lab.bench import Options, run_case

    monkeypatch.setattr(cuda, "memory_skip", lambda need, dev: f"needs {need} bytes")
    built = []
    (case,) = cuda._if_it_fits("(L) big", 123, "cuda", lambda: built.append(1) or iter(()))
    assert built == [] and case.skipped == "needs 123 bytes"  # nothing was allocated
    (row,) = run_case(case, Options.make(quick=True))
    assert row.status == "SKIPPED" and row.error == "needs 123 bytes" and math.isnan(row.median_s)
    assert cuda.summary([row])[-1] == "skipped (L) big: needs 123 bytes"
    monkeypatch.undo()
    assert cuda.memory_skip(1 << 60, "cpu") == ""  # only a GPU's memory is asked


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a GPU's free memory")
def test_memory_skip_names_the_need_and_the_free_memory():
    assert "GiB free of" in cuda.memory_skip(1 << 60, "cuda")
