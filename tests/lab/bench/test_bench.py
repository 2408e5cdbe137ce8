"""The benchmark harness: statistics on fixed numbers, the suite registry, the table and JSON.

No test here asserts a timing: runs use tiny sizes and one or two rounds, and only the shape
of what comes out (rows, columns, header keys) is checked.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys

import pytest
import torch

from mpnb.lab import bench
from mpnb.lab.bench import READ, RMW, Candidate, Case, Options, run_case
from mpnb.lab.bench._report import format_rows

# ---- options and registry ------------------------------------------------------------------


def test_options_quick_and_overrides():
    q = Options.make(quick=True)
    assert q.quick and q.rounds < Options().rounds
    assert Options.make(quick=True, rounds=3, scale=0.5).rounds == 3
    with pytest.raises(ValueError, match="rounds"):
        Options.make(rounds=0)


def test_registry_lists_suites_without_importing(capsys):
    names = bench.suites()
    assert "multi-tensor" in names and names["multi-tensor"]
    assert not any(n.startswith("_") for n in names)
    assert bench.main(["--list"]) == 0
    assert "multi-tensor" in capsys.readouterr().out
    # `--list` imports neither the suites nor torch (it must be instant).
    code = (
        "import sys; from mpnb.cli import main; assert main(['bench', '--list']) == 0; "
        "assert 'torch' not in sys.modules and 'mpnb.lab.bench.multi_tensor' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


def test_public_names_resolve():
    for name in bench.__all__:
        assert getattr(bench, name) is not None
    with pytest.raises(AttributeError):
        bench.no_such_name  # noqa: B018


def test_unknown_suite_is_a_clear_error(capsys):
    assert bench.main(["no-such-suite"]) == 2
    err = capsys.readouterr().err
    assert "no-such-suite" in err and "multi-tensor" in err


# The arguments make a run that would do no work (no case matches): refused ones must be
# refused before it, with exit code 2 and a message, not after it or with a traceback.
_NOTHING = ["multi-tensor", "--quick", "--rounds", "1", "--filter", "no-case-has-this"]


@pytest.mark.parametrize(
    "args, says",
    [
        (["--scale", "0"], "--scale 0.0: workload sizes are multiplied by it"),
        (["--scale", "-1"], "must be a positive number"),
        (["--scale", "nan"], "must be a positive number"),
        (["--threads", "0"], "--threads 0: need a positive thread count"),
        (["--device", "tpu"], "--device 'tpu' is not a device the suites run on"),
    ],
)
def test_bad_options_are_refused_before_anything_runs(args, says, capsys):
    """--scale 0/-1 timed 1-element workloads and printed PASS; --threads 0 and --device tpu
    ended in a traceback."""
    assert bench.main([*_NOTHING, *args]) == 2
    assert says in capsys.readouterr().err


def test_a_json_path_that_cannot_be_written_is_refused_before_the_run(tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    for path, says in [(tmp_path, "is a directory"), (blocker / "out.json", "is a file, so")]:
        assert bench.main([*_NOTHING, "--json", str(path)]) == 2
        err = capsys.readouterr().err
        assert says in err and "--json" in err
    assert blocker.read_text() == "x"


_ONE = ["multi-tensor", "--quick", "--rounds", "1", "--scale", "0.0005", "--filter", "l2norm"]


def test_the_json_is_written_whole_or_not_at_all(tmp_path, file_size_limit, capsys):
    """A write that fails half-way (a full disk) keeps the previous file, and says so (the
    file used to be truncated to the part written)."""
    path = tmp_path / "out.json"
    previous = '{"previous": true}'
    path.write_text(previous)
    with file_size_limit(200):  # the header alone is larger
        code = bench.main([*_ONE, "--json", str(path)])
    assert code == 1
    assert "File too large" in capsys.readouterr().err
    assert path.read_text() == previous
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]  # no temporary file left


def test_a_filter_that_matches_nothing_keeps_the_previous_json(tmp_path, capsys):
    """`mpnb bench --filter xyz --json prev.json` wrote 0 rows over prev.json."""
    path = tmp_path / "prev.json"
    previous = '{"rows": ["the previous run"]}'
    path.write_text(previous)
    assert bench.main([*_NOTHING, "--json", str(path)]) == 1
    err = capsys.readouterr().err
    assert "no case matched --filter" in err and str(path) in err and "kept" in err
    assert path.read_text() == previous


def test_a_json_path_in_a_missing_directory_is_refused_before_the_run(tmp_path, capsys):
    path = tmp_path / "missing" / "out.json"
    assert bench.main([*_NOTHING, "--json", str(path)]) == 2
    err = capsys.readouterr().err
    assert "--json" in err and "create it first" in err
    assert not path.parent.exists()


# ---- running cases -------------------------------------------------------------------------


def _tiny_case(target=None, bw_target=None) -> Case:
    x = torch.ones(256)
    y = torch.ones(256)
    return Case(
        "tiny",
        "256",
        [
            Candidate("torch", lambda: x.add_(y, alpha=1e-7), 12 * 256, RMW),
            Candidate("other", lambda: x.add_(y, alpha=1e-7), 12 * 256, RMW, target, bw_target),
            Candidate("reader", x.sum, 4 * 256, READ),
        ],
        bandwidth_numel=256,
    )


def test_run_case_rows_and_roles():
    opts = Options.make(quick=True, rounds=2)
    rows = run_case(_tiny_case(target=1e-9, bw_target=1e-9), opts, suite="t")
    roles = [r.role for r in rows]
    assert roles == ["baseline", "candidate", "candidate", "bandwidth", "bandwidth"]
    base, other, reader = rows[:3]
    assert base.ratio is None and other.ratio is not None and other.ratio > 0
    assert other.status == "PASS" and base.status == ""
    assert other.bw_ref.startswith("bw: a += s*b") and reader.bw_ref.startswith("bw: x.sum()")
    assert all(len(r.times_s) == 2 and r.median_s > 0 and r.gbps > 0 for r in rows)
    table = format_rows(rows)
    for col in ("case", "candidate", "median", "spread", "vs PyTorch", "GB/s", "% bw", "preempt"):
        assert col in table.splitlines()[0]


def test_unreachable_target_is_a_miss():
    rows = run_case(_tiny_case(target=1e9), Options.make(quick=True, rounds=1))
    assert rows[1].status == "MISS"


def _fixed_times(monkeypatch, per_round: dict[str, list[float]]):
    """Make run_case see these per-round times (seconds per call) instead of a clock's."""
    from mpnb.lab.bench import _harness

    def fake(cands, opts):
        times = [list(per_round[c.name][: opts.rounds]) for c in cands]
        return times, [1] * len(cands), [0.0] * len(cands)

    monkeypatch.setattr(_harness, "time_rounds", fake)


def test_max_extra_is_the_time_added_to_the_baseline(monkeypatch):
    _fixed_times(
        monkeypatch,
        {
            "base": [200e-6, 210e-6, 190e-6, 400e-6, 200e-6, 205e-6],
            "adds 300us": [500e-6, 505e-6, 495e-6, 700e-6, 500e-6, 510e-6],
            "adds 300us, tight": [500e-6, 505e-6, 495e-6, 700e-6, 500e-6, 510e-6],
        },
    )
    case = Case(
        "c",
        "w",
        [
            Candidate("base", lambda: None),
            Candidate("adds 300us", lambda: None, max_extra_s=1e-3),
            Candidate("adds 300us, tight", lambda: None, max_extra_s=100e-6),
        ],
        min_rounds=6,
    )
    rows = run_case(case, Options.make(rounds=2, warmup=1, round_time=0.004))
    assert all(r.rounds == 6 for r in rows)  # min_rounds raised the rounds outside --quick
    assert abs(rows[1].extra_s - 300e-6) < 1e-9 and rows[0].extra_s is None
    assert (rows[1].status, rows[2].status) == ("PASS", "MISS")
    assert re.search(r"\+300\.0us \(<=1000\)", format_rows(rows).splitlines()[3])
    quick = run_case(case, Options.make(quick=True, rounds=1))
    assert quick[0].rounds == 1  # --quick keeps its own round count


def test_extra_ratio_compares_what_two_candidates_add_to_the_baseline(monkeypatch):
    _fixed_times(
        monkeypatch,
        {
            "base": [200e-6, 250e-6, 200e-6, 220e-6, 200e-6],
            "other": [800e-6, 850e-6, 800e-6, 820e-6, 1200e-6],  # adds 600 us (1000 once)
            "adds 150us": [350e-6, 400e-6, 350e-6, 370e-6, 350e-6],
            "adds 450us": [650e-6, 700e-6, 650e-6, 670e-6, 650e-6],
        },
    )
    case = Case(
        "c",
        "w",
        [
            Candidate("base", lambda: None),
            Candidate("other", lambda: None),
            Candidate("adds 150us", lambda: None, extra_vs="other", max_extra_ratio=0.5),
            Candidate("adds 450us", lambda: None, extra_vs="other", max_extra_ratio=0.5),
        ],
    )
    rows = run_case(case, Options.make(rounds=5, warmup=1, round_time=0.004))
    # The median of the per-round ratios, not the ratio of the medians.
    assert rows[2].extra_ratio == pytest.approx(0.25) and rows[3].extra_ratio == pytest.approx(0.75)
    assert rows[1].extra_ratio is None and rows[2].extra_vs == "other"
    assert (rows[2].status, rows[3].status) == ("PASS", "MISS")
    assert re.search(r"\+150us=0\.25x \(<=0.5\)", format_rows(rows).splitlines()[4])


def test_no_bandwidth_baselines_without_bytes():
    case = Case("c", "w", [Candidate("a", lambda: None), Candidate("b", lambda: None)], 1000)
    rows = run_case(case, Options.make(quick=True, rounds=1))
    assert [r.role for r in rows] == ["baseline", "candidate"] and rows[1].gbps is None


@pytest.mark.parametrize("suite", ["optimizers", "layers", "amp"])
def test_every_cpu_suite_runs_end_to_end_at_tiny_sizes(suite, tmp_path, capsys):
    """Each CPU suite runs every case (its references called as the op table defines them)."""
    path = tmp_path / f"{suite}.json"
    argv = [suite, "--quick", "--rounds", "1", "--scale", "0.001", "--json", str(path)]
    assert bench.main(argv) == 0, capsys.readouterr().err
    rows = json.loads(path.read_text())["rows"]
    assert rows and all(r["median_s"] > 0 for r in rows)
    assert any(r["candidate"].startswith("mpnb") for r in rows)


def test_threads_option_is_restored_even_on_error(monkeypatch):
    before = torch.get_num_threads()
    seen = []

    def boom(opts):
        seen.append(torch.get_num_threads())
        raise RuntimeError("suite failed")
        yield

    import mpnb.lab.bench.multi_tensor as mt

    monkeypatch.setattr(mt, "cases", boom)
    with pytest.raises(RuntimeError, match="suite failed"):
        bench.run_suite("multi-tensor", Options.make(quick=True, threads=1))
    assert seen == [1] and torch.get_num_threads() == before


# ---- the in-cache roofline -----------------------------------------------------------------


def _roofline_case() -> Case:
    from mpnb.lab.bench._harness import InCache

    fits = InCache(lambda: None, 3000, lambda: None, 1000)
    return Case(
        "c",
        "w",
        [
            Candidate("torch", lambda: None),
            Candidate("kernel", lambda: None, 6000, RMW, bw_target=0.7, in_cache=fits),
        ],
        bandwidth_numel=500,  # a += s*b: 6000 bytes
    )


@pytest.mark.parametrize(
    "small_s, bound, frac",
    [(0.5e-6, "compute", 0.5), (2.1e-6, "memory", 2.5)],  # 2000 B in 2 us or 0.4 us
)
def test_roofline_is_the_marginal_in_cache_throughput_against_the_same_run_add(
    monkeypatch, small_s, bound, frac
):
    # DRAM: the add moves 6000 B in 3 us (2 GB/s), the kernel 6000 B in 6 us (1 GB/s: 50%).
    # In cache: 3000 B in 2.5 us, 1000 B in small_s; the call's fixed cost cancels out.
    _fixed_times(
        monkeypatch,
        {
            "torch": [5e-6],
            "kernel": [6e-6],
            "bw: a += s*b (fp32)": [3e-6],
            "kernel [in cache]": [2.5e-6],
            "kernel [in cache, small]": [small_s],
        },
    )
    rows = run_case(_roofline_case(), Options.make(quick=True, rounds=1))
    assert [r.candidate for r in rows] == ["torch", "kernel", "bw: a += s*b (fp32)"]
    kernel = rows[1]
    assert kernel.bw_frac == pytest.approx(0.5) and kernel.status == "MISS"
    assert kernel.cache_gbps == pytest.approx(2000 / (2.5e-6 - small_s) / 1e9)
    assert kernel.cache_frac == pytest.approx(frac) and kernel.bound == bound
    assert rows[0].cache_gbps is None and rows[0].bound == ""
    table = format_rows(rows)
    assert "roofline" in table.splitlines()[0]
    want = f"{bound}-bound: in-cache {kernel.cache_gbps:.3g} GB/s = {100 * frac:.0f}%"
    assert want in table.splitlines()[3]


def test_cache_resident_slices_fit_half_the_l2_of_each_thread(monkeypatch):
    from mpnb.lab.bench import _harness

    monkeypatch.setattr(_harness, "l2_bytes", lambda: 2 << 20)
    assert _harness.cache_resident(16 << 10, threads=1) == 64
    assert _harness.cache_resident(16 << 10, threads=2) == 128
    assert _harness.cache_resident(16 << 10, threads=2, most=100) == 100
    assert _harness.cache_resident(4 << 20, threads=1) == 4  # at least 4 units per thread
    monkeypatch.setattr(_harness, "l2_bytes", lambda: None)
    assert _harness.cache_resident(16 << 10, threads=1) is None  # no guessed cache


def test_a_one_thread_roofline_counts_every_thread_of_the_run(monkeypatch):
    # The slices ran on one thread (2000 B more in 2 us: 1 GB/s): at 2 threads the row's
    # in-cache throughput is both cores' (2 GB/s), compared with the add on both.
    from mpnb.lab.bench._harness import InCache

    one = InCache(lambda: None, 3000, lambda: None, 1000, one_thread=True)
    case = _roofline_case()
    case.candidates[1] = Candidate("kernel", lambda: None, 6000, RMW, bw_target=0.7, in_cache=one)
    times = {
        "torch": [5e-6],
        "kernel": [6e-6],
        "bw: a += s*b (fp32)": [3e-6],
        "kernel [in cache]": [2.5e-6],
        "kernel [in cache, small]": [0.5e-6],
    }
    _fixed_times(monkeypatch, times)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    kernel = run_case(case, Options.make(quick=True, rounds=1))[1]
    assert kernel.cache_gbps == pytest.approx(2 * 2000 / 2e-6 / 1e9)
    assert kernel.cache_frac == pytest.approx(1.0) and kernel.bound == "memory"


def test_cache_sizes_are_read_from_the_system():
    from mpnb.lab.bench._harness import l2_bytes, llc_bytes

    l2, llc = l2_bytes(), llc_bytes()
    assert llc is None or l2 is None or llc >= l2  # the last level is the highest one listed


def test_l2_size_is_read_from_the_system():
    from mpnb.lab.bench._harness import l2_bytes

    l2 = l2_bytes()
    assert l2 is None or (l2 >= 64 << 10 and l2 % (64 << 10) == 0)  # whole 64 KiB multiples


def test_no_roofline_from_rounds_where_the_small_slice_took_longer(monkeypatch):
    times = {
        "torch": [5e-6] * 3,
        "kernel": [6e-6] * 3,
        "bw: a += s*b (fp32)": [3e-6] * 3,
        "kernel [in cache]": [2.5e-6, 2.5e-6, 2.5e-6],
    }
    # one bad round of three: left out, the other two give 2000 B / 2 us
    _fixed_times(monkeypatch, {**times, "kernel [in cache, small]": [0.5e-6, 3e-6, 0.5e-6]})
    kernel = run_case(_roofline_case(), Options.make(quick=True, rounds=3))[1]
    assert kernel.cache_gbps == pytest.approx(1.0) and kernel.bound == "compute"
    # two bad rounds of three: no figure at all
    _fixed_times(monkeypatch, {**times, "kernel [in cache, small]": [3e-6, 3e-6, 0.5e-6]})
    kernel = run_case(_roofline_case(), Options.make(quick=True, rounds=3))[1]
    assert kernel.cache_gbps is None and kernel.bound == "" and kernel.bw_frac is not None


def _noisy_rounds(monkeypatch, spread: float):
    """A clock whose baseline takes 2 ms and whose candidate takes 1 ms times ``1 +- spread``
    in alternate rounds; records each call's (rounds, numbers given, first round)."""
    from mpnb.lab.bench import _harness

    calls = []

    def fake(cands, opts, numbers=None, first=0):
        calls.append((opts.rounds, numbers, first))
        rounds = range(first, first + opts.rounds)
        times = [[2e-3] * opts.rounds]
        times.append([1e-3 * (1 + spread * (-1) ** r) for r in rounds])
        times += [[1e-3] * opts.rounds for _ in cands[2:]]
        return times, [7] * len(cands), [0.0] * len(cands)

    monkeypatch.setattr(_harness, "time_rounds", fake)
    return calls


def _enough_case(**enough):
    from mpnb.lab.bench._harness import Enough

    cands = [Candidate("base", lambda: None), Candidate("ours", lambda: None)]
    return Case("c", "w", cands, enough=Enough(**enough), round_time=1e-3)


def test_enough_rounds_stop_once_the_interval_is_narrow(monkeypatch):
    calls = _noisy_rounds(monkeypatch, 0.0)
    rows = run_case(_enough_case(half_width=0.02, max_rounds=40), Options.make(rounds=15))
    assert [r.rounds for r in rows] == [15, 15] and len(calls) == 1  # exact ratios: no more
    assert rows[1].ratio_lo == rows[1].ratio_hi == 2.0


def test_enough_rounds_grow_to_the_most_while_the_interval_is_wide(monkeypatch):
    calls = _noisy_rounds(monkeypatch, 0.3)  # per-round ratios 1.54 and 2.86: never within 2%
    rows = run_case(_enough_case(half_width=0.02, max_rounds=32, step=5), Options.make(rounds=15))
    assert rows[1].rounds == 32 and len(rows[1].times_s) == 32
    # more rounds of the same length, the rotation continuing: 15, then 5, 5, 5 and the last 2
    assert calls == [
        (15, None, 0),
        (5, [7, 7], 15),
        (5, [7, 7], 20),
        (5, [7, 7], 25),
        (2, [7, 7], 30),
    ]
    capped = run_case(_enough_case(max_rounds=40, max_s=0.0), Options.make(rounds=15))
    assert capped[1].rounds == 15  # out of time: the first rounds only
    quick = run_case(_enough_case(max_rounds=40), Options.make(quick=True))
    assert quick[1].rounds == 5  # --quick keeps its own round count


def test_a_skipped_case_says_why_and_times_nothing():
    ran = []
    case = Case("c", "w", [Candidate("base", lambda: ran.append(1))], skipped="too big here")
    (row,) = run_case(case, Options.make(quick=True))
    assert ran == [] and row.status == "SKIPPED" and row.error == "too big here"
    assert row.role == "baseline" and math.isnan(row.median_s) and row.ratio is None
    table = format_rows([row])
    assert "SKIPPED" in table and "base: too big here" in table and "1 (base)" not in table


def test_the_copy_baseline_moves_eight_bytes_per_element():
    from mpnb.lab.bench._harness import COPY

    x = torch.ones(4096)
    case = Case(
        "copy",
        "4k",
        [
            Candidate("torch clone", x.clone, 8 * 4096, COPY),
            Candidate("mul", lambda: x * 2, 8 * 4096, COPY),
        ],
        bandwidth_numel=4096,
    )
    rows = run_case(case, Options.make(quick=True, rounds=3))
    bw = rows[-1]
    assert (bw.role, bw.candidate, bw.bytes) == ("bandwidth", "bw: copy (fp32)", 8 * 4096)
    assert rows[1].bw_ref == "bw: copy (fp32)" and rows[1].bw_frac > 0


def test_a_run_stopped_by_sigterm_keeps_the_cases_it_finished(monkeypatch):
    import os
    import signal
    import types

    from mpnb.lab.bench import _suite

    def cases(opts):
        yield Case("first", "w", [Candidate("a", lambda: None)])
        os.kill(os.getpid(), signal.SIGTERM)  # the time budget ran out while building the next
        yield Case("second", "w", [Candidate("a", lambda: None)])

    fake = types.SimpleNamespace(cases=cases)
    monkeypatch.setattr(_suite, "load_suite", lambda name: fake)
    monkeypatch.setattr(_suite, "collect_header", lambda device: {})
    before = signal.getsignal(signal.SIGTERM)
    result = _suite.run_suite("fake", Options.make(quick=True, rounds=1))
    assert [r.case for r in result.rows] == ["first"]
    assert result.header["stopped"] == "SIGTERM after 1 cases"
    assert signal.getsignal(signal.SIGTERM) is before  # the handler is put back


def test_calls_per_round_come_from_warm_calls(monkeypatch):
    # A first call that builds a cache (here: 1,000 times a warm call) counts for nothing in
    # the estimate: the rounds are as long as asked, of warm calls.
    from mpnb.lab.bench import _timing

    clock = [0.0]
    monkeypatch.setattr(_timing.benchmark, "timer", lambda: clock[0])
    calls = []

    def fn():
        clock[0] += 1e-3 if not calls else 1e-6  # 1 ms once, then 1 us
        calls.append(1)

    assert _timing._calls_per_round(fn, warmup=2, round_time=0.02) == 20_000
    calls.clear()

    def compiles(seconds=2.0):  # a first call longer than a round: a kernel compiled
        clock[0] += seconds if not calls else 1e-6
        calls.append(1)

    assert _timing._calls_per_round(compiles, warmup=2, round_time=0.02) == 20_000
    calls.clear()
    assert _timing._calls_per_round(compiles, warmup=1, round_time=0.005) == 5_000  # --quick
    slow = _timing._calls_per_round(lambda: clock.__setitem__(0, clock[0] + 0.05), 2, 0.02)
    assert slow == 1  # a call longer than a round: one call, no more timed to find out
