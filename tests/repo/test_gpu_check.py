"""``scripts/gpu-check.sh``: its dry run on this CPU, its step runner (budgets, failures that do
not stop the check) and its summary (estimate vs measured), on fake runs."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
gc = importlib.util.module_from_spec(_spec)
sys.modules["gpu_check"] = gc  # dataclasses look their module up by name
_spec.loader.exec_module(gc)


def test_every_step_has_a_budget_and_they_fit_in_eight_minutes():
    steps = gc.steps()
    fixed = [s for s in steps if not s.spare]
    assert all(s.budget_s > 0 for s in fixed) and [s.name for s in steps if s.spare] == [
        "notebooks"  # in the time the others leave
    ]
    assert sum(s.budget_s for s in fixed) <= gc.LIMIT_S == 480
    names = " ".join(" ".join(s.argv) for s in steps)
    for needed in (
        "doctor",
        "-m gpu",
        "tests/core/ops/triton",
        "bench --device cuda --json",  # a full run: enough rounds for the intervals
        "-m mpnb.lab.sync_count --device cuda",  # syncs counted by CUDA itself
        "compare --device cuda --workload transformer --size auto",  # the GPU-sized workload
        "torch-amp,tf32,torch-amp+compile,O2+graph",  # the peers and a CUDA-graph row
        "--dtype fp16,bf16",
        "bench fp8 --device cuda",  # where FP8 pays, by Linear size
        "compare --device cpu --workload transformer --size medium",  # the CPU's estimate
        "--nbval-lax",
    ):
        assert needed in names, needed
    assert all((ROOT / "notebooks" / n).is_file() for n in gc.NOTEBOOKS)


@pytest.mark.e2e
@pytest.mark.slow
def test_dry_run_lists_each_step_with_its_budget_and_checks_every_command(tmp_path):
    out = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu-check.sh"), "--dry-run", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    for i, step in enumerate(gc.steps(), 1):
        budget = "left" if step.spare else f"{step.budget_s:>4} s"
        assert f"{i:2}. {step.name:<22} {budget:>6}  ok" in out.stdout, step.name
    total = sum(s.budget_s for s in gc.steps())
    assert f"total budget: {total} s of 480 s; 0 step(s) not ready" in out.stdout


def test_dry_run_reports_a_command_that_does_not_parse(tmp_path):
    bad = gc.Step("x", 1, gc._mpnb("compare", "--opt-levels", "O7"), "bad level")
    assert "O7" in gc.check_step(bad, tmp_path)
    missing = gc.Step("y", 1, (sys.executable, "-m", "pytest", "notebooks/nope.ipynb"), "")
    assert "missing: notebooks/nope.ipynb" in gc.check_step(missing, tmp_path)
    by = {s.name: s for s in gc.steps()}
    assert gc.check_step(by["compare gpu workload"], tmp_path) == ""  # parses here
    assert gc.check_step(by["syncs"], tmp_path) == ""
    bad_syncs = gc.Step("z", 1, (sys.executable, "-m", "mpnb.lab.sync_count", "--nope"), "")
    assert "do not parse" in gc.check_step(bad_syncs, tmp_path)


def test_a_failing_or_overrunning_step_is_recorded_and_the_check_goes_on(tmp_path):
    py = sys.executable
    fail = gc.Step("fails", 30, (py, "-c", "import sys; print('boom'); sys.exit(3)"), "")
    # the child of the step sleeps too: the whole process group must be stopped
    slow_code = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
    slow_code += "'import time; time.sleep(60)']); time.sleep(60)"
    slow = gc.Step("slow", 1, (py, "-c", slow_code), "")
    ok = gc.Step("json", 30, (py, "-c", "print('{\"rows\": []}')"), "", stdout="run.json")
    start = time.monotonic()
    results = [gc.run_step(s, tmp_path) for s in (fail, slow, ok)]
    assert time.monotonic() - start < 25
    assert [r.status for r in results] == ["FAIL (exit 3)", "TIMEOUT", "pass"]
    assert results[0].tail == ["boom"] and json.loads((tmp_path / "run.json").read_text())
    assert results[1].seconds < 15


def _row(config, opt, half, speed, flops=2e12, ops=400.0, mib=20.0, precision="?"):
    return dict(
        configuration=config,
        opt_level=opt,
        half_dtype=half,
        batch_size=32,
        status="ok",
        flops_per_step=flops,
        ops_per_step=ops,
        mem_params_mib=mib,
        speedup_vs_O0=speed,
        precision=precision,
    )


def test_summary_sets_the_estimate_beside_the_measured_speed(tmp_path):
    cpu = [_row("O0 fp32 b32", "O0", "fp32", 1.0), _row("O3 bf16 b32", "O3", "bf16", 0.2)]
    cuda = [
        _row("O0 fp32 b32", "O0", "fp32", 1.0, precision="fp32"),
        _row("O3 bf16 b32", "O3", "bf16", 4.0, precision="bf16 (native)"),
        _row("O3 fp16 b32", "O3", "fp16", 3.0, precision="fp16 (native)"),
        _row("O1 fp16 b32", "O1", "fp16", 1.2, precision="fp16 (native)"),
    ]
    for name, rows in (("compare-medium-cuda.json", cuda), ("compare-cpu-medium.json", cpu)):
        (tmp_path / name).write_text(json.dumps({"rows": rows}))
    table = gc.estimate_vs_measured(cuda, [cpu], "NVIDIA H100 80GB HBM3")
    o3 = next(r for r in table if r["configuration"] == "O3 bf16 b32")
    assert o3["estimated"] > 1 and o3["error"] == pytest.approx(4.0 / o3["estimated"])
    twin = next(r for r in table if r["configuration"] == "O3 fp16 b32")
    assert twin["estimated"] == o3["estimated"]  # the CPU ran bf16; fp16 peaks equal bf16's
    o1 = next(r for r in table if r["configuration"] == "O1 fp16 b32")
    assert math.isnan(o1["estimated"]) and math.isnan(o1["error"])  # not in the CPU run
    step = gc.Step("compare cuda", 60, ("x",), "measured")
    log = tmp_path / "c.log"
    log.write_text("Traceback\nRuntimeError: CUDA out of memory")
    results = [gc.Result(step, "FAIL (exit 1)", 12.0, log, ["RuntimeError: CUDA out of memory"])]
    rope = {"speed_vs_torch": 1.2, "speed_lo": 1.1, "speed_hi": 1.3, "card": "H100", "runs": 3}
    table = {"kernels": {"rope": rope}}
    text = gc.summary(results, tmp_path, "NVIDIA H100 80GB HBM3", "about", table)
    assert "| compare cuda | 60 | 12 | FAIL (exit 1) (`c.log`: RuntimeError: CUDA out" in text
    assert "| rope | 1.20 (1.10-1.30) | 3 | default |" in text and "| rope_" not in text
    assert "| O3 bf16 b32 | bf16 (native) | 4.00 | " in text
    assert ("off by more than 1.5x" in text) == (not 1 / 1.5 <= o3["error"] <= 1.5)


def _gpu_row(config, opt, half, speed, lo, ms, busy, syncs, precision):
    r = _row(config, opt, half, speed, precision=precision)
    return r | dict(
        speedup_lo=lo,
        speedup_hi=speed + 0.1,
        step_time_ms=ms,
        gpu_busy=busy,
        host_syncs_per_step=syncs,
    )


def test_summary_writes_the_gpu_workload_its_targets_the_syncs_and_fp8(tmp_path):
    rows = [
        _gpu_row("O0 fp32 b4", "O0", "fp32", 1.0, 1.0, 160.0, 0.95, 0, "fp32"),
        _gpu_row("O2 bf16 b4", "O2", "bf16", 2.0, 1.8, 80.0, 0.9, 0, "bf16 (native)"),
        _gpu_row("torch-amp bf16 b4", "torch-amp", "bf16", 2.1, 1.9, 76.0, 0.9, 0, "bf16 (n)"),
        dict(configuration="tf32 b4", opt_level="tf32", status="error", error="boom"),
    ]
    doc = dict(rows=rows, workload=dict(description="GPT", size="gpu"), verdict=dict(text="V!"))
    (tmp_path / "compare-gpu.json").write_text(json.dumps(doc))
    syncs = [dict(name="mpnb O2 bf16 + FusedAdam", host_reads=0.0, cuda_syncs=0.0)]
    (tmp_path / "syncs.json").write_text(json.dumps(dict(rows=syncs)))
    fp8 = dict(
        rows=[
            dict(
                case="Linear [4096^3]",
                candidate="fp8-tensorwise",
                median_s=0.003,
                ratio=1.4,
                ratio_lo=1.3,
                ratio_hi=1.5,
                tflops=900.0,
                note="fp8 (native)",
            )
        ],
        summary=["fp8-tensorwise pays from 4096^3 on this device"],
    )
    (tmp_path / "bench-fp8.json").write_text(json.dumps(fp8))
    text = gc.summary([], tmp_path, "NVIDIA H100 80GB HBM3", "about", {"kernels": {}})
    assert "| O2 bf16 b4 | bf16 (native) | 2.00 (1.80-2.10) | 0.95 | 80.0 | 90% | 0 |" in text
    assert "- O2 bf16 >= 1.5x O0: PASS (2.00x, 95% 1.80-2.10)" in text
    assert "- O2 bf16 >= 0.97x torch-amp bf16: MISS (0.95x, medians)" in text
    assert "| tf32 b4 |  | error |" in text and "V!" in text
    assert "| mpnb O2 bf16 + FusedAdam | 0.00 | 0.00 |" in text
    assert "| Linear [4096^3] | fp8-tensorwise | 3.00 | 1.40 (1.30-1.50) | 900.0 |" in text
    assert "- fp8-tensorwise pays from 4096^3 on this device" in text
    empty = gc.summary([], tmp_path / "none", "NVIDIA H100 80GB HBM3", "a", {"kernels": {}})
    assert "(no rows: see the compare step's log)" in empty  # never a made-up number


def test_an_unknown_card_gets_no_estimate():
    cpu = [_row("O0 fp32 b32", "O0", "fp32", 1.0), _row("O3 bf16 b32", "O3", "bf16", 0.2)]
    table = gc.estimate_vs_measured(cpu, [cpu], "NVIDIA B300")
    assert all(math.isnan(r["estimated"]) for r in table)


@pytest.mark.parametrize(
    "name, key",
    [
        ("NVIDIA H100 80GB HBM3", "NVIDIA H100 SXM"),
        ("NVIDIA H200", "NVIDIA H200 SXM"),
        ("NVIDIA H100 PCIe", None),
        ("NVIDIA A100-SXM4-80GB", "NVIDIA A100 SXM 80GB"),
        ("NVIDIA L40S", None),
        ("Tesla T4", "NVIDIA T4"),
    ],
)
def test_cards_are_named_as_torch_reports_them(name, key):
    from mpnb.lab.verdict import estimate_for_card

    cpu = [_row("O0 fp32 b32", "O0", "fp32", 1.0), _row("O3 bf16 b32", "O3", "bf16", 0.2)]
    est = estimate_for_card(pd.DataFrame(cpu), name)
    assert (set(est["gpu"]) if len(est) else None) == ({key} if key else None)


def _bench_row(case, workload, candidate, role, ratio=None, lo=None, hi=None, bw=None, **kw):
    return dict(
        case=case,
        workload=workload,
        candidate=candidate,
        role=role,
        ratio=ratio,
        ratio_lo=lo,
        ratio_hi=hi,
        bw_frac=bw,
        median_s=1e-3,
        rounds=20,
        **kw,
    )


def test_summary_writes_every_bench_case_and_the_kernel_targets(tmp_path):
    rows = [
        _bench_row("l2norm bf16", "(a) GPT 20M/76", "torch _foreach_norm", "baseline"),
        _bench_row(
            "l2norm bf16",
            "(a) GPT 20M/76",
            "triton multi_tensor_l2norm",
            "candidate",
            1.3,
            1.2,
            1.4,
            0.8,
        ),
        _bench_row(
            "unscale",
            "(a) GPT 20M/76",
            "triton multi_tensor_scale",
            "candidate",
            1.05,
            0.98,
            1.1,
            0.7,
        ),
        _bench_row(
            "rms_norm fwd",
            "(L) 131072x1024 bf16",
            "triton rms_norm_fwd",
            "candidate",
            1.1,
            1.05,
            1.15,
            0.81,
        ),
        _bench_row(
            "softmax bwd",
            "(L) [16,8,1024,1024] bf16",
            "triton scaled_softmax_bwd",
            "candidate",
            1.2,
            1.1,
            1.3,
            0.7,
        ),
        _bench_row(
            "O2 step AdamW bf16",
            "(a) GPT 20M/76",
            "mpnb amp O2: check_finite + fused_adam_ (triton)",
            "candidate",
            1.6,
            1.52,
            1.7,
            0.9,
        ),
        _bench_row(
            "every case",
            "(L) 64x2097152",
            "not run",
            "baseline",
            status="SKIPPED",
            error="needs 8.0 GiB of GPU memory, 3.0 GiB free of 16 GiB",
        ),
    ]
    (tmp_path / "bench-cuda.json").write_text(json.dumps(dict(header={}, rows=rows)))
    text = gc.summary([], tmp_path, "NVIDIA H100 80GB HBM3", "about", {"kernels": {}})
    assert (
        "| l2norm bf16 [(a) GPT 20M/76] | torch _foreach_norm | 1.000 | triton multi_tensor_l2norm "
        "| 1.000 | 1.30 (1.20-1.40) | 20 | 80% |" in text
    )
    assert "| every case [(L) 64x2097152] | skipped: needs 8.0 GiB" in text
    assert (
        "- every kernel >= 1.0x PyTorch, lower end included: MISS (below: multi_tensor_scale)"
        in text
    )
    assert (
        "- multi-tensor l2norm and scale >= 1.0x: MISS (multi_tensor_l2norm 1.20, "
        "multi_tensor_scale 0.98" in text
    )
    assert (
        "- norms and softmax >= 75% of copy bandwidth at the large size: MISS (lowest 70% of 2"
        in text
    )
    assert (
        "- O2 step AdamW bf16 [(a) GPT 20M/76] >= 1.5x torch's path: PASS (1.60x, 95% 1.52-1.70)"
        in text
    )
    empty = gc.summary([], tmp_path / "none", "H100", "a", {"kernels": {}})
    assert "(no rows: see the bench cuda step's log)" in empty


def test_a_quick_bench_is_never_recorded(tmp_path, monkeypatch):
    rows = [_bench_row("rope fwd", "w", "triton rope", "candidate", 2.0, 1.9, 2.1, 0.5)]
    written = []
    monkeypatch.setattr(
        "mpnb.core.ops.triton._decision.write_table", lambda t, p=None: written.append(t)
    )
    for quick, recorded in ((True, False), (False, True)):
        written.clear()
        doc = dict(header=dict(quick=quick), rows=rows)
        (tmp_path / "bench-cuda.json").write_text(json.dumps(doc))
        table = gc._record_triton(tmp_path, "NVIDIA H200")
        assert (
            "rope" in table["kernels"] and table["kernels"]["rope"]["card"] == "NVIDIA H200"
        ) == recorded
        assert bool(written) == recorded


def test_the_summary_has_the_host_cost_per_call(tmp_path):
    """Each op and list: torch's call, the cached launcher and the whole op with their ratios
    and verdicts, the dispatcher's floor; a missing file says so."""

    def row(candidate, role, s, ratio=None, status=""):
        return dict(
            case="sgd host cost", workload="GPT 20M/76", candidate=candidate, role=role,
            median_s=s, ratio=ratio, status=status,
        )  # fmt: skip

    rows = [
        row("torch._fused_sgd_ (cuda)", "baseline", 12e-6),
        row("mpnb fused_sgd_ launcher, table cached", "candidate", 10e-6, 1.2, "PASS"),
        row("mpnb fused_sgd_ launcher, table built per call", "candidate", 90e-6, 0.13),
        row("mpnb fused_sgd_ op (wrapper, dispatcher, launcher)", "candidate", 40e-6, 0.3, "MISS"),
        row("dispatcher floor: a no-op Python kernel on the same 152 tensors", "candidate", 2e-5),
    ]
    (tmp_path / "bench-host-cost.json").write_text(json.dumps(dict(header={}, rows=rows)))
    text = gc.summary([], tmp_path, "NVIDIA H100 80GB HBM3", "about", {"kernels": {}})
    assert (
        "| sgd host cost [GPT 20M/76] | 12.0 | 10.0 | 1.20x PASS | 40.0 | 0.30x MISS | 20.0 |"
        in (text)
    )
    empty = gc.summary([], tmp_path / "none", "H100", "a", {"kernels": {}})
    assert "(no rows: see the bench host-cost step's log)" in empty
