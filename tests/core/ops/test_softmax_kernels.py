"""The causal softmax kernels' partial blocks: row i keeps its first i + 1 lanes and writes
zeros after them, for every lane count of the block holding i (the lanes past it are chosen by
a compare-and-blend on AVX2 and AVX-512, not ATen's switch on the count).

Each causal row must give the bits the plain (non-causal) kernel gives on the row cut to its
first i + 1 scores: the same blocks, the same sums, only the lanes chosen another way.
"""

from __future__ import annotations

import pytest
import torch

M = torch.ops.mpnb
SQ = 70  # every lane count of a 16- and a 32-lane block, and rows longer than two blocks


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scale", [0.7, -1.3])
def test_each_causal_row_is_the_plain_kernel_on_its_first_rows_scores(compiled, dtype, scale):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(2, SQ, SQ, generator=g, dtype=torch.float64) * 3).to(dtype)
    dy = torch.randn(2, SQ, SQ, generator=g, dtype=torch.float64).to(dtype)
    y = M.scaled_upper_triang_masked_softmax_fwd(x, scale)
    dx = M.scaled_softmax_bwd(dy, y, scale, True)
    for i in range(SQ):
        n = i + 1
        want_y = M.scaled_softmax_fwd(x[:, i, :n].contiguous(), scale)
        assert torch.equal(_bits(y[:, i, :n]), _bits(want_y)), f"forward, row {i}"
        want_dx = M.scaled_softmax_bwd(
            dy[:, i, :n].contiguous(), y[:, i, :n].contiguous(), scale, False
        )
        assert torch.equal(_bits(dx[:, i, :n]), _bits(want_dx)), f"backward, row {i}"
    future = torch.ones(SQ, SQ, dtype=torch.bool).triu(1)
    assert (y[:, future] == 0).all() and (dx[:, future] == 0).all()
