"""The layers of mpnb hold: no import circle (scripts/import_cycles.py, run in-process) and
the layers contract of pyproject.toml (``lint-imports``, where import-linter is installed)."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location(
        "import_cycles", ROOT / "scripts/import_cycles.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = tmp_path / "pkg" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_the_walker_finds_a_circle_through_a_function_and_skips_type_checking(tmp_path):
    ic = _script()
    root = _package(
        tmp_path,
        {
            "__init__.py": "",
            "low.py": "def f():\n    from pkg import high\n",
            "high.py": "from pkg.low import f\n",
            "typed.py": (
                "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.hint\n"
            ),
            "hint.py": "import pkg.typed\n",
        },
    )
    assert ic.cycles(root, "pkg") == [["pkg.high", "pkg.low", "pkg.high"]]
    assert ic.cycles(root, "pkg", module_level=True) == []  # the edge back is in a function


def test_mpnb_has_no_import_circle_at_module_level():
    assert _script().cycles(module_level=True) == []


def test_mpnb_has_no_import_circle_not_even_through_imports_inside_functions():
    assert _script().cycles() == []


@pytest.mark.skipif(shutil.which("lint-imports") is None, reason="import-linter not installed")
def test_the_layers_contract_is_kept():
    run = subprocess.run(
        [shutil.which("lint-imports"), "--no-cache"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(ROOT), "PATH": str(Path(sys.executable).parent)},
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
