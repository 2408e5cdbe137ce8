"""The ``fp8`` bench suite: a Linear's training step per FP8 recipe vs bf16, shape by shape.

No test asserts a timing: runs are quick, and only what comes out (rows, notes, intervals,
the summary's sentences) is checked; the summary is checked on made-up rows.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from mpnb.core.precision_configs import get_config
from mpnb.lab import bench
from mpnb.lab.bench import Candidate, Case, Options, Row, _harness, fp8, run_case
from mpnb.lab.bench._report import COLUMN_TITLES, format_rows
from mpnb.lab.bench.fp8 import BASELINE, RECIPES, SHAPES, Shape, pays_from, summary

_QUICK = ["fp8", "--quick", "--rounds", "3", "--threads", "1"]


def test_the_suite_is_listed(capsys):
    assert bench.suites()["fp8"].startswith("fp8: one Linear's training step")
    assert bench.main(["--list"]) == 0
    assert "fp8" in capsys.readouterr().out
    assert set(fp8.COLUMNS) <= set(COLUMN_TITLES)


def test_shapes_count_a_training_step_and_scale_to_whole_blocks():
    s = Shape(8192, 4096, 16384)
    assert s.label == "8192x4096->16384" and Shape(64, 64, 64).label == "64^3"
    assert s.flops == 6 * 8192 * 4096 * 16384 == Shape(8192, 8192, 8192).flops
    assert Shape(1024, 1024, 1024).scaled(0.01) == Shape(32, 32, 32)  # MXFP8's 32-blocks
    assert Shape(256, 256, 1024).scaled(0.5) == Shape(128, 128, 512)
    for full, quick in SHAPES.values():
        assert len(quick) < len(full)
        assert all(d % 32 == 0 for sh in full for d in (sh.m, sh.k, sh.n))


def test_quick_on_the_cpu_has_every_recipe_and_shape_with_finite_ratios(tmp_path, capsys):
    path = tmp_path / "fp8.json"
    assert bench.main([*_QUICK, "--json", str(path)]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    data = json.loads(path.read_text())
    rows = data["rows"]
    shapes = [s.label for s in SHAPES["cpu"][1]]
    got = {(r["workload"], r["candidate"]) for r in rows}
    assert got == {(s, c) for s in shapes for c in (BASELINE, *RECIPES)}
    assert len(rows) == len(got)  # no bandwidth rows: the work is GEMMs, rated in TFLOP/s
    for r in rows:
        assert r["median_s"] > 0 and r["tflops"] > 0 and r["flops"] > 0
        if r["candidate"] == BASELINE:
            assert r["role"] == "baseline" and r["note"].startswith("bf16 (")
            continue
        assert math.isfinite(r["ratio"]) and r["ratio"] > 0
        assert r["ratio_lo"] <= r["ratio"] <= r["ratio_hi"]
        assert r["note"] in _notes(r["candidate"])
    assert [line.split()[0] for line in data["summary"]] == list(RECIPES)
    assert all(("pays from" in s) != ("never paid" in s) for s in data["summary"])
    for line in data["summary"]:
        assert f"# {line}" in out
    assert "TFLOP/s" in out and "95% CI" in out and "GB/s" not in out


def _notes(recipe: str) -> set[str]:
    cfg = get_config(recipe)
    (half,) = cfg.halves(())
    return {cfg.precision_text(half, s) for s in ("native", "emulated", "partly emulated")}


def test_every_candidate_starts_from_the_same_weights_and_input():
    case = next(fp8.cases(Options.make(quick=True, scale=0.25)))
    steps = [c.fn for c in case.candidates]
    assert [c.name for c in case.candidates] == [BASELINE, *RECIPES]
    first = steps[0].model
    for step in steps[1:]:
        assert step.x is steps[0].x  # one input tensor
        assert step.model is not first and step.model.weight is not first.weight  # own layer
        assert torch.equal(step.model.weight, first.weight)
        assert torch.equal(step.model.bias, first.bias)
        assert type(step.model) is not torch.nn.Linear  # the recipe swapped the layer
    again = next(fp8.cases(Options.make(quick=True, scale=0.25)))
    assert torch.equal(again.candidates[0].fn.model.weight, first.weight)  # one seed
    steps[0]()
    assert steps[0].x.grad is not None  # the step computes dx, as inside a network


def _row(recipe: str, shape: Shape, ratio: float, lo: float | None, hi: float | None) -> Row:
    row = Row("fp8", "Linear train step", shape.label, recipe, "candidate", 1e-3, 0.0, 5)
    row.ratio, row.ratio_lo, row.ratio_hi, row.flops = ratio, lo, hi, shape.flops
    return row


def test_the_summary_names_the_smallest_shape_that_paid_or_says_none_did():
    s1, s2, s3 = (Shape(n, n, n) for n in (2048, 4096, 8192))
    base = Row("fp8", "Linear train step", s1.label, BASELINE, "baseline", 1e-3, 0.0, 5)
    rows = [
        base,
        _row("fp8-tensorwise", s3, 1.8, 1.7, 1.9),  # out of order: sorted by FLOPs
        _row("fp8-tensorwise", s1, 1.05, 0.98, 1.1),  # faster, but the interval reaches 1
        _row("fp8-tensorwise", s2, 1.4, 1.3, 1.5),
        _row("mxfp8", s1, 0.4, 0.3, 0.5),
        _row("mxfp8", s2, 0.5, 0.45, 0.55),
        _row("mxfp8", s3, 0.95, 0.9, 1.0),
        _row("fp8-rowwise", s1, 1.2, 1.1, 1.3),
        _row("fp8-rowwise", s2, 1.1, 1.05, 1.2),
        _row("fp8-rowwise", s3, 0.9, 0.8, 1.0),
    ]
    assert summary(rows) == [
        "fp8-tensorwise pays from 4096^3 on this device (1.40x, 95% CI 1.30-1.50)",
        "mxfp8 never paid in this sweep (3 shapes, up to 8192^3; best 0.95x at 8192^3)",
        "fp8-rowwise pays from 2048^3 on this device (1.20x, 95% CI 1.10-1.30); "
        "not at the larger 8192^3",
    ]
    few = [_row("fp8-delayed", s1, 1.5, None, None), _row("fp8-delayed", s2, 1.6, None, None)]
    text = pays_from("fp8-delayed", few)
    assert text.startswith("fp8-delayed never paid") and "--rounds 3" in text
    assert summary([base]) == []


def test_rows_carry_flops_notes_and_the_ratio_interval(monkeypatch):
    times = {"base": [2e-3, 2e-3, 2.2e-3, 2e-3], "fast": [1e-3, 1e-3, 1e-3, 1.1e-3]}

    def fake(cands, opts):
        return [times[c.name][: opts.rounds] for c in cands], [1] * len(cands), [0.0] * 2

    monkeypatch.setattr(_harness, "time_rounds", fake)
    case = Case(
        "c",
        "w",
        [
            Candidate("base", lambda: None, flops=4e9, note="bf16 (native)"),
            Candidate("fast", lambda: None, flops=4e9, note="fp8 (native)"),
        ],
    )
    base, fast = run_case(case, Options.make(rounds=4, warmup=1, round_time=0.001))
    assert fast.tflops == pytest.approx(4e9 / 1e-3 / 1e12) and fast.note == "fp8 (native)"
    assert fast.ratio == pytest.approx(2.0) and fast.ratio_lo <= fast.ratio <= fast.ratio_hi
    assert base.ratio_lo is None and base.note == "bf16 (native)"
    table = format_rows([base, fast], columns=fp8.COLUMNS)
    assert table.splitlines()[0].split()[:3] == ["case", "candidate", "note"]
    assert "fp8 (native)" in table and table.splitlines()[3].split()[-2] == "4"  # TFLOP/s
    one = run_case(case, Options.make(rounds=2, warmup=1, round_time=0.001))[1]
    assert one.ratio is not None and one.ratio_lo is None  # two rounds: no interval
    with pytest.raises(ValueError, match="unknown table column") as e:
        format_rows([base], columns=("case", "no such column"))
    assert "'no such column'" in str(e.value) and "GB/s" in str(e.value)  # and the choices


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a CPU-only host")
def test_device_cuda_without_a_gpu_is_refused_with_the_fix(capsys):
    assert bench.main(["fp8", "--device", "cuda", "--quick"]) == 2
    assert "no CUDA GPU is visible" in capsys.readouterr().err


@pytest.mark.gpu
def test_quick_on_cuda_has_every_recipe_and_shape(tmp_path, capsys):
    path = tmp_path / "fp8-cuda.json"
    argv = ["fp8", "--device", "cuda", "--quick", "--rounds", "3", "--json", str(path)]
    assert bench.main(argv) == 0, capsys.readouterr().err
    data = json.loads(path.read_text())
    shapes = [s.label for s in SHAPES["cuda"][1]]
    got = {(r["workload"], r["candidate"]) for r in data["rows"]}
    assert got == {(s, c) for s in shapes for c in (BASELINE, *RECIPES)}
    ours = [r for r in data["rows"] if r["role"] == "candidate"]
    assert all(math.isfinite(r["ratio"]) and r["note"] in _notes(r["candidate"]) for r in ours)
    assert len(data["summary"]) == len(RECIPES) and data["header"]["gpu"]
