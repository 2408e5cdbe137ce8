"""The README's main command, ``bash scripts/run.sh``, in a checkout as fresh as a clone: no
``out/`` folder, nothing run before. Setup (``scripts/setup.sh``) and the kernels' build are
stood in for (the suite has done both); ``mpnb`` is the real CLI, its run cut to a small
workload and two steps by flags appended after the script's own."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

_MPNB = """#!/bin/sh
# the real CLI; the kernels' build is the suite's, the run cut short
[ "$1" = build-ext ] && exit 0
exec "{python}" -m mpnb.cli "$@" --workload mlp --size small --steps 2 --configs O0 --no-progress
"""


@pytest.mark.slow
def test_the_main_job_writes_its_report_in_a_fresh_checkout(tmp_path):
    tree = tmp_path / "checkout"
    (tree / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "run.sh", tree / "scripts" / "run.sh")
    (tree / "scripts" / "setup.sh").write_text("#!/usr/bin/env bash\ntrue\n")
    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "mpnb").write_text(_MPNB.format(python=sys.executable))
    (shim / "mpnb").chmod(0o755)
    (tree / ".venv" / "bin").mkdir(parents=True)
    (tree / ".venv" / "bin" / "activate").write_text(f'export PATH="{shim}:$PATH"\n')

    done = subprocess.run(
        ["bash", "scripts/run.sh"], cwd=tree, capture_output=True, text=True, timeout=300
    )

    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    report = tree / "out" / "report.html"
    assert report.is_file() and report.stat().st_size > 10_000, sorted(tree.rglob("*"))
    assert "verdict" in done.stdout.lower(), done.stdout[-2000:]
