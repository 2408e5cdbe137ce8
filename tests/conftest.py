"""Shared test configuration: GPU cases skip cleanly without CUDA; kernel fixtures fail loudly."""

from __future__ import annotations

import os

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (none on this machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def kernels_expected() -> bool:
    """True unless MPNB_DISABLE_EXT=1; when True the kernels MUST load (a failed build fails)."""
    return os.environ.get("MPNB_DISABLE_EXT", "0") in ("", "0")


@pytest.fixture(scope="session")
def kernels() -> bool:
    """Build/load the CPU kernels once; fail (never skip) if they were expected and did not load."""
    from mpnb.core.ops import cpu_extension, kernel_ready

    ready = kernel_ready()
    if kernels_expected():
        status = cpu_extension().status()
        assert ready, f"the CPU kernels failed to build/load: {status.reason if status else '?'}"
    return ready


@pytest.fixture(params=["kernel", "reference"])
def op_impl(request, monkeypatch) -> str:
    """Run the test once with mpnb's kernels and once with every op's pure-PyTorch reference.

    ``"reference"`` sets ``MPNB_DISABLE_EXT=1`` for the test (read per call today); the
    returned string says which implementation the ops take.
    """
    if request.param == "reference":
        monkeypatch.setenv("MPNB_DISABLE_EXT", "1")
    else:
        monkeypatch.delenv("MPNB_DISABLE_EXT", raising=False)
    return request.param


@pytest.fixture
def devices():
    """CPU always; CUDA when present."""
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
