"""Fixtures of the kernel tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def compiled(kernels):
    """Skip where the compiled kernels are off (MPNB_DISABLE_EXT=1): the test checks a property
    of theirs (stores, lane handling, branch-free loops), not of the Python references."""
    if not kernels:
        pytest.skip("a property of the compiled kernels (MPNB_DISABLE_EXT=1 runs the references)")
