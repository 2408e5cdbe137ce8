"""``mpnb doctor``'s report: its sections in order, one line per op with its path on each device,
the hardware facts as measured (here: faked, so nothing is timed), the kernels that fell back
grouped by cause, the threshold line read from the format table, Adam's CPU route and the
output cache's state.

Also tested elsewhere, with a real failed build or real kernels: the fallback line
(tests/behaviour/test_install.py), every op and the hardware in the report
(tests/core/ops/test_build.py), each Triton kernel's decision
(tests/core/ops/triton/test_decision.py).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from mpnb.core import doctor
from mpnb.core.hardware import DtypeSupport
from mpnb.core.ops import all_ops

FACTS = {
    "bfloat16": DtypeSupport("bfloat16", "native", 1.9, "bf16 measured fast"),
    "float16": DtypeSupport("float16", "emulated", 0.06, "fp16 measured slow"),
    "float8_e4m3fn": DtypeSupport("float8_e4m3fn", "unsupported", None, "fp8 cannot run"),
}


@pytest.fixture
def facts(monkeypatch):
    """Doctor's dtype facts without the probe (which times GEMMs for seconds)."""
    monkeypatch.setattr(doctor, "dtype_support", lambda device: FACTS)
    monkeypatch.setattr(doctor, "default_half_dtype", lambda device: "torch.bfloat16")


def test_the_report_without_a_build_compiles_nothing_and_has_its_sections(facts, monkeypatch):
    ext = doctor.cpu_extension()

    def refuse():
        raise AssertionError("report(build=False) built the kernels")

    monkeypatch.setattr(ext, "build", refuse)
    lines = doctor.report(build=False).splitlines()
    assert lines[0] == "mpnb doctor"
    heads = ["hardware", "kernels", "ops (family: op -> path on cpu | on cuda)"]
    assert [line for line in lines if line in heads] == heads
    assert lines.index("hardware") < lines.index("kernels") < lines.index(heads[2])
    assert any(line.startswith("  torch ") and "Python" in line for line in lines[:2])


def test_every_op_has_one_line_with_its_path_on_both_devices(facts):
    lines = doctor.report(build=False).splitlines()
    ops = lines[lines.index("ops (family: op -> path on cpu | on cuda)") + 1 :]
    for info in all_ops():
        mine = [line for line in ops if line.startswith(f"  {info.family}: {info.name} -> ")]
        assert len(mine) == 1, info.name
        cpu, cuda = mine[0].split(" -> ", 1)[1].split(" | ")
        assert cpu == doctor.op_path(info.name, "cpu")
        assert cuda == doctor.op_path(info.name, "cuda")


def test_the_hardware_lines_say_each_dtypes_status_and_evidence(facts):
    report = doctor.report(build=False)
    assert "  bf16 on CPU: native: bf16 measured fast" in report
    assert "  fp16 on CPU: emulated: fp16 measured slow" in report
    assert "  fp8 on CPU: unsupported: fp8 cannot run" in report
    assert "  default half dtype on CPU: bfloat16" in report


def test_the_threshold_names_the_first_formats_and_each_that_differs(monkeypatch):
    rows = [
        SimpleNamespace(name="bf16", native_min_speed=0.25),
        SimpleNamespace(name="fp16", native_min_speed=0.25),
        SimpleNamespace(name="fp8", native_min_speed=1.0),
        SimpleNamespace(name="fp6", native_min_speed=2.5),
    ]
    monkeypatch.setattr(doctor, "probed_formats", lambda: rows)
    assert doctor._thresholds() == "0.25x fp32's speed; fp8 1x; fp6 2.5x"
    monkeypatch.setattr(doctor, "probed_formats", lambda: rows[:2])
    assert doctor._thresholds() == "0.25x fp32's speed"


def _fake_ops(monkeypatch, paths):
    infos = [SimpleNamespace(name=name, family="f", cpu_kernel=kernel) for name, kernel, _ in paths]
    table = {name: path for name, _, path in paths}
    monkeypatch.setattr(doctor, "all_ops", lambda: infos)
    monkeypatch.setattr(doctor, "op_path", lambda name, device="cpu": table.get(name, "C++ kernel"))


def test_fallbacks_are_grouped_by_cause_one_line_each(monkeypatch):
    _fake_ops(
        monkeypatch,
        [
            ("adam", True, "reference (build failed; no compiler)"),
            ("sgd", True, "reference (build failed; no compiler)"),
            ("lamb", True, "reference (MPNB_DISABLE_EXT=1)"),
            ("rope", True, "C++ kernel"),
            ("welford", False, "reference (no C++ kernel for this op)"),  # has none: no fallback
            ("scale", True, "reference (inside use_reference())"),  # asked for: no fallback
        ],
    )
    assert doctor.kernel_fallbacks("cpu") == [
        "2 ops run their pure-PyTorch reference, not their C++ kernel (build failed, no "
        "compiler): adam, sgd",
        "1 op run their pure-PyTorch reference, not their C++ kernel (MPNB_DISABLE_EXT=1): lamb",
    ]
    assert doctor.kernel_fallbacks("cuda") == []


def test_the_fallback_lines_reach_the_report(facts, monkeypatch):
    _fake_ops(monkeypatch, [("adam", True, "reference (build failed)")])
    report = doctor.report(build=False)
    assert "  FELL BACK: 1 op run their pure-PyTorch reference" in report
    assert "  f: adam -> reference (build failed) | reference (build failed)" in report


def test_adams_route_is_shown_only_where_the_cpp_kernel_runs(monkeypatch):
    monkeypatch.setattr(doctor, "op_path", lambda name, device="cpu": "reference (x)")
    assert doctor._adam_route_lines() == []
    monkeypatch.setattr(doctor, "op_path", lambda name, device="cpu": "C++ kernel")
    monkeypatch.setattr(doctor, "cpu_route", lambda n: "torch" if n >= 1000 else "ours")
    monkeypatch.setattr(doctor, "TORCH_ROUTE_ELEMS", 1000)
    monkeypatch.setattr(doctor, "TORCH_ROUTE_MEASURED", {2**10: 0.9, 2**20: 1.25})
    (line,) = doctor._adam_route_lines()
    assert "999 elements -> ours, 1,000 -> torch" in line
    assert line.endswith("2^10: 0.90, 2^20: 1.25")


def test_the_output_cache_line_says_its_limit_or_that_it_is_off(monkeypatch):
    monkeypatch.setattr(doctor, "kernels_loaded", lambda: False)
    assert doctor._output_cache_lines() == []
    monkeypatch.setattr(doctor, "kernels_loaded", lambda: True)
    monkeypatch.setattr(doctor, "env_problem", lambda: "")
    held = {"limit_mib": 1024.0, "min_mib": 1.0, "held_mib": 12.0, "held_blocks": 3}
    monkeypatch.setattr(doctor, "output_cache", lambda: held)
    (line,) = doctor._output_cache_lines()
    assert "holds up to 1024 MiB" in line and "now 12 MiB in 3 block(s)" in line
    assert f"{doctor.ENV}=0 turns it off" in line
    monkeypatch.setattr(doctor, "output_cache", lambda: {**held, "limit_mib": 0.0})
    monkeypatch.setattr(doctor, "env_problem", lambda: "not a whole number")
    off, warning = doctor._output_cache_lines()
    assert f"off ({doctor.ENV}=0)" in off and warning == "    Warning: not a whole number"
