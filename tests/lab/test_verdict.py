"""``mpnb.lab.verdict``: the fastest and the smallest configuration within tolerance, what is
emulated, and the GPU estimate it carries."""

import pandas as pd
import pytest

from mpnb.lab.verdict import GPU_PEAKS, gpu_estimate, verdict


def _frame(o2_speed, o2_lo, o2_hi, o2_metric, o2_peak, half="emulated"):
    rows = [
        dict(
            configuration="O0 fp32 b16",
            opt_level="O0",
            half_dtype="fp32",
            status="ok",
            error="",
            speedup_vs_O0=1.0,
            speedup_lo=1.0,
            speedup_hi=1.0,
            speed_label="baseline",
            peak_mem_mib=100.0,
            mem_saving_vs_O0=0.0,
            metric=0.9,
            metric_vs_O0=0.0,
            metric_name="accuracy",
            batch_size=16,
            flops_per_step=2e12,
            ops_per_step=100.0,
            mem_params_mib=50.0,
            mem_activations_mib=50.0,
        ),
        dict(
            configuration="O2 bf16 b16",
            opt_level="O2",
            half_dtype="bf16",
            status="ok",
            error="",
            speedup_vs_O0=o2_speed,
            speedup_lo=o2_lo,
            speedup_hi=o2_hi,
            speed_label=f"{o2_speed:.2f}x",
            peak_mem_mib=o2_peak,
            mem_saving_vs_O0=1 - o2_peak / 100.0,
            metric=o2_metric,
            metric_vs_O0=o2_metric - 0.9,
            metric_name="accuracy",
            batch_size=16,
            flops_per_step=2e12,
            ops_per_step=100.0,
            mem_params_mib=25.0,
            mem_activations_mib=25.0,
        ),
    ]
    df = pd.DataFrame(rows)
    df.attrs["hardware"] = dict(device="cpu", bf16=half, fp16=half)
    return df


def test_verdict_picks_the_fastest_within_tolerance():
    v = verdict(_frame(1.8, 1.6, 2.0, 0.895, 60.0, half="native"))
    assert v["fastest"] == "O2 bf16 b16" and v["recommendation"].startswith("Verdict: use O2")
    assert v["smallest"] == "O2 bf16 b16" and "40% less" in v["text"]
    assert v["emulated"] == []


def test_verdict_on_emulated_half_and_an_accuracy_loss():
    v = verdict(_frame(0.2, 0.18, 0.22, 0.6, 60.0))
    assert v["fastest"] is None and v["smallest"] is None  # it lost 0.3 accuracy
    assert "loses 0.300 accuracy" in v["text"] and "emulated" in v["text"]
    v = verdict(_frame(0.2, 0.18, 0.22, 0.9, 60.0))
    assert "stay with O0" in v["recommendation"] and v["smallest"] == "O2 bf16 b16"
    assert "Estimate, not measured" in v["text"]  # emulated here: what a GPU would show


def test_verdict_names_emulated_fp8_apart_from_half_precision():
    df = _frame(0.2, 0.18, 0.22, 0.9, 60.0)
    df["precision"] = ["fp32", "fp8 (emulated)"]
    v = verdict(df)
    assert v["emulated"] == ["bf16", "fp8"]
    assert "fp8 is emulated on this CPU" in v["text"] and "not FP8's speed" in v["text"]
    assert "bf16 is emulated on this CPU" in v["text"]
    assert "(bf16 and fp8 are emulated here)" in v["recommendation"]
    df.attrs["hardware"] = dict(device="cpu", bf16="native", fp16="native")
    v = verdict(df)
    assert v["emulated"] == ["fp8"] and "half precision saves memory" not in v["text"]
    df["precision"] = ["fp32", "fp8 (native)"]
    assert verdict(df)["emulated"] == []


def test_the_verdict_estimates_through_gpu_estimate():
    """The verdict's estimate is mpnb.lab.gpu_estimate's (its model is tested there, on hand-
    computed rows): 2 TFLOP per step is compute-bound on an A100, and bf16 without tensor
    cores (a T4) gains nothing."""
    df = _frame(0.2, 0.18, 0.22, 0.9, 60.0)
    est = gpu_estimate(df).set_index(["gpu", "configuration"])
    a100 = est.loc[("NVIDIA A100 SXM 80GB", "O2 bf16 b16")]
    p = GPU_PEAKS["NVIDIA A100 SXM 80GB"]
    assert a100.bound == "compute"
    assert a100.est_speedup_vs_O0 == pytest.approx(p["bf16"] / p["fp32"], rel=0.1)
    assert est.loc[("NVIDIA T4", "O2 bf16 b16")].est_speedup_vs_O0 == pytest.approx(1.0, rel=0.05)
    records = pd.DataFrame(verdict(df)["gpu_estimate"])
    pd.testing.assert_frame_equal(records, est.reset_index()[list(records.columns)])
