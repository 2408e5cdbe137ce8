"""Which Triton kernels are on by default (``mpnb/core/ops/triton/_decision.py``): decided by
the committed table of ratios measured on a GPU (``mpnb/core/ops/triton/measured.json``),
tested here with fake tables."""

from __future__ import annotations

import json

import pytest

from mpnb.core.ops import triton as tk
from mpnb.core.ops.triton import _decision as dec

_H100 = "NVIDIA H100 80GB HBM3"
FAKE = {
    "kernels": {
        "rope": dict(
            speed_vs_torch=1.31, speed_lo=1.25, speed_hi=1.37, card=_H100, date="2026-05-01"
        ),
        "fused_adam_": dict(speed_vs_torch=1.02, speed_lo=1.0, speed_hi=1.04, card=_H100, date="x"),
        "layer_norm_fwd": dict(
            speed_vs_torch=0.8, speed_lo=0.78, speed_hi=0.82, card=_H100, date="x"
        ),
        # faster at the median, but the interval reaches below 1.0: not a default
        "fused_sgd_": dict(speed_vs_torch=1.1, speed_lo=0.97, speed_hi=1.2, card=_H100, date="x"),
        # one --quick measurement, no interval: not a default either
        "multi_tensor_scale": dict(speed_vs_torch=1.2, card=_H100, date="x"),
    }
}


def test_the_lower_end_of_the_interval_decides_and_the_labels_show_ratio_and_interval():
    rope, adam, ln = (dec.decide(n, FAKE) for n in ("rope", "fused_adam_", "layer_norm_fwd"))
    assert rope.default and adam.default and not ln.default  # lower ends 1.25, 1.0 and 0.78
    assert rope.label == (
        "default: 1.31x PyTorch's speed, 95% 1.25-1.37 (NVIDIA H100 80GB HBM3, 2026-05-01)"
    )
    assert ln.label.startswith("opt-in (MPNB_TRITON=1): 0.80x PyTorch's speed, 95% 0.78-0.82 (")
    sgd, quick = dec.decide("fused_sgd_", FAKE), dec.decide("multi_tensor_scale", FAKE)
    assert not sgd.default and (sgd.speed_lo, sgd.speed_hi) == (0.97, 1.2)
    assert not quick.default and quick.speed_lo is None
    assert quick.label.startswith("opt-in (MPNB_TRITON=1): 1.20x PyTorch's speed, no 95% interval")
    unmeasured = dec.decide("rms_norm_fwd", FAKE)
    assert not unmeasured.default and unmeasured.speed_vs_torch is None
    assert unmeasured.label == "opt-in (MPNB_TRITON=1), unmeasured on a GPU"


def test_record_keeps_each_kernels_worst_case_from_the_bench_rows():
    rows = [
        dict(
            case="AdamW O2 bf16",
            workload="(a)",
            candidate="torch _fused_adamw_",
            role="baseline",
            ratio=None,
        ),
        dict(
            case="AdamW O2 bf16",
            workload="(a)",
            candidate="triton fused_adam_",
            role="candidate",
            ratio=1.4,
            ratio_lo=1.35,
            ratio_hi=1.45,
            bw_frac=0.61,
        ),
        dict(
            case="AdamW O2 bf16",
            workload="(c)",
            candidate="triton fused_adam_",
            role="candidate",
            ratio=1.1,
            ratio_lo=0.9,
            ratio_hi=1.2,
        ),
        dict(  # too few rounds for an interval: no measurement
            case="AdamW O2 bf16",
            workload="(d)",
            candidate="triton fused_adam_",
            role="candidate",
            ratio=0.5,
            ratio_lo=None,
            ratio_hi=None,
        ),
        dict(  # a case too large for the card: no measurement
            case="every case",
            workload="(L)",
            candidate="triton fused_adam_",
            role="candidate",
            ratio=None,
            status="SKIPPED",
        ),
        dict(
            case="AdamW O2 bf16",
            workload="(a)",
            candidate="bw: a += s*b (fp32)",
            role="bandwidth",
            ratio=None,
        ),
        *_rows(rope=1.2),
    ]
    table = dec.record(rows, "NVIDIA H200", "2026-05-01", torch="2.13.0")
    assert set(table["kernels"]) == {"fused_adam_", "rope"}
    adam = table["kernels"]["fused_adam_"]
    assert adam["cases"] == {
        "AdamW O2 bf16 [(a)]": dict(ratio=1.4, lo=1.35, hi=1.45, bw_frac=0.61),
        "AdamW O2 bf16 [(c)]": dict(ratio=1.1, lo=0.9, hi=1.2),
    }
    # the worst case is the one with the lowest lower end, whatever its median
    assert (adam["speed_vs_torch"], adam["speed_lo"], adam["speed_hi"]) == (1.1, 0.9, 1.2)
    assert adam["torch"] == "2.13.0"
    assert not dec.decide("fused_adam_", table).default and dec.decide("rope", table).default


def test_the_table_round_trips_and_a_broken_one_names_the_fix(tmp_path):
    path = dec.write_table(FAKE, tmp_path / "measured.json")
    assert dec.load_table(path) == FAKE
    assert dec.load_table(tmp_path / "absent.json") == {"kernels": {}}
    (tmp_path / "bad.json").write_text(json.dumps([1, 2]))
    with pytest.raises(ValueError, match="gpu-check"):
        dec.load_table(tmp_path / "bad.json")


def test_the_committed_table_is_well_formed():
    table = dec.load_table()
    for name, entry in table["kernels"].items():
        assert name in tk.LAUNCHERS and entry["speed_vs_torch"] > 0 and entry["card"], name


def test_probe_uses_the_measured_defaults_and_the_switches():
    nothing = tk.probe_triton({}, lambda: False, table={"kernels": {}})
    assert not nothing.usable and "no kernel has measured" in nothing.reason
    some = tk.probe_triton({}, lambda: False, table=FAKE)  # one to use: then the GPU check
    assert some.mode == "measured" and "no CUDA device" in some.reason
    off = tk.probe_triton({"MPNB_TRITON": "0"}, lambda: True, table=FAKE)
    assert off.mode == "off" and not off.usable and "MPNB_TRITON=0" in off.reason


@pytest.mark.parametrize(
    "mode, expected",
    [("measured", {"rope", "fused_adam_"}), ("all", set(tk.LAUNCHERS)), ("off", set())],
)
def test_enabled_kernels_follow_the_table_and_the_switch(monkeypatch, mode, expected):
    reason = "switched off by MPNB_TRITON=0" if mode == "off" else ""
    monkeypatch.setattr(tk, "triton_status", lambda: tk.TritonStatus(mode, True, "3.x", reason))
    monkeypatch.setattr(tk, "_table", lambda: FAKE)
    assert {n for n in tk.LAUNCHERS if tk.triton_enabled(n)} == expected


def test_doctor_shows_each_kernels_decision_ratio_and_interval(monkeypatch):
    from mpnb.core.doctor import _triton_lines

    monkeypatch.setattr(tk, "_table", lambda: FAKE)
    text = "\n".join(_triton_lines())
    assert (
        "default: 1.31x PyTorch's speed, 95% 1.25-1.37 (NVIDIA H100 80GB HBM3, 2026-05-01): rope"
        in text
    )
    assert "opt-in (MPNB_TRITON=1): 0.80x PyTorch's speed, 95% 0.78-0.82" in text
    assert "opt-in (MPNB_TRITON=1): 1.10x PyTorch's speed, 95% 0.97-1.20" in text
    assert "unmeasured on a GPU: " in text and "rms_norm_fwd" in text


def test_a_quick_era_entry_is_not_pooled_with_a_measured_run():
    old = {"kernels": {"rope": dict(FAKE["kernels"]["multi_tensor_scale"], kernel_source="b")}}
    old["kernels"]["rope"]["cases"] = {"rope bf16 [(a)]": 12.4}  # a ratio, no interval
    new = dec.record(_rows(rope=0.9), _H100, "y", previous=old, sources={"rope": "b"})
    assert new["kernels"]["rope"]["runs"] == 1 and new["kernels"]["rope"]["speed_lo"] == 0.88


def _rows(**ratios: float) -> list[dict]:
    """Bench rows: one candidate row per ``op=ratio`` (one case each), its 95% interval
    ``ratio +- 0.02``."""
    return [
        dict(
            case=f"{op} bf16",
            workload="(a)",
            candidate=f"triton {op}",
            role="candidate",
            ratio=r,
            ratio_lo=r - 0.02,
            ratio_hi=r + 0.02,
        )
        for op, r in ratios.items()
    ]


def test_runs_of_the_same_code_pool_each_cases_worst_ratio():
    src = {"layer_norm_fwd": "aaaa", "rope": "bbbb"}
    first = dec.record(
        _rows(layer_norm_fwd=0.64, rope=12.5), "H100", "2026-11-26", sources=src, torch="2.11"
    )
    second = dec.record(
        _rows(layer_norm_fwd=1.04, rope=13.4),
        "H100",
        "2026-11-27",
        previous=first,
        sources=src,
        torch="2.11",
    )
    ln = second["kernels"]["layer_norm_fwd"]
    assert ln["speed_vs_torch"] == 0.64 and ln["runs"] == 2  # a fast run does not outvote
    assert ln["speed_lo"] == 0.62
    assert ln["first_date"] == "2026-11-26" and ln["date"] == "2026-11-27"
    assert not dec.decide("layer_norm_fwd", second).default
    assert second["kernels"]["rope"]["speed_vs_torch"] == 12.5
    third = dec.record(
        _rows(layer_norm_fwd=0.9), "H100", "2026-11-28", previous=second, sources=src, torch="2.11"
    )
    assert third["kernels"]["layer_norm_fwd"]["runs"] == 3
    assert third["kernels"]["rope"] == second["kernels"]["rope"]  # unmeasured, same code: kept


@pytest.mark.parametrize(
    ("card", "torch_version", "source"),
    [("H200", "2.11", "aaaa"), ("H100", "2.12", "aaaa"), ("H100", "2.11", "cccc")],
    ids=["other card", "other torch", "changed kernel"],
)
def test_a_run_of_other_code_or_hardware_starts_the_record_afresh(card, torch_version, source):
    src = {"layer_norm_fwd": "aaaa", "rope": "bbbb"}
    before = dec.record(
        _rows(layer_norm_fwd=0.64, rope=12.5), "H100", "2026-11-26", sources=src, torch="2.11"
    )
    after = dec.record(
        _rows(layer_norm_fwd=1.04),
        card,
        "2026-11-27",
        previous=before,
        sources={**src, "layer_norm_fwd": source},
        torch=torch_version,
    )
    ln = after["kernels"]["layer_norm_fwd"]
    assert ln["speed_vs_torch"] == 1.04 and ln["runs"] == 1 and "first_date" not in ln
    assert ln["speed_lo"] == 1.02
    assert dec.decide("layer_norm_fwd", after).default
    assert "rope" in after["kernels"]  # its code did not change: its record stays


def test_a_kernel_whose_code_changed_loses_its_unrepeated_record():
    before = dec.record(_rows(rope=12.5), "H100", "2026-11-26", sources={"rope": "bbbb"})
    after = dec.record([], "H100", "2026-11-27", previous=before, sources={"rope": "dddd"})
    assert after == {"kernels": {}}
    assert not dec.decide("rope", after).default


def test_kernel_source_follows_the_module_and_the_shared_helpers(tmp_path, monkeypatch):
    real = {dec.kernel_source(m) for m in ("adam", "sgd", "layer_norm", "softmax")}
    assert len(real) == 4 and all(len(d) == 16 for d in real)
    assert dec.kernel_source("adam") == dec.kernel_source("adam")
    here = tk.__file__.rsplit("/", 1)[0]
    for name in ("adam.py", "sgd.py", "_common.py", "_decision.py"):
        (tmp_path / name).write_text(open(f"{here}/{name}").read())
    monkeypatch.setattr(dec, "__file__", str(tmp_path / "_decision.py"))
    adam, sgd = dec.kernel_source("adam"), dec.kernel_source("sgd")
    (tmp_path / "_decision.py").write_text("# the table's own code is not the kernel's\n")
    assert (dec.kernel_source("adam"), dec.kernel_source("sgd")) == (adam, sgd)
    (tmp_path / "sgd.py").write_text(open(f"{here}/sgd.py").read() + "\n# edited\n")
    assert dec.kernel_source("adam") == adam and dec.kernel_source("sgd") != sgd
    (tmp_path / "_common.py").write_text(open(f"{here}/_common.py").read() + "\n# edited\n")
    assert dec.kernel_source("adam") != adam


def test_a_measurement_of_other_kernel_code_is_shown_but_never_a_default(monkeypatch):
    import mpnb.core.ops  # noqa: F401 - defines the ops, which register their launchers

    module = tk.LAUNCHERS["rope"].split(":")[0]
    today = dec.kernel_source(module)
    entry = dict(speed_vs_torch=1.31, speed_lo=1.25, speed_hi=1.37, card=_H100, date="x")
    same = {"kernels": {"rope": dict(entry, kernel_source=today)}}
    other = {"kernels": {"rope": dict(entry, kernel_source="0" * 16)}}
    assert dec.decide("rope", same, today).default
    old = dec.decide("rope", other, today)
    assert not old.default and old.stale and old.speed_vs_torch == 1.31
    assert old.label.startswith("opt-in (MPNB_TRITON=1): 1.31x") and "other code" in old.label
    assert dec.decide("rope", other).default  # no source given: the table alone decides
    for table, default in ((same, True), (other, False)):
        monkeypatch.setattr(tk, "_table", lambda table=table: table)
        assert tk.decision("rope").default is default  # today's source, from the launcher
        status = tk.probe_triton(environ={}, cuda_available=lambda: False, table=table)
        assert ("no kernel has measured" in status.reason) is not default
