"""The shared statistics, the load record, the verdict, Stop and progress, and `--json`."""

import json
import math
import re
import subprocess
import sys

import pandas as pd
import pytest
import torch

import mpnb.lab
from mpnb.lab import stats, workloads
from mpnb.lab.runner import load_record
from mpnb.lab.verdict import GPU_PEAKS, gpu_estimate, verdict


def test_median_ci_is_deterministic_and_brackets_the_median():
    xs = [1.0, 1.1, 0.9, 1.05, 0.95, 1.2, 0.8]
    lo, hi = stats.median_ci(xs)
    assert (lo, hi) == stats.median_ci(xs) and lo <= stats.median(xs) <= hi
    assert stats.median_ci([2.0] * 10) == (2.0, 2.0)
    assert all(math.isnan(v) for v in stats.median_ci([1.0, 2.0]))


def test_torch_threads_restores_also_on_error():
    before = torch.get_num_threads()
    with pytest.raises(RuntimeError), stats.torch_threads(1):
        assert torch.get_num_threads() == 1
        raise RuntimeError("body failed")
    assert torch.get_num_threads() == before
    with pytest.raises(ValueError, match="positive int"), stats.torch_threads(0):
        pass


def test_bench_uses_the_lab_statistics():
    from mpnb.lab import bench
    from mpnb.lab.bench import _harness, _suite

    assert bench.median is stats.median and _harness.ratio_summary is stats.ratio_summary
    assert _suite.torch_threads is stats.torch_threads


def test_load_record_flags_competition():
    assert not load_record([0.1, 0.1, 0.1], [1.0, 0.5, 0.2], 1, 2)["competed"]
    busy = load_record([2.5, 2.0, 1.0], [3.4, 2.5, 1.2], 1, 2)
    assert busy["competed"] and "other processes competed" in busy["note"]


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


def _tiny():
    x = torch.randn(128, 8, generator=torch.Generator().manual_seed(0))
    return workloads.custom(
        lambda: torch.nn.Linear(8, 2),
        (x, (x[:, 0] > 0).long()),
        metric_fn=workloads.accuracy,
        batch_size=16,
        steps=10,
    )


def test_should_stop_keeps_measured_rows_and_progress_has_an_eta():
    events = []

    def on_progress(p):
        events.append(p)

    df = mpnb.lab.compare(
        _tiny(),
        opt_levels=("O0", "O2"),
        steps=10,
        progress=False,
        threads=1,
        on_progress=on_progress,
        should_stop=lambda: len(events) >= 13,
    )
    assert len(events) == 13 and df.attrs["stopped"]
    assert set(events[-1]) >= {"configuration", "step", "steps", "eta_s", "done", "total"}
    assert events[-1]["total"] == 20 and events[-1]["eta_s"] >= 0
    assert (df.status == "interrupted").all() and df.metric.isna().all()
    assert df.timed_steps.gt(0).all() and df.peak_mem_mib.notna().all()
    assert df.warnings.str.contains("interrupted at step 6 of 10|interrupted at step 7 of 10").all()


def test_cli_json_writes_only_json_to_stdout(tmp_path):
    out = tmp_path / "r.html"
    cmd = [
        sys.executable,
        "-m",
        "mpnb.cli",
        "compare",
        "--workload",
        "mlp",
        "--size",
        "small",
        "--steps",
        "4",
        "--opt-levels",
        "O0,O3",
        "--threads",
        "1",
        "--json",
        "--out",
        str(out),
    ]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)  # nothing but JSON on stdout
    assert [r["configuration"] for r in doc["rows"]] == ["O0 fp32 b64", "O3 bf16 b64"]
    assert doc["verdict"]["text"].startswith("Verdict") and "competed" in doc["load"]
    assert f"report: {out}" in p.stderr and out.exists()


class _Blocks(torch.nn.Module):
    """Three blocks of one linear layer and a head: the CLI's keep-list sweep, fast."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.Sequential(*(torch.nn.Linear(8, 8) for _ in range(3)))
        self.head = torch.nn.Linear(8, 2)

    def forward(self, x):
        return self.head(torch.relu(self.blocks(x)))


def _cli(monkeypatch, capsys, *argv):
    """``mpnb compare ARGV`` in this process, the built-in transformer replaced by a tiny
    model with blocks (the sweep's path is the CLI's own; only the model is smaller)."""
    from mpnb.cli import main

    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
    tiny = workloads.custom(_Blocks, (x, (x[:, 0] > 0).long()), batch_size=16, steps=2)
    monkeypatch.setattr(workloads, "get", lambda *a, **k: tiny)
    argv = ["compare", "--workload", "transformer", "--threads", "1", "--no-progress", *argv]
    code = main([*argv, "--out", ""])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_keep_last_sweeps_the_keep_list(monkeypatch, capsys):
    code, out, err = _cli(monkeypatch, capsys, "--configs", "O0,mxfp8", "--keep-last", "0,1,all")
    assert code == 0, err
    assert "keep-list sweep (3 blocks): the last N blocks' linear layers kept in fp32" in out
    table = out.split("keep-list sweep")[1].splitlines()
    head = "config batch last N fp32 linear kept share kept loss gap vs O0 gap %"
    assert table[1].split() == head.split()
    rows = [line.split() for line in table[3:6]]
    assert [r[:5] for r in rows] == [
        ["mxfp8", "16", "0", "0", "0%"],
        ["mxfp8", "16", "1", "1", "25%"],
        ["mxfp8", "16", "3", "3", "75%"],
    ]
    assert (
        "mxfp8:keep-last=1 b16" in out and "note: mxfp8:keep-last=1: kept in fp32: blocks.2" in out
    )
    code, out, err = _cli(monkeypatch, capsys, "--keep-last", "0,1", "--json")
    doc = json.loads(out)
    assert code == 0 and [r["configuration"] for r in doc["sweep"]] == [
        "nvfp4:keep-none b16",
        "nvfp4:keep-last=1 b16",
    ]  # the default: nvfp4
    assert [r["opt_level"] for r in doc["rows"]][0] == "O0"


@pytest.mark.parametrize(
    "argv, match",
    [
        (("--keep-last", "0,4"), "has 3 blocks .*keep at most 3"),
        (("--configs", "O2", "--keep-last", "0"), "O2 to sweep"),
        (
            ("--configs", "nvfp4:keep-first=1,keep-last=1"),
            "keep options join their configuration with ':'",
        ),
        (("--configs", "O0,O2:keep-last=1"), "O2 takes no keep-list"),
    ],
)
def test_cli_refuses_a_bad_keep_list_before_training(argv, match, monkeypatch, capsys):
    code, _, err = _cli(monkeypatch, capsys, *argv)
    assert code == 2 and re.search(match, err), err


def test_cli_keep_last_parses_counts_and_all(capsys):
    from mpnb.cli import main

    with pytest.raises(SystemExit):
        main(["compare", "--keep-last", "1,x"])
    assert "numbers of blocks or 'all' (e.g. 0,1,2,all), got '1,x'" in capsys.readouterr().err
    assert main(["compare", "--ranks", "2", "--keep-last", "1", "--out", ""]) == 2
    assert "--keep-last apply to the one-process comparison" in capsys.readouterr().err
