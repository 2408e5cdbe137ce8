"""The ``mpnb`` command (:mod:`mpnb.cli`): ``main`` dispatches ``doctor``, ``build-ext``,
``bench`` and ``compare``, returns each one's exit code, and leaves a bad command line to
argparse (exit code 2). ``compare``'s own flags are tested with :mod:`mpnb.lab.cli`, and
``--version`` with the install (tests/behaviour/test_install.py)."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest

import mpnb.core.doctor
import mpnb.core.ops
import mpnb.lab.bench
from mpnb.cli import build_parser, main
from mpnb.core.ops._build import BuildResult


def test_help_lists_every_command_and_exits_0(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: mpnb")
    for command in ("doctor", "build-ext", "bench", "compare"):
        assert command in out


@pytest.mark.parametrize("argv, says", [([], "required"), (["nope"], "invalid choice")])
def test_no_command_or_an_unknown_one_is_argparses_exit_2(argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and says in capsys.readouterr().err


def test_bench_gets_the_rest_of_the_command_line_unparsed(monkeypatch):
    seen = []
    monkeypatch.setattr(mpnb.lab.bench, "main", lambda rest: seen.append(rest) or 7)
    assert main(["bench", "--help", "amp", "--quick"]) == 7  # bench's own exit code
    assert seen == [["--help", "amp", "--quick"]]


@pytest.mark.parametrize("argv, build", [(["doctor"], True), (["doctor", "--no-build"], False)])
def test_doctor_prints_the_report_and_passes_no_build(argv, build, monkeypatch, capsys):
    asked = []
    monkeypatch.setattr(mpnb.core.doctor, "report", lambda build: asked.append(build) or "ok")
    assert main(argv) == 0
    assert asked == [build] and capsys.readouterr().out == "ok\n"


class _Ext:
    """A stand-in for the CPU extension: returns ``result`` and records the build options."""

    def __init__(self, result=None, disabled=False):
        self.result, self.disabled, self.asked = result, disabled, []

    def build(self, force, verbose):
        self.asked.append((force, verbose))
        return self.result


def _with_ext(monkeypatch, ext):
    monkeypatch.setattr(mpnb.core.ops, "cpu_extension", lambda: ext)
    return ext


def test_build_ext_refuses_while_the_extension_is_disabled(monkeypatch, capsys):
    ext = _with_ext(monkeypatch, _Ext(disabled=True))
    assert main(["build-ext"]) == 2
    assert "MPNB_DISABLE_EXT" in capsys.readouterr().err and ext.asked == []


def test_build_ext_says_why_a_build_failed_with_exit_1(monkeypatch, capsys):
    _with_ext(monkeypatch, _Ext(BuildResult(loaded=False, reason="no compiler")))
    assert main(["build-ext"]) == 1
    assert "no compiler" in capsys.readouterr().err


def test_build_ext_reports_a_build_its_options_and_a_note(monkeypatch, capsys):
    result = BuildResult(loaded=True, seconds=2.5, path="/x.so", built=True, compiled=3, note="n!")
    ext = _with_ext(monkeypatch, _Ext(result))
    assert main(["build-ext", "--force", "--verbose"]) == 0
    out = capsys.readouterr().out
    assert ext.asked == [(True, True)]
    assert "built in 2.5 s (3 build steps): /x.so" in out and "note: n!" in out


def test_build_ext_with_nothing_to_do_says_up_to_date(monkeypatch, capsys):
    ext = _with_ext(monkeypatch, _Ext(BuildResult(loaded=True, path="/x.so")))
    assert main(["build-ext"]) == 0
    assert ext.asked == [(False, False)] and "up to date" in capsys.readouterr().out


def test_a_forced_rebuild_that_built_but_did_not_load_is_still_a_success(monkeypatch, capsys):
    result = BuildResult(loaded=False, reason="loaded elsewhere", path="/x.so", built=True)
    _with_ext(monkeypatch, _Ext(result))
    assert main(["build-ext", "--force"]) == 0
    assert main(["build-ext"]) == 1  # without --force the same result is a failure


def test_compare_is_the_labs_command():
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    assert set(sub.choices) == {"doctor", "build-ext", "bench", "compare"}
    assert isinstance(sub.choices["compare"].get_default("func"), types.FunctionType)


def test_python_m_mpnb_is_the_command_and_importing_it_does_not_import_torch():
    r = subprocess.run(
        [sys.executable, "-c", "import sys, mpnb.cli; print('torch' in sys.modules)"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0 and r.stdout.strip() == "False"
    r = subprocess.run(
        [sys.executable, "-m", "mpnb", "nope"], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 2 and "invalid choice" in r.stderr
