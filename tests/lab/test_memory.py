"""The dispatch-mode memory tracker against tensors of known size, and its role breakdown."""

from __future__ import annotations

import contextlib

import pytest
import torch

from mpnb import amp
from mpnb.core.optimizers import FusedAdam
from mpnb.lab.memory import ROLES, MemoryTracker

MIB = 2**20


def _close(a, b, rel=0.01):
    return abs(a - b) <= rel * b


def test_known_allocations_peak_and_dedup():
    with MemoryTracker() as m:
        a = torch.empty(MIB // 4)  # 1 MiB fp32
        v = a.view(512, -1)  # a view: no new bytes
        a.add_(1.0)  # in place: no new bytes
        b = torch.zeros(MIB // 2, dtype=torch.bfloat16)  # 1 MiB bf16
        del b  # freed: the peak stays 2 MiB
        c = torch.ones(MIB // 8)  # 0.5 MiB
    assert _close(m.peak_bytes, 2 * MIB)
    assert m.breakdown()["activations"] == m.peak_bytes
    del a, v, c


def test_peak_is_the_high_water_mark_not_the_end():
    with MemoryTracker() as m:
        for _ in range(3):
            t = torch.empty(MIB // 4)  # 1 MiB, freed when rebound
            del t
    assert _close(m.peak_bytes, MIB)
    assert m.live_bytes == 0


def _step(model, opt, x):
    opt.zero_grad(set_to_none=True)
    loss = model(x).float().pow(2).mean()
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    opt.step()


def _nbytes(ts):
    return sum(t.numel() * t.element_size() for t in ts)


def test_fp32_adam_breakdown_matches_param_sizes():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model, opt = amp.initialize(model, opt, opt_level="O0", verbosity=0)
    x = torch.randn(8, 256)
    _step(model, opt, x)
    with MemoryTracker(model, opt) as m:
        _step(model, opt, x)
    p = _nbytes(model.parameters())
    bd = m.breakdown()
    assert _close(bd["params"], p) and _close(bd["grads"], p)
    assert _close(bd["optimizer_state"], 2 * p)  # exp_avg + exp_avg_sq (+ 8-byte step counts)
    assert bd["master_weights"] == 0
    assert sum(bd.values()) == m.peak_bytes


def test_grads_assigned_after_their_op_count_as_grads():
    # Autograd sets p.grad after the op that computed it returned, with other ops in between
    # and no new storage after the last one: the peak (the last grad, at the end of backward;
    # SGD steps in place) must still count every grad as a grad, not as an activation.
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256)
    )
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(8, 256)
    for tracked in (False, True):
        with MemoryTracker(model, opt) if tracked else contextlib.nullcontext() as m:
            opt.zero_grad(set_to_none=True)
            model(x).pow(2).mean().backward()
            opt.step()
    p = _nbytes(model.parameters())
    bd = m.breakdown()
    assert _close(bd["grads"], p), bd
    assert bd["activations"] < p / 4 and sum(bd.values()) == m.peak_bytes


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
def test_o2_reports_half_params_and_fp32_masters(half):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.Linear(128, 64))
    n = sum(p.numel() for p in model.parameters())
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model, opt = amp.initialize(model, opt, opt_level="O2", half_dtype=half, verbosity=0)
    x = torch.randn(4, 128)
    _step(model, opt, x)
    with MemoryTracker(model, opt) as m:
        _step(model, opt, x)
    bd = m.breakdown()
    assert _close(bd["params"], 2 * n)  # half model params
    assert _close(bd["master_weights"], 4 * n)  # fp32 masters in param_groups
    assert _close(bd["optimizer_state"], 8 * n)


def test_storage_outliving_the_mode_is_not_followed():
    keep = []
    with MemoryTracker() as m:
        keep.append(torch.empty(1024))
    keep.clear()  # freed after exit: the tracker's finalizer is detached, nothing changes
    assert m.peak_bytes == 4096


def test_memory_tracker_counts_fp8_histories_and_kahan_buffers_as_their_roles():
    from mpnb.core.fp8 import convert_to_float8_training

    assert {"fp8_scales", "kahan_buffers"} <= set(ROLES)
    model = convert_to_float8_training(torch.nn.Sequential(torch.nn.Linear(32, 16)), "delayed")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with MemoryTracker(model, opt) as m:
        model(torch.randn(8, 32)).sum().backward()
    hist = model[0].fp8_amax_history.numel() * 4 + model[0].fp8_scale.numel() * 4
    assert m.breakdown()["fp8_scales"] == hist
    assert m.breakdown()["params"] == (32 * 16 + 16) * 4

    w = torch.nn.Parameter(torch.randn(64, 64).bfloat16())
    opt = FusedAdam([w], lr=1e-3, kahan_summation=True)
    w.grad = torch.randn_like(w)
    opt.step()
    with MemoryTracker(None, opt) as m:
        w.grad = torch.randn_like(w)
        opt.step()
    assert m.breakdown()["kahan_buffers"] == 64 * 64 * 2  # one bf16 buffer per param
    assert m.breakdown()["optimizer_state"] >= 2 * 64 * 64 * 4  # fp32 exp_avg, exp_avg_sq
