"""Every flag of the distributed comparison is used or refused before anything starts: rank
counts, timeouts, the output path, and the one-process flags that do not apply to ranks."""

from __future__ import annotations

import time

import pytest

import mpnb.lab
from mpnb.cli import main
from mpnb.core.parallel import launch
from mpnb.core.parallel.launch import cpus_available
from mpnb.lab.distributed.__main__ import main as dist_main


def _code(run, argv) -> int:
    """The exit code of ``run(argv)``, argparse's usage errors (SystemExit) included."""
    try:
        return run(argv)
    except SystemExit as e:
        return e.code


_RUN = ["--workload", "mlp", "--size", "small", "--steps", "4"]


@pytest.mark.parametrize(
    "args, says",
    [
        (["--ranks", "0"], "--ranks"),
        (["--ranks", "-1"], "--ranks"),
        (["--ranks", "2", "--timeout", "0"], "--timeout"),
        (["--ranks", "2", "--timeout", "-5"], "--timeout"),
        (["--ranks", "2", "--timeout", "nan"], "--timeout"),
        (["--ranks", "2", "--dtype", "fp16"], "--dtype"),
        (["--ranks", "2", "--isolate"], "--isolate"),
        (["--ranks", "2", "--out", "rows.html"], ".csv or .json"),
        (["--ranks", str(cpus_available() + 1)], "CPU"),
    ],
    ids=[
        "ranks0",
        "ranks-1",
        "timeout0",
        "timeout-5",
        "timeout-nan",
        "dtype",
        "isolate",
        "html",
        "oversubscribed",
    ],
)
def test_compare_refuses_what_the_distributed_run_would_drop(args, says, capsys):
    """--ranks 0/-1 ran the one-process comparison; --timeout 0/-5/nan said 'no rank had
    started' or failed after the run; --dtype, --isolate and --out were dropped silently;
    --ranks 64 on 2 CPUs started 65 processes."""
    t0 = time.monotonic()
    assert _code(main, ["compare", *_RUN, *args]) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err
    assert time.monotonic() - t0 < 10  # refused up front: nothing was trained


def test_compare_refuses_an_unwritable_out_with_ranks(tmp_path, capsys):
    """--out was neither checked nor written with --ranks."""
    (tmp_path / "a_file").write_text("x")
    for bad, says in [
        (tmp_path, "is a directory"),
        (tmp_path / "a_file" / "rows.json", "is a file, so"),
        (tmp_path / "missing" / "rows.json", "create it first"),
    ]:
        assert _code(main, ["compare", *_RUN, "--ranks", "2", "--out", str(bad)]) == 2
        err = capsys.readouterr().err
        assert says in err and "--out" in err and str(bad) in err


def test_the_script_refuses_an_unwritable_out_before_the_run(tmp_path, capsys):
    t0 = time.monotonic()
    assert _code(dist_main, [*_RUN, "--ranks", "2", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--out" in err and "is a directory" in err
    assert _code(dist_main, [*_RUN, "--ranks", "0"]) == 2
    assert "--ranks" in capsys.readouterr().err
    assert time.monotonic() - t0 < 10


@pytest.mark.parametrize(
    "kw, says",
    [
        (dict(ranks=0), "ranks=0"),
        (dict(ranks=-1), "ranks=-1"),
        (dict(ranks=2, timeout=0), "timeout=0"),
        (dict(ranks=2, timeout=float("nan")), "timeout=nan"),
        (dict(ranks=cpus_available() + 1), "CPU"),
    ],
)
def test_compare_refuses_bad_rank_counts_and_timeouts(kw, says):
    with pytest.raises(ValueError, match=says):
        mpnb.lab.compare("mlp", size="small", steps=4, progress=False, **kw)


@pytest.mark.parametrize("timeout", [0, -5, float("nan"), float("inf")])
def test_launch_refuses_a_timeout_that_bounds_nothing(timeout):
    with pytest.raises(ValueError, match="timeout"):
        launch(print, 2, timeout=timeout)


def test_batch_sizes_that_are_not_integers_say_so(capsys):
    assert _code(main, ["compare", "--batch-sizes", "abc", "--out", ""]) == 2
    assert "integers" in capsys.readouterr().err
