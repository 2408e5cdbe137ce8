"""GPU busy: the interval arithmetic on hand-made kernels, "not applicable" off CUDA, the
verdict's sentence; on a GPU, a compute-bound and a host-bound step measured for real."""

import math
import time
from types import SimpleNamespace

import pandas as pd
import pytest
import torch

from mpnb.lab import gpu_busy
from mpnb.lab.gpu_busy import BUSY_COLUMN, BusyResult, busy_from_events, busy_note, measure_busy


def test_union_of_overlapping_kernels_with_gaps():
    r = busy_from_events([(8, 9), (0, 4), (2, 6)], 0, 10)  # unsorted, two overlap, one gap
    assert r.busy == pytest.approx(0.7) and r.kernels == 3
    assert r.kernel_ms == pytest.approx(0.007) and r.wall_ms == pytest.approx(0.010)
    assert r.kernel_sum_ms == pytest.approx(0.009)  # the sum counts the overlap twice
    nested = busy_from_events([(0, 10), (2, 3), (4, 5)], 0, 20)
    assert nested.busy == pytest.approx(0.5) and nested.kernel_sum_ms > nested.kernel_ms


def test_kernels_straddling_or_outside_the_window_count_only_inside():
    r = busy_from_events([(-5, 2), (9, 15), (20, 30), (-9, -1)], 0, 10)
    assert r.busy == pytest.approx(0.3) and r.kernels == 2
    assert busy_from_events([(-1, 11)], 0, 10).busy == pytest.approx(1.0)  # never above 1
    many_streams = [(0, 10)] * 4  # four streams busy at once: the sum would say 4
    assert busy_from_events(many_streams, 0, 10).busy == pytest.approx(1.0)


def test_no_kernels_is_an_idle_gpu_and_bad_input_is_refused():
    r = busy_from_events([], 100.0, 200.0)
    assert r.busy == 0.0 and r.kernels == 0 and r.applicable
    with pytest.raises(ValueError, match="window"):
        busy_from_events([(0, 1)], 5, 5)
    with pytest.raises(ValueError, match="ends before it starts"):
        busy_from_events([(3, 1)], 0, 5)


def test_a_cpu_step_is_not_applicable_and_runs_once():
    calls = []
    r = measure_busy(lambda: calls.append(torch.ones(3).sum()), device="cpu")
    assert calls and len(calls) == 1
    assert math.isnan(r.busy) and not r.applicable and "CUDA" in r.reason
    assert math.isnan(r.kernel_ms)


def test_kernel_events_are_told_from_annotations_and_copies():
    cuda = torch.autograd.DeviceType.CUDA

    def ev(kind, name="k", device=cuda, annotation=False):
        return SimpleNamespace(
            activity_type=kind, name=name, device_type=device, is_user_annotation=annotation
        )

    assert gpu_busy._is_kernel(ev("kernel"))
    for kind in ("gpu_user_annotation", "gpu_memcpy", "gpu_memset", "cpu_op"):
        assert not gpu_busy._is_kernel(ev(kind)), kind
    assert gpu_busy._is_kernel(ev(None, "ampere_sgemm"))  # a torch without activity_type
    assert not gpu_busy._is_kernel(ev(None, "Memcpy HtoD (Pageable -> Device)"))
    assert not gpu_busy._is_kernel(ev(None, "mpnb.gpu_busy.step", annotation=True))


def test_measure_busy_reads_the_host_window_and_only_kernels(monkeypatch):
    """The profile's parsing without a GPU: a stand-in profiler hands back events shaped as
    torch.profiler's (the window on the host, its copy on the GPU's timeline, a copy, kernels)."""
    cpu, cuda = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA

    def ev(name, kind, device, start, end):
        return SimpleNamespace(
            name=name,
            activity_type=kind,
            device_type=device,
            time_range=SimpleNamespace(start=start, end=end),
            is_user_annotation=kind.endswith("annotation"),
        )

    events = [
        ev(gpu_busy._WINDOW, "gpu_user_annotation", cuda, 0.0, 2000.0),  # wider than the host's
        ev(gpu_busy._WINDOW, "user_annotation", cpu, 100.0, 1100.0),
        ev("Memcpy HtoD", "gpu_memcpy", cuda, 100.0, 600.0),
        ev("sgemm", "kernel", cuda, 200.0, 500.0),
        ev("add", "kernel", cuda, 400.0, 700.0),
        ev("aten::mm", "cpu_op", cpu, 150.0, 160.0),
    ]

    class FakeProfile:
        def __init__(self, activities):
            assert torch.profiler.ProfilerActivity.CUDA in activities

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def events(self):
            return events

    monkeypatch.setattr(torch.profiler, "profile", FakeProfile)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    calls = []
    r = measure_busy(lambda: calls.append(1), "cuda")
    assert calls == [1] and r.kernels == 2
    assert r.wall_ms == pytest.approx(1.0) and r.kernel_ms == pytest.approx(0.5)
    assert r.busy == pytest.approx(0.5)
    events[3:5] = []  # no kernel at all: not a made-up 0
    assert not measure_busy(lambda: None, "cuda").applicable


def _row(config, busy, device="cuda", batch=4, label="1.50x faster than O0"):
    return dict(
        configuration=config,
        device=device,
        batch_size=batch,
        speed_label=label,
        **{BUSY_COLUMN: busy},
    )


def test_note_is_empty_when_busy_enough_or_not_on_cuda():
    assert busy_note([]) == ""
    assert busy_note([_row("O0 fp32 b4", 0.95, label="baseline"), _row("O1 fp16 b4", 0.81)]) == ""
    assert busy_note([_row("O0 bf16 b4", math.nan, device="cpu", label="baseline")]) == ""
    assert busy_note([_row("O1 bf16 b4", 0.1, device="cpu")]) == ""  # busy is CUDA's only
    assert busy_note([_row("O2 fp16 b4", math.nan)]) == ""  # not measured: nothing claimed
    assert busy_note(pd.DataFrame([_row("O1 fp16 b4", 0.9)])) == ""


def test_note_names_the_low_rows_and_the_fixes():
    rows = [
        _row("O0 fp32 b4", 0.92, label="baseline"),
        _row("O1 fp16 b4", 0.3),
        _row("O2 fp16 b4", 0.45),
    ]
    text = busy_note(pd.DataFrame(rows))
    assert "O1 fp16 b4 30%" in text and "O2 fp16 b4 45%" in text and "O0 fp32" not in text
    assert "below 80%" in text and "launch overhead" in text
    assert "--batch-sizes 16" in text  # 4 * 0.8 / 0.3 = 10.7 -> 16
    for fix in ("--size", "--cuda-graphs", "torch-amp+compile"):
        assert fix in text, fix
    assert "not by their precision" in text
    assert "baseline itself" in busy_note([_row("O0 fp32 b4", 0.4, label="baseline")])
    assert busy_note(rows, threshold=0.25) == ""  # the threshold is the caller's


@pytest.mark.gpu
def test_a_compute_bound_step_is_busy_and_a_host_bound_one_is_not():
    a = torch.randn(4096, 4096, device="cuda")
    a @ a  # cuBLAS's handle is made on first use, on the host: not inside the measured step
    busy = measure_busy(lambda: [a @ a for _ in range(20)])
    assert busy.applicable and busy.kernels >= 20 and busy.busy > 0.8, busy
    assert 0 < busy.kernel_ms <= busy.wall_ms
    x = torch.ones(8, device="cuda")

    def host_bound():
        for _ in range(20):
            x.add_(1)
            time.sleep(0.002)  # the host's time, as Python dispatch is

    idle = measure_busy(host_bound, "cuda")
    assert idle.applicable and idle.kernels >= 20 and idle.busy < 0.2, idle
    assert isinstance(idle, BusyResult)


def test_the_verdict_says_when_cuda_rows_waited_on_the_host():
    import pandas as pd

    from mpnb.lab.verdict import verdict

    rows = [
        dict(configuration="O0 fp32 b4", opt_level="O0", half_dtype="fp32", status="ok",
             error="", device="cuda", gpu_busy=0.35, batch_size=4, speedup_vs_O0=1.0,
             speedup_lo=1.0, speedup_hi=1.0, speed_label="baseline", peak_mem_mib=10.0,
             mem_saving_vs_O0=0.0, metric=0.5, metric_vs_O0=0.0, metric_name="accuracy"),
    ]  # fmt: skip
    df = pd.DataFrame(rows)
    df.attrs["hardware"] = dict(device="cuda", bf16="native", fp16="native")
    text = verdict(df)["text"]
    assert "O0 fp32 b4 35%" in text and "--cuda-graphs" in text
    df.loc[0, "gpu_busy"] = 0.95
    assert "GPU busy" not in verdict(df)["text"]


@pytest.mark.gpu
def test_a_cuda_compare_fills_gpu_busy():
    import mpnb.lab
    from mpnb.lab import workloads

    df = mpnb.lab.compare(
        workloads.get("mlp", "small"), configs=("O0", "O2"), steps=8, device="cuda"
    )
    assert ((df.gpu_busy > 0) & (df.gpu_busy <= 1)).all(), df.gpu_busy.tolist()
