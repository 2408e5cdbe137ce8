"""``python -m mpnb.apex`` (:mod:`mpnb.apex`): ``main`` parses its options before SCRIPT and
refuses a bad command line with exit code 2 and the usage; ``run_script`` runs a script as
``__main__`` with ``import apex`` resolved to mpnb and restores ``sys.argv``, ``sys.path`` and
the alias afterwards, also when the script raises. (What ``--cpu`` and ``--check`` do is
tested with :mod:`mpnb.compat`'s rehearsal and check.)"""

from __future__ import annotations

import sys

import pytest

from mpnb.apex import main, run_script

SCRIPT = """\
import sys
import apex
from apex import amp
argv = list(sys.argv)
amp_is_mpnbs = amp.initialize.__module__.startswith("mpnb.")
first_path = sys.path[0]
"""


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(SCRIPT)
    return path


def test_run_script_runs_it_as_main_with_apex_resolved_to_mpnb(script):
    argv, path = list(sys.argv), list(sys.path)
    ns = run_script(str(script), ["--opt-level", "O2"])
    assert ns["__name__"] == "__main__" and ns["amp_is_mpnbs"]
    assert ns["argv"] == [str(script), "--opt-level", "O2"]
    assert ns["first_path"] == str(script.parent)  # the script's own modules import
    assert sys.argv == argv and sys.path == path
    assert "apex" not in sys.modules  # the alias is gone again


def test_run_script_restores_everything_when_the_script_raises(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import apex\nraise RuntimeError('from the script')\n")
    argv, path = list(sys.argv), list(sys.path)
    with pytest.raises(RuntimeError, match="from the script"):
        run_script(str(bad), [])
    assert sys.argv == argv and sys.path == path and "apex" not in sys.modules


def test_main_runs_the_script_and_returns_0(script, capsys):
    assert main([str(script), "a"]) == 0


@pytest.mark.parametrize("flag", ["-h", "--help"])
def test_help_prints_the_usage_and_exits_0(flag, capsys):
    assert main([flag]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m mpnb.apex") and "--check" in out


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--gpu", "SCRIPT"], "unknown option '--gpu'"),
        ([], "no SCRIPT"),
        (["--cpu"], "no SCRIPT"),
        (["--cpu", "--check", "SCRIPT"], "pass one of them"),
        (["--json", "SCRIPT"], "add --check"),
        (["--deprecated_fused_adam", "--check", "SCRIPT"], "runs nothing"),
        (["missing.py"], "no such script"),
        (["--check", "SCRIPT", "x"], "no script arguments"),
    ],
)
def test_a_bad_command_line_exits_2_saying_why_and_the_usage(argv, says, script, capsys):
    argv = [str(script) if a == "SCRIPT" else a for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("mpnb.apex: ") and says in err
    assert "python -m mpnb.apex" in err


def test_options_after_script_are_the_scripts(tmp_path, capsys):
    path = tmp_path / "echo.py"
    path.write_text("import sys\nprint(sys.argv[1:])\n")
    assert main([str(path), "--cpu", "--help"]) == 0
    assert capsys.readouterr().out.strip() == "['--cpu', '--help']"


def test_check_exits_0_for_a_script_mpnb_covers_and_2_for_one_it_cannot_read(tmp_path, capsys):
    ok = tmp_path / "ok.py"
    ok.write_text("from apex import amp\nmodel, opt = amp.initialize(model, opt, 'O1')\n")
    assert main(["--check", str(ok)]) == 0
    assert "amp.initialize" in capsys.readouterr().out
    broken = tmp_path / "broken.py"
    broken.write_text("def (:\n")
    assert main(["--check", str(broken)]) == 2
    assert capsys.readouterr().err.startswith("mpnb.apex")
