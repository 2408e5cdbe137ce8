"""The ``cuda`` bench suite's cases build and every candidate runs once, at tiny sizes, on the
test device (the CPU interpreter here): the suite is ready for the first GPU."""

from __future__ import annotations

from mpnb.lab.bench import _cuda_layers as layers
from mpnb.lab.bench import cuda


def test_every_case_builds_and_runs(device):
    cases = list(cuda._list_cases("tiny", [5, 3000], device, False))
    cases += list(layers.norm_cases(4, 32, device, False))
    cases += list(layers.softmax_cases(1, 2, 8, device, False))
    cases.append(layers.rope_case(4, 1, 2, 8, device))
    names = [c.name for c in cases]
    assert len(names) == len(set(names)) == 13
    for case in cases:
        base, ours = case.candidates
        assert ours.name.startswith("triton ") and base.bytes == ours.bytes > 0
        assert case.bandwidth_numel > 0 and case.device == device
        base.fn(), ours.fn()  # each was already run once when the case was built
