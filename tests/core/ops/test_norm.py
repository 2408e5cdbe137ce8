"""What the two norm families share (``mpnb/core/ops/_norm.py`` and ``csrc/cpu/norm_common.h``),
on LayerNorm and RMSNorm alike.

The backward without a weight or bias gives the bits of ones and zeros.

The C++ backward (``csrc/cpu/norm_common.h``) has no branch on what a call passes: a missing
weight is read as ones, a missing bias (``memory_efficient``) as zeros, and the weight/bias
gradients a call does not return are summed into scratch rows. These tests hold it to the
promise that this changes nothing: every output equals, bit for bit, the call that passes the
ones and zeros itself, on narrow rows (one at a time) and wide rows (the grouped write pass),
at 1 and 2 threads.

The bf16 stores: rows whose outputs hold a subnormal or a NaN keep ATen's rounding. Outputs of
16 MiB or more are written with streaming stores, with the bits of ordinary stores: rows are
independent, so the first rows of a large (streamed) output must equal, bit for bit, the same
rows computed alone; an odd row length makes most rows start unaligned (the head / tail blocks
around the streamed body). The kernels stream only into memory that is already backed (a fresh
buffer from mmap gets ordinary stores), so the test runs its large calls three times: the
allocator hands a later call memory an earlier one freed.
"""

from __future__ import annotations

import pytest
import torch

from tests.core.ops.conftest import COLS, big_rows, same_bits

M = torch.ops.mpnb

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
SHAPES = [(37, 1000), (9, 4096)]  # narrow and wide rows; 9 rows: groups of four and a tail


@pytest.fixture(params=["auto", "1", "4"])
def rows_per_pass(request, monkeypatch):
    """The backward's rows per write pass: the kernel's own rule, or one of the two passes
    forced (``MPNB_CPU_NORM_BWD_ROWS``), so that both run on any CPU."""
    if request.param == "auto":
        monkeypatch.delenv("MPNB_CPU_NORM_BWD_ROWS", raising=False)
    else:
        monkeypatch.setenv("MPNB_CPU_NORM_BWD_ROWS", request.param)
    return request.param


@pytest.fixture(params=[1, 2])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def _data(dtype, rows, cols):
    g = torch.Generator().manual_seed(rows * cols)
    x = (torch.randn(rows, cols, generator=g) * 3 + 1).to(dtype)
    dy = torch.randn(rows, cols, generator=g).to(dtype)
    return x, dy


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def _cases(test):
    """Every dtype and shape, with and without ``memory_efficient``."""
    for mark in (
        pytest.mark.parametrize("dtype", DTYPES),
        pytest.mark.parametrize("shape", SHAPES),
        pytest.mark.parametrize("memory_efficient", [False, True]),
    ):
        test = mark(test)
    return test


def _same(got, want):
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert torch.equal(_bits(g), _bits(w))


@_cases
def test_layer_norm_backward_without_weight_or_bias_is_that_of_ones_and_zeros(
    compiled, rows_per_pass, threads, dtype, shape, memory_efficient
):
    rows, cols = shape
    x, dy = _data(dtype, rows, cols)
    ones, zeros = torch.ones(cols, dtype=dtype), torch.zeros(cols, dtype=dtype)
    y, mean, rstd = M.layer_norm_fwd(x, [cols], None, None, 1e-5)
    s = y if memory_efficient else x
    dx, dw, db = M.layer_norm_bwd(dy, s, mean, rstd, [cols], None, None, memory_efficient)
    assert dw.numel() == 0 and db.numel() == 0
    dx1, _, db1 = M.layer_norm_bwd(dy, s, mean, rstd, [cols], ones, zeros, memory_efficient)
    _same([dx], [dx1])
    # a weight without a bias: db is not returned, dw is that of the call with both
    w = torch.rand(cols, generator=torch.Generator().manual_seed(1)).to(dtype) + 0.5
    yw, mw, rw = M.layer_norm_fwd(x, [cols], w, None, 1e-5)
    sw = yw if memory_efficient else x
    got = M.layer_norm_bwd(dy, sw, mw, rw, [cols], w, None, memory_efficient)
    want = M.layer_norm_bwd(dy, sw, mw, rw, [cols], w, zeros, memory_efficient)
    assert got[2].numel() == 0
    _same(got[:2], want[:2])
    # a bias without a weight: dw is not returned, db is that of the call with both
    yb, mb, rb = M.layer_norm_fwd(x, [cols], None, zeros + 0.25, 1e-5)
    sb = yb if memory_efficient else x
    got = M.layer_norm_bwd(dy, sb, mb, rb, [cols], None, zeros + 0.25, memory_efficient)
    want = M.layer_norm_bwd(dy, sb, mb, rb, [cols], ones, zeros + 0.25, memory_efficient)
    assert got[1].numel() == 0
    _same([got[0], got[2]], [want[0], want[2]])
    _same([db1], [want[2]])  # db is the column sum of dy, whatever the bias


@_cases
def test_rms_norm_backward_without_weight_is_that_of_ones(
    compiled, rows_per_pass, threads, dtype, shape, memory_efficient
):
    rows, cols = shape
    x, dy = _data(dtype, rows, cols)
    y, rstd = M.rms_norm_fwd(x, [cols], None, 1e-5)
    s = y if memory_efficient else x
    dx, dw = M.rms_norm_bwd(dy, s, rstd, [cols], None, memory_efficient)
    assert dw.numel() == 0
    dx1, _ = M.rms_norm_bwd(dy, s, rstd, [cols], torch.ones(cols, dtype=dtype), memory_efficient)
    _same([dx], [dx1])


def _signed_zero_rows(dtype, rows, cols):
    # rows of +-1.5 around an exact mean of 0, a quarter of them exactly 0: x - mean is +0
    # there, and the weight's sign alone decides the sign of the zero written
    g = torch.Generator().manual_seed(cols)
    x = torch.where(torch.rand(rows, cols, generator=g) < 0.5, -1.5, 1.5)
    x[:, : cols // 2] = x[:, cols // 2 :].neg()  # each row sums to exactly 0
    x[:, ::4] = 0.0
    x[:, cols // 2 :: 4] = 0.0
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("layer", ["layer", "rms"])
def test_forward_without_bias_writes_the_product_and_its_signed_zeros(
    compiled, threads, dtype, shape, layer
):
    rows, cols = shape
    x = _signed_zero_rows(dtype, rows, cols)
    w = torch.linspace(-2, 2, cols).to(dtype)  # negative and positive weights
    for weight in (w, None):
        if layer == "layer":
            y, mean, rstd = M.layer_norm_fwd(x, [cols], weight, None, 1e-5)
            a = (x.float() - mean[:, None]) * rstd[:, None]
        else:
            y, rstd = M.rms_norm_fwd(x, [cols], weight, 1e-5)
            a = x.float() * rstd[:, None]
        want = (a if weight is None else a * weight.float()).to(dtype)
        _same([y], [want])
        zero = want == 0
        assert zero.any() and (want[zero].view(-1).view(torch.uint8) != 0).any() == (
            weight is not None
        )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(37, 1000), (9, 4096), (6, 2048), (3, 64)])
@pytest.mark.parametrize("memory_efficient", [False, True])
def test_backward_rows_four_at_a_time_give_the_bits_of_one_at_a_time(
    compiled, threads, monkeypatch, dtype, shape, memory_efficient
):
    # the grouped write pass adds the weight/bias partials in row order, as one row at a time
    rows, cols = shape
    x, dy = _data(dtype, rows, cols)
    g = torch.Generator().manual_seed(2)
    w = (torch.rand(cols, generator=g) + 0.5).to(dtype)
    b = torch.randn(cols, generator=g).to(dtype)
    y, mean, rstd = M.layer_norm_fwd(x, [cols], w, b, 1e-5)
    yr, rr = M.rms_norm_fwd(x, [cols], w, 1e-5)
    s, sr = (y, yr) if memory_efficient else (x, x)
    out = {}
    for n in ("1", "4"):
        monkeypatch.setenv("MPNB_CPU_NORM_BWD_ROWS", n)
        out[n] = [
            *M.layer_norm_bwd(dy, s, mean, rstd, [cols], w, b, memory_efficient),
            *M.rms_norm_bwd(dy, sr, rr, [cols], w, memory_efficient),
        ]
    _same(out["4"], out["1"])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("params", ["none", "input", "fp32"])
@pytest.mark.parametrize("shape", [(37, 1000), (9, 4096), (4, 7)])
def test_torch_stats_rounds_fp16_statistics_as_torch_stores_them(
    compiled, threads, dtype, params, shape
):
    # torch_stats: an fp16 input with fp16 or no parameters gets its fp32 statistics rounded
    # to nearest even fp16 (PyTorch's CPU store), the output untouched; all else is unchanged
    rows, cols = shape
    if params == "fp32" and dtype not in (torch.float16, torch.bfloat16):
        pytest.skip("fp32 parameters go with a half input only (the mixed layers)")
    x, _ = _data(dtype, rows, cols)
    g = torch.Generator().manual_seed(3)
    pdt = {"none": None, "input": dtype, "fp32": torch.float32}[params]
    w = None if pdt is None else (torch.rand(cols, generator=g) + 0.5).to(pdt)
    b = None if pdt is None else torch.randn(cols, generator=g).to(pdt)
    y, mean, rstd = M.layer_norm_fwd(x, [cols], w, b, 1e-5, False, False)
    yt, mt, rt = M.layer_norm_fwd(x, [cols], w, b, 1e-5, False, True)
    rounds = dtype == torch.float16 and params != "fp32"
    want = [t.half().float() for t in (mean, rstd)] if rounds else [mean, rstd]
    _same([yt, mt, rt], [y, *want])
    if rounds:
        assert not torch.equal(rstd, rt)  # the case rounds something


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
    same_bits(y, yf.to(torch.bfloat16))
    same_bits(dx, dxf.to(torch.bfloat16))


def _same_rows(big, small) -> None:
    big = big if isinstance(big, (tuple, list)) else (big,)
    small = small if isinstance(small, (tuple, list)) else (small,)
    for b, s in zip(big, small, strict=True):
        if b.dim() and b.shape[0] > s.shape[0]:
            assert torch.equal(b[: s.shape[0]], s)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_norm_streamed_rows_match(streamed, dtype):
    for _ in range(3):  # some call gets a backed (streamed) output
        x = big_rows(dtype)
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
