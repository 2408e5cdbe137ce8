"""``torch.compile`` candidates in ``mpnb bench``: compile time kept apart from the rounds,
left out by ``--no-compile`` (and by default with ``--quick``), a failed compile as a row.

The bookkeeping is checked with fake candidates, a fake clock and fake compile counts; one
test really compiles a tiny layer case. No test asserts a timing.
"""

from __future__ import annotations

import json

import pytest
import torch

from mpnb.lab import bench
from mpnb.lab.bench import Candidate, Case, Options, _compile, _harness, compiled, run_case
from mpnb.lab.bench._report import format_rows


class _FakeCompiler:
    """A clock and compile counts driven by the fake candidate's calls: call ``k`` takes
    ``durations[k]`` seconds and compiles when ``k < compiling``."""

    def __init__(self, monkeypatch, durations, compiling):
        self.now, self.calls = 0.0, 0
        self.durations, self.compiling = durations, compiling
        self.frames = 0
        monkeypatch.setattr(_compile, "_clock", lambda: self.now)
        monkeypatch.setattr(_compile, "compile_events", self.events)
        monkeypatch.setattr(_compile, "reset", lambda: None)

    def events(self):
        return {"frames": self.frames, "aot": 0, "hits": 0, "misses": self.frames}

    def __call__(self):
        k = self.calls
        self.now += self.durations[min(k, len(self.durations) - 1)]
        if k < self.compiling:
            self.frames += 1
        self.calls += 1


def _fixed_times(monkeypatch, per_round):
    def fake(cands, opts):
        times = [list(per_round[c.name][: opts.rounds]) for c in cands]
        return times, [1] * len(cands), [0.0] * len(cands)

    monkeypatch.setattr(_harness, "time_rounds", fake)


def test_warm_up_times_the_calls_that_compiled_recompiles_included(monkeypatch):
    fake = _FakeCompiler(monkeypatch, [30.0, 2.0, 1e-3], compiling=2)
    warm = _compile.warm_up(fake)
    # Calls 1 and 2 compiled (the second a recompile); call 3 compiled nothing: warm.
    assert (warm.seconds, warm.calls, fake.calls) == (32.0, 2, 3)
    assert warm.cache_misses == 2 and warm.cache == ""


def test_warm_up_refuses_an_eager_function_and_endless_recompiles(monkeypatch):
    with pytest.raises(RuntimeError, match="compiled nothing"):
        _compile.warm_up(_FakeCompiler(monkeypatch, [1e-3], compiling=0))
    with pytest.raises(RuntimeError, match="still recompiling") as e:
        _compile.warm_up(_FakeCompiler(monkeypatch, [1.0], compiling=99), max_calls=3)
    assert "after 3 calls" in str(e.value)


def _case(fn) -> Case:
    return Case(
        "c",
        "w",
        [
            Candidate("base", lambda: None),
            Candidate("ours", lambda: None),
            Candidate("compiled", fn, compiled=True),
        ],
    )


def test_compile_time_is_reported_apart_from_the_steady_state(monkeypatch):
    fake = _FakeCompiler(monkeypatch, [40.0, 1e-3], compiling=1)
    _fixed_times(monkeypatch, {"base": [2e-3] * 3, "ours": [1e-3] * 3, "compiled": [4e-3] * 3})
    rows = run_case(_case(fake), Options.make(rounds=3, warmup=1))
    base, ours, comp = rows
    assert comp.compile_s == 40.0 and comp.compile_calls == 1
    # The rounds see only the steady state: 40 s of compiling moves neither median nor ratio.
    assert comp.median_s == 4e-3 and comp.ratio == pytest.approx(0.5)
    assert base.compile_s is None and ours.compile_s is None
    header, *lines = format_rows(rows).splitlines()[0:1] + format_rows(rows).splitlines()[2:]
    assert header.split()[-1] == "compile"
    assert lines[2].endswith("40 s") and not lines[1].endswith("s")
    assert json.loads(json.dumps(comp.to_dict()))["compile_s"] == 40.0


def test_no_compile_leaves_compiled_candidates_out_and_quick_implies_it(monkeypatch):
    def boom():
        raise AssertionError("a compiled candidate ran under --no-compile")

    _fixed_times(monkeypatch, {"base": [2e-3], "ours": [1e-3]})
    rows = run_case(_case(boom), Options.make(rounds=1, compile=False))
    assert [r.candidate for r in rows] == ["base", "ours"]
    assert Options.make().compile and not Options.make(quick=True).compile
    assert Options.make(quick=True, compile=True).compile
    assert not Options.make(compile=False).compile


def test_a_failed_compile_is_an_error_row_with_the_reason(monkeypatch):
    def no_compiler():
        raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found\nmore lines")

    _fixed_times(monkeypatch, {"base": [2e-3], "ours": [1e-3]})
    rows = run_case(_case(no_compiler), Options.make(rounds=1))
    assert [r.status for r in rows] == ["", "", "ERROR"]
    err = rows[2]
    assert "C++ compiler" in err.error and "--no-compile" in err.error
    assert "more lines" not in err.error
    assert rows[1].ratio == pytest.approx(2.0)  # the others are timed as usual
    table = format_rows(rows)
    assert f"compiled: {err.error}" in table and "ERROR" in table
    d = json.loads(json.dumps(err.to_dict(), allow_nan=False))
    assert d["median_s"] is None and d["status"] == "ERROR"


def test_a_baseline_that_fails_to_compile_stops_the_case(monkeypatch):
    def fails():
        raise RuntimeError("lowering failed")

    case = Case("c", "w", [Candidate("base", fails, compiled=True), Candidate("b", lambda: 0)])
    with pytest.raises(RuntimeError, match="baseline torch.compile") as e:
        run_case(case, Options.make(rounds=1))
    assert "lowering" in str(e.value)  # the compiler's own error, kept


def _layers(tmp_path, *flags):
    path = tmp_path / "layers.json"
    argv = ["layers", "--rounds", "1", "--scale", "0.001", "--json", str(path), *flags]
    assert bench.main([*argv, "--filter", "rms_norm fwd [(8, 4096) float32]"]) == 0
    return json.loads(path.read_text())


def test_cli_compile_flags(tmp_path, capsys):
    for flags in (["--quick"], ["--no-compile"]):
        data = _layers(tmp_path, *flags)
        assert data["header"]["compile"] is False and "inductor" not in data["header"]
        names = [r["candidate"] for r in data["rows"]]
        assert "mpnb rms_norm_fwd" in names and not any("compile" in n for n in names)


@pytest.mark.slow
def test_a_tiny_layer_case_really_compiles(tmp_path, capsys):
    """The compiled reference of RMSNorm's forward compiles (inductor, C++) and is timed."""
    data = _layers(tmp_path, "--quick", "--compile")
    header, rows = data["header"], data["rows"]
    assert header["compile"] is True and "cpp.threads" in header["inductor"]
    comp = [r for r in rows if r["candidate"] == "torch.compile(reference_rms_norm_fwd)"]
    assert len(comp) == 1 and comp[0]["status"] != "ERROR", comp
    assert comp[0]["compile_s"] > 0 and comp[0]["compile_calls"] >= 1
    assert comp[0]["median_s"] > 0 and comp[0]["ratio"] > 0 and comp[0]["bw_frac"] > 0


def test_compiled_makes_a_lazy_compiled_candidate():
    x = torch.ones(4)
    cand = compiled("c", lambda t: t * 2, lambda f: lambda: f(x), bytes=32)
    assert cand.compiled and cand.bytes == 32 and cand.name == "c"
