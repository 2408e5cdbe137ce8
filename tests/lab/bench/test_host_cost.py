"""The host-cost suite: every case runs (its launchers' host work, no kernel), with torch's
call as the base and a target on the cached table; in its own process, so that triton is
imported there without the interpreter the kernel tests of this session use."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("triton", reason="the suite times mpnb's Triton launchers")


def test_the_suite_runs_every_case_at_tiny_sizes(tmp_path):
    path = tmp_path / "host.json"
    argv = ["bench", "host-cost", "--quick", "--rounds", "1", "--scale", "0.001"]
    cmd = [sys.executable, "-m", "mpnb", *argv, "--json", str(path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(path.read_text())["rows"]
    cases = {(r["case"], r["workload"]) for r in rows}
    assert cases == {
        (c, w) for c in ("scale host cost", "adamw host cost") for w in ("GPT 20M/76", "1000x1k")
    }
    cached = [r for r in rows if r["candidate"].endswith("table cached")]
    assert len(cached) == 4 and all(r["target"] == 1.0 and r["ratio"] > 0 for r in cached)
    assert all(r["median_s"] > 0 for r in rows)
