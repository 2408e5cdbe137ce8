"""gpu_estimate / estimate_for_card against step times computed by hand.

The hand figures, an H100 SXM: fp32 67 TFLOP/s, bf16 989 TFLOP/s, 3350 GB/s, used at 40%
(compute) and 80% (memory); 22.5 us of host time and a 3 us GPU floor per op. So 100 ops are
2.25 ms of host and a 0.3 ms floor, 1000 ops 22.5 ms and 3 ms; 2.68e11 fp32 FLOPs take
10 ms, 3.956e11 bf16 FLOPs 1 ms; 2.68e10 bytes (2 x 12779.23583984375 MiB) take 10 ms.
"""

from __future__ import annotations

import math

import pandas as pd
import pytest

from mpnb.lab.gpu_estimate import COLUMNS, card_key, estimate_for_card, gpu_estimate, step_time

H100 = "NVIDIA H100 80GB HBM3"
MIB_10MS = 12779.23583984375  # MiB whose two passes take 10 ms on an H100 at 80%


def _row(config="O0", half="fp32", batch=32, ops=100.0, flops=0.0, mib=0.0, **kw):
    row = dict(
        configuration=f"{config} {half} b{batch}",
        opt_level=config,
        half_dtype=half,
        batch_size=batch,
        status="ok",
        flops_per_step=flops,
        ops_per_step=ops,
        mem_params_mib=mib / 4,  # the roles add: the bytes are their sum
        mem_activations_mib=mib * 3 / 4,
    )
    return {**row, **kw}


def _est(*rows) -> pd.DataFrame:
    return estimate_for_card(pd.DataFrame(rows), H100).set_index("configuration")


def test_step_time_overlaps_without_syncs_and_serialises_around_them():
    assert step_time(10.0, 4.0, 0) == 10.0
    assert step_time(4.0, 10.0, 0) == 10.0
    assert step_time(10.0, 4.0, 1) == 12.0  # one of two segments pays its GPU share 2 again
    assert step_time(10.0, 4.0, 3) == 13.0  # three of four: 10 + 3/4 * 4
    assert step_time(10.0, 4.0, 0.5) == pytest.approx(10.0 + 4.0 / 3)
    assert step_time(10.0, 4.0, 1e9) == pytest.approx(14.0)  # many syncs: host + GPU
    with pytest.raises(ValueError, match="negative"):
        step_time(10.0, 4.0, -1)


def test_compute_bound_row():
    e = _est(_row(flops=2.68e11, host_syncs_per_step=0.0)).loc["O0 fp32 b32"]
    assert e["est_compute_ms"] == pytest.approx(10.0)
    assert e["est_memory_ms"] == 0.0
    assert e["est_host_ms"] == pytest.approx(2.25)
    assert e["est_gpu_ms"] == pytest.approx(10.0)
    assert e["est_step_ms"] == pytest.approx(10.0)
    assert (e["bound"], e["est_sync_ms"], e["syncs_known"]) == ("compute", 0.0, True)


def test_memory_bound_row_sums_the_roles_and_adds_compute():
    e = _est(_row(flops=2.68e10, mib=MIB_10MS, host_syncs_per_step=0.0)).loc["O0 fp32 b32"]
    assert e["est_memory_ms"] == pytest.approx(10.0)
    assert e["est_gpu_ms"] == pytest.approx(11.0)  # + 1 ms of GEMMs: they run in turn
    assert e["est_step_ms"] == pytest.approx(11.0)
    assert e["bound"] == "memory"


def test_host_bound_row_takes_its_gemm_dtype_peak_and_its_o0_ratio():
    o0 = _row(ops=1000.0, flops=3.956e11, host_syncs_per_step=0.0)
    o3 = _row("O3", "bf16", ops=1200.0, flops=3.956e11, host_syncs_per_step=0.0)
    est = _est(o0, o3)
    # O0 computes at fp32's rate: 14.76 ms, below its 22.5 ms of host time
    assert est.loc["O0 fp32 b32", "est_compute_ms"] == pytest.approx(3.956e11 / 26.8e12 * 1e3)
    assert est.loc["O0 fp32 b32", "est_step_ms"] == pytest.approx(22.5)
    e = est.loc["O3 bf16 b32"]
    assert e["est_compute_ms"] == pytest.approx(1.0)  # the bf16 tensor-core peak
    assert e["est_gpu_ms"] == pytest.approx(3.6)  # the floor of 1200 ops
    assert (e["est_step_ms"], e["bound"]) == (pytest.approx(27.0), "host dispatch")
    assert e["est_speedup_vs_O0"] == pytest.approx(22.5 / 27.0)


def test_one_sync_pays_half_the_smaller_side():
    o0 = _row(ops=1000.0, host_syncs_per_step=0.0)
    o3 = _row("O3", "bf16", ops=1000.0, flops=3.956e11, host_syncs_per_step=1.0)
    e = _est(o0, o3).loc["O3 bf16 b32"]
    assert e["est_host_ms"] == pytest.approx(22.5)
    assert e["est_gpu_ms"] == pytest.approx(3.0)
    assert e["est_sync_ms"] == pytest.approx(1.5)  # 1/2 * min(22.5, 3)
    assert e["est_step_ms"] == pytest.approx(24.0)
    assert (e["bound"], e["host_syncs_per_step"]) == ("host dispatch", 1.0)
    assert e["est_speedup_vs_O0"] == pytest.approx(22.5 / 24.0)


def test_several_syncs_on_a_balanced_step_are_the_bound():
    # 22.5 ms of host and 22.5 ms of fp32 compute: overlapped 22.5 ms, serialised 45 ms
    # (O1's 8.901e12 FLOPs at bf16's rate take as long as O0's 6.03e11 at fp32's)
    o0 = _row(ops=1000.0, flops=6.03e11, host_syncs_per_step=0.0)
    o1 = _row("O1", "bf16", ops=1000.0, flops=8.901e12, host_syncs_per_step=3.0)
    est = _est(o0, o1)
    assert est.loc["O0 fp32 b32", "est_step_ms"] == pytest.approx(22.5)
    e = est.loc["O1 bf16 b32"]
    assert e["est_compute_ms"] == pytest.approx(22.5)
    assert e["est_step_ms"] == pytest.approx(22.5 + 0.75 * 22.5)
    assert e["est_sync_ms"] == pytest.approx(16.875)
    assert e["bound"] == "host syncs"
    assert e["est_speedup_vs_O0"] == pytest.approx(22.5 / 39.375)


@pytest.mark.parametrize("syncs", [math.nan, None, "", -1.0, "absent"])
def test_unknown_syncs_are_estimated_as_none_and_said_so(syncs):
    kw = {} if syncs == "absent" else dict(host_syncs_per_step=syncs)
    e = _est(_row(ops=1000.0, flops=6.03e11, **kw)).loc["O0 fp32 b32"]
    assert e["est_step_ms"] == pytest.approx(22.5)  # max(22.5, 22.5): no sync counted
    assert e["est_sync_ms"] == 0.0
    assert math.isnan(e["host_syncs_per_step"])
    assert not e["syncs_known"]


@pytest.mark.parametrize(
    "card, key",
    [
        ("NVIDIA H100 80GB HBM3", "NVIDIA H100 SXM"),
        ("NVIDIA H200", "NVIDIA H200 SXM"),
        ("NVIDIA A100-SXM4-80GB", "NVIDIA A100 SXM 80GB"),
        ("Tesla T4", "NVIDIA T4"),
        ("NVIDIA L4", "NVIDIA L4"),
        ("NVIDIA H100 PCIe", None),  # another card: its peaks are not in the table
        ("NVIDIA GeForce GTX 1080", None),
    ],
)
def test_card_names(card, key):
    assert card_key(card) == key


def test_an_unknown_card_gives_an_empty_frame_with_the_columns():
    est = estimate_for_card(pd.DataFrame([_row()]), "NVIDIA GeForce GTX 1080")
    assert est.empty
    assert list(est.columns) == list(COLUMNS)


def test_each_batch_size_is_compared_with_its_own_o0():
    rows = [
        _row(batch=16, ops=500.0),  # 11.25 ms
        _row("O3", "bf16", batch=16, ops=1000.0),  # 22.5 ms
        _row(batch=32, ops=2000.0),  # 45 ms
        _row("O3", "bf16", batch=32, ops=1000.0),  # 22.5 ms
        _row("O2", "bf16", batch=64, ops=1000.0),  # no O0 at 64: left out
    ]
    est = _est(*rows)
    assert est["est_speedup_vs_O0"].to_dict() == {
        "O0 fp32 b16": 1.0,
        "O3 bf16 b16": pytest.approx(0.5),
        "O0 fp32 b32": 1.0,
        "O3 bf16 b32": pytest.approx(2.0),
    }


def test_failed_rows_and_rows_without_flops_are_left_out():
    rows = [
        _row(ops=1000.0),
        _row("O2", "bf16", ops=10.0, status="error"),
        _row("O3", "bf16", ops=1000.0, flops=math.nan),
        _row("O1", "bf16", ops=2000.0, status="interrupted"),  # it ran: its figures count
    ]
    est = _est(*rows)
    assert list(est.index) == ["O0 fp32 b32", "O1 bf16 b32"]
    assert est.loc["O1 bf16 b32", "est_speedup_vs_O0"] == pytest.approx(0.5)


def test_a_frame_with_nothing_measured_gives_an_empty_frame():
    for df in (pd.DataFrame(), pd.DataFrame([_row(status="error")])):
        assert list(gpu_estimate(df).columns) == list(COLUMNS)
        assert estimate_for_card(df, H100).empty


def test_gpu_estimate_covers_every_card_with_its_peaks():
    df = pd.DataFrame([_row(flops=2.68e11, ops=1.0)])
    est = gpu_estimate(df).set_index("gpu")
    assert list(est.columns) == list(COLUMNS[1:])
    assert len(est) == 7
    assert est.loc["NVIDIA H100 SXM", "est_step_ms"] == pytest.approx(10.0)
    # an A100's fp32 peak is 19.5 TFLOP/s: 2.68e11 / (19.5e12 * 0.4) s
    assert est.loc["NVIDIA A100 SXM 80GB", "est_step_ms"] == pytest.approx(2.68e11 / 7.8e9)
