"""Outputs of 16 MiB or more are written with streaming stores: same bits as ordinary stores.

Rows are independent, so the first rows of a large (streamed) output must equal, bit for bit,
the output of the same rows computed alone (small, ordinary stores). An odd row length makes
most rows start unaligned, which exercises the head / tail blocks around the streamed body.
The kernels stream only into memory that is already backed (a fresh buffer from mmap gets
ordinary stores), so each test runs its large calls three times: the allocator hands a later
call memory an earlier one freed.
"""

from __future__ import annotations

import pytest
import torch

M = torch.ops.mpnb
ROWS, COLS = 4100, 1029  # 16.9 MB of fp32, 8.4 MB of bf16: the bf16 case doubles the rows


def _big(dtype: torch.dtype) -> torch.Tensor:
    rows = ROWS if dtype in (torch.float32, torch.float64) else 2 * ROWS
    g = torch.Generator().manual_seed(0)
    return torch.randn(rows, COLS, generator=g).to(dtype)


@pytest.fixture
def compiled(kernels):
    if not kernels:
        pytest.skip("streaming stores are a property of the compiled kernels")
    from mpnb.core.ops import op_path

    for name in ("layer_norm_fwd", "rms_norm_fwd", "scaled_softmax_fwd"):
        assert op_path(name) == "C++ kernel (cpu)", op_path(name)


def _same_rows(big, small) -> None:
    big = big if isinstance(big, (tuple, list)) else (big,)
    small = small if isinstance(small, (tuple, list)) else (small,)
    for b, s in zip(big, small, strict=True):
        if b.dim() and b.shape[0] > s.shape[0]:
            assert torch.equal(b[: s.shape[0]], s)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_norm_streamed_rows_match(compiled, dtype):
    for _ in range(3):  # some call gets a backed (streamed) output
        x = _big(dtype)
        dy = torch.randn_like(x)
        w = (torch.rand(COLS) + 0.5).to(dtype)
        b = torch.randn(COLS).to(dtype)
        k = 37
        ln = M.layer_norm_fwd(x, [COLS], w, b, 1e-5)
        _same_rows(ln, M.layer_norm_fwd(x[:k], [COLS], w, b, 1e-5))
        _same_rows(M.rms_norm_fwd(x, [COLS], w, 1e-5), M.rms_norm_fwd(x[:k], [COLS], w, 1e-5))
        mean, rstd = ln[1], ln[2]
        big = M.layer_norm_bwd(dy, x, mean, rstd, [COLS], w, b, False)[0]
        small = M.layer_norm_bwd(dy[:k], x[:k], mean[:k], rstd[:k], [COLS], w, b, False)[0]
        assert torch.equal(big[:k], small)
        big = M.rms_norm_bwd(dy, x, rstd, [COLS], w, False)[0]
        assert torch.equal(big[:k], M.rms_norm_bwd(dy[:k], x[:k], rstd[:k], [COLS], w, False)[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softmax_streamed_rows_match(compiled, dtype):
    for _ in range(3):  # some call gets a backed (streamed) output
        x = _big(dtype)
        dy = torch.randn_like(x)
        k = 37
        y = M.scaled_softmax_fwd(x, 0.3)
        assert torch.equal(y[:k], M.scaled_softmax_fwd(x[:k], 0.3))
        dx = M.scaled_softmax_bwd(dy, y, 0.3, False)
        assert torch.equal(dx[:k], M.scaled_softmax_bwd(dy[:k], y[:k], 0.3, False))
        batches = 5 if dtype == torch.float32 else 8  # > 16 MiB: causal zero tails streamed too
        c = torch.randn(batches, COLS, COLS).to(dtype)
        yc = M.scaled_upper_triang_masked_softmax_fwd(c, 0.3)
        assert torch.equal(yc[:1], M.scaled_upper_triang_masked_softmax_fwd(c[:1], 0.3))
        dc = torch.randn_like(c)
        dxc = M.scaled_softmax_bwd(dc, yc, 0.3, True)
        assert torch.equal(dxc[:1], M.scaled_softmax_bwd(dc[:1], yc[:1], 0.3, True))


@pytest.mark.parametrize("cols", [1024, 1029], ids=["aligned", "odd"])
def test_masked_softmax_streamed_rows_match(compiled, cols):
    for _ in range(3):  # some call gets a backed (streamed) output
        # The forward writes row r's output while it computes row r + 1 (two scratch rows per
        # thread); aligned rows interleave every block, odd ones mostly write after the row. Some
        # rows fully masked, some with every score below -10000 (the exact-max path) in between.
        g = torch.Generator().manual_seed(3)
        heads, sq = 4, 1025  # 4 * 1025 * 1024 fp32 = 16.8 MB: streamed
        x = torch.randn(1, heads, sq, cols, generator=g)
        x[:, :, 100:103] -= 30000.0
        mask = torch.rand(1, 1, sq, cols, generator=g) < 0.3
        mask[..., 200, :] = True
        y = M.scaled_masked_softmax_fwd(x, mask, 0.5)
        k = 300
        small = M.scaled_masked_softmax_fwd(x[:, :1, :k].contiguous(), mask[:, :, :k], 0.5)
        assert torch.equal(y[:, :1, :k], small)
        ref = torch.softmax((x.double() * 0.5).masked_fill(mask, -10000.0), -1)
        torch.testing.assert_close(y.double(), ref, rtol=4e-7, atol=1e-12)
        assert torch.equal(M.scaled_masked_softmax_fwd(x, mask, 0.5), y)  # run to run


@pytest.mark.parametrize("layout", ["sbhd", "bhsd"])
def test_rope_streamed_rows_match(compiled, layout):
    # [s, b, h, d] = (1100, 4, 8, 128) fp32: 18 MB; positions are independent, so the first
    # positions of a large output equal the same positions rotated alone
    g = torch.Generator().manual_seed(4)
    s, b, h, d = 1100, 4, 8, 128
    shape = {"sbhd": (s, b, h, d), "bhsd": (b, h, s, d)}[layout]
    t = torch.randn(shape, generator=g)
    f = torch.rand(s, d, generator=g) * 6
    cos, sin = f.cos(), f.sin()
    k = 37
    at = layout.index("s")
    first = t.narrow(at, 0, k).contiguous()
    small = M.rope(first, cos[:k], sin[:k], d, False, False, False, layout)
    for _ in range(3):  # some call gets a backed (streamed) output
        y = M.rope(t, cos, sin, d, False, False, False, layout)
        assert torch.equal(y.narrow(at, 0, k), small)
