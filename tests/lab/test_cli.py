"""``mpnb compare`` (``mpnb.lab.cli``): the table and the report it writes, ``--json``, the
keep-list sweep, and every bad flag refused before anything trains."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import pytest
import torch

from mpnb.cli import main
from mpnb.lab import workloads


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
            "join their configuration with ':'",
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
    err = capsys.readouterr().err
    assert "numbers of blocks" in err and "or 'all'" in err and "got '1,x'" in err
    assert main(["compare", "--ranks", "2", "--keep-last", "1", "--out", ""]) == 2
    err = capsys.readouterr().err
    assert "--keep-last" in err and "one-process comparison" in err


@pytest.mark.parametrize(
    "args, says",
    [
        (["--steps", "0"], "need at least 2 steps"),
        (["--steps", "-5"], "need at least 2 steps"),
        (["--batch-sizes", ""], "expected positive batch sizes"),
        (["--batch-sizes", "16,0"], "expected positive batch sizes"),
        (["--lr", "-1"], "lr=-1.0 must be"),
        (["--lr", "nan"], "lr=nan must be"),
    ],
)
def test_cli_refuses_bad_counts_instead_of_running_the_defaults(args, says, capsys):
    with pytest.raises(SystemExit) as e:
        main(["compare", "--out", "", *args])
    assert e.value.code == 2
    assert says in capsys.readouterr().err


def test_cli_refuses_an_unknown_device_and_an_unwritable_report(tmp_path, capsys):
    assert main(["compare", "--device", "tpu", "--out", ""]) == 2
    err = capsys.readouterr().err
    assert "device='tpu'" in err and "is not a device" in err and "'cpu'" in err
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    for bad, says in [
        (blocker / "report.html", "is a file, so"),
        (tmp_path, "is a directory"),
    ]:
        t0 = time.perf_counter()
        assert main(["compare", "--out", str(bad)]) == 2
        err = capsys.readouterr().err
        assert says in err and "--out ''" in err
        assert time.perf_counter() - t0 < 5  # refused before the run, not after it


@pytest.mark.parametrize("args", [["--opt-levels", "O0,O1,O1"], ["--batch-sizes", "16,16"]])
def test_the_cli_refuses_a_configuration_given_twice(args, capsys):
    try:  # a bad list is a usage error (argparse exits) or the run's refusal (exit code 2)
        code = main(["compare", "--workload", "mlp", "--steps", "2", "--out", "", *args])
    except SystemExit as e:
        code = e.code
    assert code == 2
    err = capsys.readouterr().err
    assert "more than once" in err and "Traceback" not in err


def test_cli_rejects_an_unknown_configuration():
    cmd = [sys.executable, "-m", "mpnb.cli", "compare", "--opt-levels", "O0,fp4", "--json"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "fp4" in p.stderr and "mxfp8" in p.stderr and not p.stdout


@pytest.mark.slow
def test_cli_compare_prints_the_table_and_writes_the_report(tmp_path, capsys):
    out = tmp_path / "report.html"
    rc = main(
        [
            "compare",
            "--workload",
            "mlp",
            "--opt-levels",
            "O0,O2",
            "--steps",
            "6",
            "--threads",
            "1",
            "--no-progress",
            "--out",
            str(out),
        ]
    )
    text = capsys.readouterr().out
    assert rc == 0 and out.exists()
    assert "O0 fp32 b64" in text and "O2 bf16 b64" in text and "vs O0" in text
    assert "hardware:" in text and "\nVerdict:" in text
    rc = main(
        [
            "compare",
            "--opt-levels",
            "O0",
            "--steps",
            "4",
            "--threads",
            "1",
            "--no-progress",
            "--out",
            "",
            "--json",
        ]
    )
    doc = json.loads(capsys.readouterr().out)  # the default workload: the small GPT
    assert rc == 0 and doc["rows"][0]["configuration"] == "O0 fp32 b16"
    assert doc["workload"]["name"] == "transformer" and doc["workload"]["size"] == "small"


def test_cli_bad_flag_is_a_clear_error(capsys):
    assert main(["compare", "--opt-levels", "O7", "--no-progress", "--out", ""]) == 2
    assert "O7" in capsys.readouterr().err


def _code(run, argv) -> int:
    """The exit code of ``run(argv)``, argparse's usage errors (SystemExit) included."""
    try:
        return run(argv)
    except SystemExit as e:
        return e.code


def test_batch_sizes_that_are_not_integers_say_so(capsys):
    assert _code(main, ["compare", "--batch-sizes", "abc", "--out", ""]) == 2
    assert "integers" in capsys.readouterr().err
