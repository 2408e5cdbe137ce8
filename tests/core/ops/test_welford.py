"""SyncBatchNorm's statistics ops: what SyncBatchNorm relies on (PyTorch's batch statistics,
merging ranks' statistics gives the whole batch's), on the kernel and on the reference, and
errors that name the fix.

Kernel vs reference on every dtype and opcheck: tests/core/ops/test_library.py.
"""

from __future__ import annotations

import pytest
import torch

from mpnb.core.ops import welford_mean_var, welford_parallel


@pytest.mark.parametrize("channel_last", [False, True])
def test_batch_statistics_match_torch(op_impl, channel_last):
    x = torch.randn(6, 5, 7, 3, dtype=torch.float64) * 3 + 2
    dims = (0, 1, 2) if channel_last else (0, 2, 3)
    var, mean = torch.var_mean(x, dim=dims, correction=0)
    got_mean, got_var = welford_mean_var(x, channel_last)
    torch.testing.assert_close(got_mean, mean, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_var, var, rtol=1e-12, atol=1e-12)
    m32, v32 = welford_mean_var(x.bfloat16(), channel_last)  # half data: fp32 statistics
    assert m32.dtype == v32.dtype == torch.float32


def test_merging_ranks_gives_the_whole_batch(op_impl):
    x = torch.randn(16, 6, dtype=torch.float64)
    parts = [welford_mean_var(h, True) for h in (x[:5], x[5:5], x[5:])]  # one rank without data
    m, v = welford_parallel(
        torch.stack([p[0] for p in parts]),
        torch.stack([p[1] for p in parts]),
        torch.tensor([5.0, 0.0, 11.0], dtype=torch.float64),
    )
    torch.testing.assert_close(m, x.mean(0), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(v, x.var(0, correction=0), rtol=1e-12, atol=1e-12)
    m, v = welford_parallel(torch.ones(2, 3), torch.ones(2, 3), torch.zeros(2))
    assert not m.any() and not v.any()  # no data at all: zeros, not NaN


def test_errors_name_the_fix(op_impl):
    with pytest.raises(ValueError, match="no channel dim; pass"):
        welford_mean_var(torch.randn(5))
    with pytest.raises(TypeError, match="supported dtypes"):
        welford_mean_var(torch.ones(4, 3, dtype=torch.int32))
    with pytest.raises(ValueError, match="stack one row per rank"):
        welford_parallel(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(3))
    with pytest.raises(TypeError, match="convert the counts with"):
        welford_parallel(torch.zeros(2, 3), torch.zeros(2, 3), torch.tensor([1, 2]))
