"""Fixtures and helpers of the kernel tests (``same_bits``, ``big_rows``: import them from here)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def compiled(kernels):
    """Skip where the compiled kernels are off (MPNB_DISABLE_EXT=1): the test checks a property
    of theirs (stores, lane handling, branch-free loops), not of the Python references."""
    if not kernels:
        pytest.skip("a property of the compiled kernels (MPNB_DISABLE_EXT=1 runs the references)")


@pytest.fixture
def streamed(compiled):
    """Streaming stores (outputs of 16 MiB or more) are the compiled kernels': the layer ops
    must run their C++ kernels here, not the references or the Triton kernels."""
    from mpnb.core.ops import op_path

    for name in ("layer_norm_fwd", "rms_norm_fwd", "scaled_softmax_fwd", "rope"):
        assert op_path(name) == "C++ kernel (cpu)", op_path(name)


# The streamed-store tests' rows: 16.9 MB of fp32, 8.4 MB of bf16 (whose case doubles the rows).
ROWS, COLS = 4100, 1029


def big_rows(dtype: torch.dtype) -> torch.Tensor:
    """Rows of ``COLS`` random values making an output of 16 MiB or more (streamed stores)."""
    rows = ROWS if dtype in (torch.float32, torch.float64) else 2 * ROWS
    g = torch.Generator().manual_seed(0)
    return torch.randn(rows, COLS, generator=g).to(dtype)


def same_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    """Assert that two 16-bit tensors hold the same bits (NaNs at the same places)."""
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    g, w = got[~nan].view(torch.int16), want[~nan].view(torch.int16)
    assert torch.equal(g, w), f"{(g != w).sum()} of {g.numel()} values differ"
