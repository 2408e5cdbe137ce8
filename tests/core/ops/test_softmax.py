"""The softmax ops (``mpnb/core/ops/softmax.py``) on the C++ kernels.

* The causal kernels' partial blocks: row i keeps its first i + 1 lanes and writes zeros after
  them, for every lane count of the block holding i (the lanes past it are chosen by a
  compare-and-blend on AVX2 and AVX-512, not ATen's switch on the count). Each causal row must
  give the bits the plain (non-causal) kernel gives on the row cut to its first i + 1 scores:
  the same blocks, the same sums, only the lanes chosen another way.
* The bf16 stores round exactly as torch's conversion: 16-bit rows find their max on the bits,
  and backward rows with a subnormal or NaN gradient keep ATen's rounding.
* Outputs of 16 MiB or more are written with streaming stores, with the bits of ordinary
  stores (rows are independent; each test runs its large calls three times so that some call
  gets memory that is already backed, the only memory the kernels stream into).
"""

from __future__ import annotations

import pytest
import torch

from tests.core.ops.conftest import COLS, big_rows, same_bits

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


def test_bf16_outputs_are_the_fp32_outputs_rounded(compiled):
    """Softmax computes the same fp32 values from bf16 and from fp32 input (one code path)."""
    g = torch.Generator().manual_seed(1)
    rows, cols = 64, 1000  # a tail block per row
    x = torch.randn(rows, cols, generator=g).to(torch.bfloat16)
    for scale in (0.7, 20.0):  # 20: many probabilities far below 1, some exactly 0
        same_bits(M.scaled_softmax_fwd(x, scale), M.scaled_softmax_fwd(x.float(), scale).bfloat16())


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=str)
def test_softmax_16bit_row_max_on_bits(compiled, dtype):
    # 16-bit rows find their max on the bits as int16 (softmax.cpp, row_max_bits): rows of
    # mixed signs, rows all negative (the max is then the smallest integer), a negative scale
    # (the max of -x), causal rows ending mid-block, a row holding -0.0 and +inf, a mask
    # shared by the heads. The values must be those of the fp32 row, whose max is a float max.
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 37, 100, generator=g).to(dtype)
    x[0, 0] = -(x[0, 0].abs() + 0.5)  # every row negative
    x[0, 0, 0] = torch.linspace(-120.0, -1.0, 100)[torch.randperm(100, generator=g)]  # wide
    x[0, 1, :, :] = -x[0, 1].abs()
    x[0, 1, :, 7] = -0.0  # the largest of negative rows
    x[1, 2, 3, 50] = float("inf")
    xf = x.float()
    assert (xf[0, 0] < 0).all() and (xf[0, 0, 0].max() - xf[0, 0, 0].min() > 100)  # covered
    mask = torch.rand(2, 1, 37, 100, generator=g) < 0.3
    for scale in (0.7, -1.3, 20.0):
        same_bits(M.scaled_softmax_fwd(x, scale), M.scaled_softmax_fwd(xf, scale).to(dtype))
        sq = x[:, :, :, :37].contiguous()
        same_bits(
            M.scaled_upper_triang_masked_softmax_fwd(sq.view(-1, 37, 37), scale),
            M.scaled_upper_triang_masked_softmax_fwd(sq.float().view(-1, 37, 37), scale).to(dtype),
        )
        for zero_all in (False, True):
            same_bits(
                M.scaled_masked_softmax_fwd(x, mask, scale, zero_all),
                M.scaled_masked_softmax_fwd(xf, mask, scale, zero_all).to(dtype),
            )


@pytest.mark.parametrize("causal", (False, True), ids=("plain", "causal"))
@pytest.mark.parametrize("heads", (2, 8), ids=("cached", "streamed"))
def test_softmax_bwd_bf16_rows_with_subnormals_or_nan_keep_their_bits(compiled, causal, heads):
    """The softmax backward's rows with a subnormal or NaN gradient keep ATen's rounding.

    As the norms' backward: the fp32 kernel computes the same fp32 values from the same widened
    inputs. 8 heads of 1024 x 1024 are 16 MiB: streamed outputs.
    """
    g = torch.Generator().manual_seed(3)
    sq = 1024
    x = torch.randn(heads, sq, sq, generator=g)
    fwd = M.scaled_upper_triang_masked_softmax_fwd if causal else M.scaled_softmax_fwd
    y = fwd(x.to(torch.bfloat16), 1.0)
    dy = torch.randn(heads, sq, sq, generator=g)
    dy[:, 1::5] *= 1e-33  # these rows' dx are fp32 subnormals
    dy = dy.to(torch.bfloat16)
    dy[0, 600, 3] = float("nan")
    dx = M.scaled_softmax_bwd(dy, y, 0.5, causal)
    dxf = M.scaled_softmax_bwd(dy.float(), y.float(), 0.5, causal)
    sub = torch.finfo(torch.float32).tiny
    assert ((dxf.abs() < sub) & (dxf != 0))[:, 1::5].any()  # the case the instruction gets wrong
    assert dx[0, 600, :601].isnan().all()
    same_bits(dx, dxf.to(torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softmax_streamed_rows_match(streamed, dtype):
    for _ in range(3):  # some call gets a backed (streamed) output
        x = big_rows(dtype)
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
def test_masked_softmax_streamed_rows_match(streamed, cols):
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
