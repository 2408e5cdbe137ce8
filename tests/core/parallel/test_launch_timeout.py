"""``timeout`` bounds the whole distributed run, the report of where the hung ranks are
included (the stack dumps used to wait about 2 s per rank, after the timeout)."""

from __future__ import annotations

import time

import pytest

from mpnb.core.parallel import launch

pytestmark = pytest.mark.dist


def _hang() -> None:
    time.sleep(3600)


def test_the_timeout_bounds_the_run_and_its_diagnostics():
    """2 ranks with timeout=2 took 6.1 s (4 ranks: 8.3 s)."""
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="within 2 s"):
        launch(_hang, 2, backend="gloo", timeout=2)
    assert time.monotonic() - t0 < 2 + 1.5  # the timeout, then stopping the ranks


@pytest.mark.parametrize("timeout", [0, -5, float("nan"), float("inf")])
def test_launch_refuses_a_timeout_that_bounds_nothing(timeout):
    with pytest.raises(ValueError, match="timeout"):
        launch(print, 2, timeout=timeout)
