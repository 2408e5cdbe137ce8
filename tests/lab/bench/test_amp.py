"""The ``amp`` bench suite (``mpnb.lab.bench.amp``): its cases, their baselines and targets, and
candidates that run the steps they name.

No test asserts a timing: the candidates are called directly, and what they compute is checked.
"""

from __future__ import annotations

import pytest
import torch

from mpnb.lab.bench import Options, amp


@pytest.fixture(scope="module")
def cases():
    return list(amp.cases(Options.make(quick=True, scale=0.05)))


def test_the_cases_on_a_cpu_and_their_targets(cases):
    assert [(c.name, c.workload) for c in cases] == [
        ("O1 train step", "MLP 3xLinear(64,64) b16 bfloat16"),
        ("O2 optimizer side", "100xLinear(64,64) 200 tensors float16"),
        ("O2 optimizer side", "100xLinear(64,64) 200 tensors bfloat16"),  # the CPU's half too
        ("forward", "5xLinear(256,256) b32 no_grad bfloat16"),  # 100 layers at scale 1
        ("optimizer side", "100xLinear(64,64) 200 params, SGD foreach, fp16 scaling"),
    ]
    targets = {(c.name, k.name): k.target for c in cases for k in c.candidates if k.target}
    assert targets == {
        ("O1 train step", "mpnb.amp O1"): 0.95,
        ("O2 optimizer side", "mpnb.amp O2 + mpnb FusedAdam"): 4.0,
        ("forward", "mpnb.amp O2 (half weights)"): 2.0,
    }
    # the baseline (first, no target): PyTorch's way, a bare step, or O1 for O2's forward
    assert [c.candidates[0].name for c in cases] == [
        "torch.autocast + GradScaler",
        "GradScaler + fp32 masters by hand (Adam)",
        "GradScaler + fp32 masters by hand (Adam)",
        "mpnb.amp O1 (autocast)",
        "step, no loss scaling",
    ]
    assert all(c.candidates[0].target is None for c in cases)


def test_the_optimizer_side_case_compares_what_each_scaler_adds(cases):
    case = cases[-1]
    bare, scaler, ours = case.candidates
    assert bare.name == "step, no loss scaling" and ours.extra_vs == scaler.name
    assert ours.max_extra_ratio == 0.5 and case.min_rounds == 31  # a narrow enough interval


def test_every_candidate_runs_its_step(cases):
    for case in cases:
        for cand in case.candidates:
            for _ in range(2):  # twice: a candidate is called round after round
                cand.fn()


def test_the_forward_candidates_compute_the_same_model_in_their_precision(cases):
    forward = next(c for c in cases if c.name == "forward")
    o1, o2, fp32 = (cand.fn() for cand in forward.candidates)
    assert fp32.dtype == torch.float32
    for half in (o1, o2):  # the same weights (one seed), computed in bf16
        diff = (half.float() - fp32).abs().max().item()
        assert 0 < diff < 0.05 * fp32.abs().max().item()
