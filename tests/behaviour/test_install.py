"""What a user's install shows: ``mpnb --version``, and a missing kernel said loudly, once, by
``doctor`` and on the first row of ``compare`` (the ops that fell back and why, one line per
cause). The install itself, from a wheel and an sdist into fresh venvs, is
``scripts/install-check.sh`` (run by ``scripts/test.sh``)."""

from __future__ import annotations

import importlib.metadata
import warnings

import pytest

from mpnb.cli import main
from mpnb.core.ops import all_ops, cpu_extension
from mpnb.core.ops._build import BuildResult

_WHY = "no C++ compiler (c++) on PATH (install g++ or set CXX)"


def test_version_names_the_version_and_where_it_is_installed(capsys):
    import mpnb

    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"mpnb {importlib.metadata.version('mpnb')} (")
    assert mpnb.__version__ == importlib.metadata.version("mpnb")  # one version, two readers
    assert line.endswith(f"{__import__('pathlib').Path(mpnb.__file__).resolve().parent})")


@pytest.fixture
def failed_build(monkeypatch):
    """The process-wide extension as after a failed build (its kernels stay registered: only
    what is reported is under test)."""
    ext = cpu_extension()
    monkeypatch.setattr(ext, "_result", BuildResult(False, _WHY))
    monkeypatch.setattr(ext, "_warned", True)
    return ext


def test_doctor_says_which_ops_fell_back_and_why_in_one_line(failed_build):
    from mpnb.core.doctor import kernel_fallbacks, report

    lines = kernel_fallbacks("cpu")
    assert len(lines) == 1, lines
    with_kernel = [op.name for op in all_ops() if op.cpu_kernel]
    assert lines[0].startswith(f"{len(with_kernel)} ops run their pure-PyTorch reference")
    assert _WHY in lines[0] and all(name in lines[0] for name in with_kernel)
    assert kernel_fallbacks("cuda") == []
    text = report(build=False)
    assert [ln for ln in text.splitlines() if "FELL BACK" in ln] == [f"  FELL BACK: {lines[0]}"]


def test_doctor_says_nothing_fell_back_when_the_kernels_loaded(kernels):
    from mpnb.core.doctor import kernel_fallbacks

    assert kernels and kernel_fallbacks("cpu") == []


def test_the_first_compare_row_says_which_ops_fell_back(failed_build):
    from mpnb.lab import compare

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        df = compare("mlp", opt_levels=("O0", "O1"), steps=2, device="cpu", progress=False)
    first = df["warnings"].iat[0].split("; ")
    fell_back = [w for w in first if w.startswith("C++ kernels: ")]
    assert len(fell_back) == 1 and _WHY in fell_back[0], first
    assert "C++ kernels: " not in df["warnings"].iat[1]  # said once, on the first row
