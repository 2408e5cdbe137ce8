"""With MPNB_DISABLE_EXT=1 every kernel test file passes on the pure-PyTorch references."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[2]
# Test files of op families whose kernels have a reference path.
FAMILY_TESTS = sorted(
    str(p)
    for pattern in ("test_multi_tensor.py", "test_optim_*.py", "test_layers_*.py")
    for p in TESTS.rglob(pattern)
)


@pytest.mark.slow
def test_kernel_suites_pass_on_references():
    env = {**os.environ, "MPNB_DISABLE_EXT": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *FAMILY_TESTS]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=TESTS.parent)
    tail = out.stdout[-3000:] + out.stderr[-2000:]
    assert out.returncode == 0, tail
    passed = re.search(r"(\d+) passed", out.stdout)
    assert passed and int(passed.group(1)) > 50, tail
