"""The layer kernels' bf16 stores (RoPE, the norms, softmax) round exactly as torch's conversion.

Where the CPU has its own bf16 conversion the kernels use it for full blocks; it reads
subnormal fp32 values as zero, so the kernels convert a block holding one (or a NaN) as ATen
does. The results must keep their bits: the reference computes the same fp32 values and rounds
them with ``Tensor.to(torch.bfloat16)``, to nearest even, subnormals included.
"""

from __future__ import annotations

import pytest
import torch

from mpnb.core.ops.rotary import reference_rope

M = torch.ops.mpnb


def _same_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    g, w = got[~nan].view(torch.int16), want[~nan].view(torch.int16)
    assert torch.equal(g, w), f"{(g != w).sum()} of {g.numel()} values differ"


def test_rope_bf16_rounds_to_nearest_even_with_subnormals_and_nan(compiled):
    g = torch.Generator().manual_seed(0)
    s, b, h, d = 64, 2, 3, 64
    t = torch.randn(s, b, h, d, generator=g)
    t[: s // 2] *= 1e-30  # products near 1e-39: fp32 (and bf16) subnormals
    t = t.to(torch.bfloat16)
    t[5, 0, 0, 3] = float("nan")  # one block with a NaN, the others without
    t[6, 1, 2, 40] = float("inf")
    f = torch.rand(s, d, generator=g) * 6
    cos, sin = f.cos(), f.sin()
    cos[: s // 2] *= 1e-9
    sin[: s // 2] *= 1e-9
    for backward in (False, True):
        got = M.rope(t, cos, sin, d, False, backward, False, "sbhd")
        want = reference_rope(t, cos, sin, d, backward=backward)
        sub = want.float().abs()
        assert ((sub > 0) & (sub < torch.finfo(torch.float32).tiny)).sum() > 100  # covered
        _same_bits(got, want)


def test_norm_and_softmax_bf16_outputs_keep_their_bits(compiled):
    g = torch.Generator().manual_seed(1)
    rows, cols = 64, 1000  # a tail block per row
    x = torch.randn(rows, cols, generator=g).to(torch.bfloat16)
    w = torch.randn(cols, generator=g).to(torch.bfloat16)
    w[:50] = 1e-39  # subnormal weights: subnormal outputs
    y, mean, rstd = M.layer_norm_fwd(x, [cols], w, None, 1e-5, False)
    xf = x.float()
    want = ((xf - mean[:, None]) * rstd[:, None] * w.float()).to(torch.bfloat16)
    assert (want.float()[:, :50] != 0).any()
    _same_bits(y, want)
    # softmax computes the same fp32 values from bf16 and from fp32 input (one code path)
    for scale in (0.7, 20.0):  # 20: many probabilities far below 1, some exactly 0
        _same_bits(M.scaled_softmax_fwd(x, scale), M.scaled_softmax_fwd(xf, scale).bfloat16())


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
        _same_bits(M.scaled_softmax_fwd(x, scale), M.scaled_softmax_fwd(xf, scale).to(dtype))
        sq = x[:, :, :, :37].contiguous()
        _same_bits(
            M.scaled_upper_triang_masked_softmax_fwd(sq.view(-1, 37, 37), scale),
            M.scaled_upper_triang_masked_softmax_fwd(sq.float().view(-1, 37, 37), scale).to(dtype),
        )
        for zero_all in (False, True):
            _same_bits(
                M.scaled_masked_softmax_fwd(x, mask, scale, zero_all),
                M.scaled_masked_softmax_fwd(xf, mask, scale, zero_all).to(dtype),
            )


@pytest.mark.parametrize("rows", (64, 8192), ids=("cached", "streamed"))
@pytest.mark.parametrize("op", ("layer_norm", "rms_norm"))
def test_norm_bf16_rows_with_subnormals_or_nan_keep_their_bits(compiled, op, rows):
    """Rows whose outputs hold a subnormal or a NaN are written again with ATen's rounding.

    The kernels convert whole rows with the CPU's instruction and only note such lanes; a noted
    row is converted again. The fp32 kernels compute the same fp32 values from the same
    (widened) inputs, so rounding their outputs gives the bits the bf16 kernels must write.
    8192 rows of 1024 are 16 MiB: streamed outputs.
    """
    g = torch.Generator().manual_seed(2)
    cols = 1024
    x = torch.randn(rows, cols, generator=g).to(torch.bfloat16)
    dy = torch.randn(rows, cols, generator=g)
    dy[1::7] *= 1e-36  # these rows' grads (and so their dx) are fp32 subnormals
    dy = dy.to(torch.bfloat16)
    dy[3, 100] = float("nan")  # one row all NaN
    w = torch.randn(cols, generator=g).to(torch.bfloat16)
    w[::9] = 1e-39  # subnormal weights: subnormal outputs in every row of the forward
    x[5, 7] = float("nan")
    xf, dyf, wf = x.float(), dy.float(), w.float()
    if op == "layer_norm":
        b = torch.randn(cols, generator=g).to(torch.bfloat16)
        y, mean, rstd = M.layer_norm_fwd(x, [cols], w, None, 1e-5, False)
        yf, *_ = M.layer_norm_fwd(xf, [cols], wf, None, 1e-5, False)
        dx, *_ = M.layer_norm_bwd(dy, x, mean, rstd, [cols], w, b, False)
        dxf, *_ = M.layer_norm_bwd(dyf, xf, mean, rstd, [cols], wf, b.float(), False)
    else:
        y, rstd = M.rms_norm_fwd(x, [cols], w, 1e-5, False)
        yf, _ = M.rms_norm_fwd(xf, [cols], wf, 1e-5, False)
        dx, _ = M.rms_norm_bwd(dy, x, rstd, [cols], w, False)
        dxf, _ = M.rms_norm_bwd(dyf, xf, rstd, [cols], wf, False)
    sub = torch.finfo(torch.float32).tiny
    assert ((dxf.abs() < sub) & (dxf != 0))[1::7].any()  # the case the instruction gets wrong
    assert dx[3].isnan().all() and y[5].isnan().all()
    _same_bits(y, yf.to(torch.bfloat16))
    _same_bits(dx, dxf.to(torch.bfloat16))


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
    _same_bits(dx, dxf.to(torch.bfloat16))
