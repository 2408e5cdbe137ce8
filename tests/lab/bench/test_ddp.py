"""``mpnb bench ddp`` smoke test: two rank processes, three candidates, a ratio (never timed)."""

from __future__ import annotations

import pytest

from mpnb.lab.bench import Options, run_suite

pytestmark = [pytest.mark.dist, pytest.mark.slow]


def test_ddp_suite_quick_smoke():
    res = run_suite("ddp", Options.make(quick=True, rounds=2, scale=0.25))
    rows = res.rows
    assert [r.role for r in rows] == ["baseline", "candidate", "candidate"]
    assert rows[0].candidate.startswith("torch DDP")
    assert "comm hidden" in rows[1].candidate and rows[1].target == 0.9
    assert all(r.median_s > 0 for r in rows) and rows[1].ratio is not None
