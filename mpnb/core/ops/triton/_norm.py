"""The Triton kernels behind ``layer_norm`` and ``rms_norm`` (one kernel, ``IS_RMS`` picks).

Statistics in fp32 (fp64 for fp64 data), half in and out, weights of the input's dtype or
fp32. Rows that fit in one block (``cols <= MAX_FUSED``) are loaded once and several rows
share a program; longer rows are walked in blocks (two reads in the forward, three in the
backward). The backward's weight and bias gradients are summed per program into a partial
buffer and then over programs in a fixed order (deterministic, no atomics).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mpnb.core.ops.triton._common import (
    acc_of,
    div,
    from_acc,
    join64,
    launch,
    next_pow2,
    split64,
    sqrt,
    warps,
)
from mpnb.core.ops.triton._common import to_acc as _to_acc

__all__ = ["MAX_FUSED", "norm_fwd", "norm_bwd"]

MAX_FUSED = 8192  #: the longest row the forward holds in one block
BWD_FUSED = 4096  #: the longest row the backward holds in one block
_TILE = 4096  # elements per program in the one-block path (rows x cols)
_MAX_PROGS = 256  # programs of the backward (and rows of its partial-gradient buffer)


@triton.jit
def _eps(hi, lo, ACC: tl.constexpr):
    if ACC == tl.float64:
        e = join64(hi, lo)
    else:
        e = tl.cast(hi, tl.float32)
    return e


@triton.jit
def _fwd_fused(
    x_ptr,
    y_ptr,
    w_ptr,
    b_ptr,
    mean_ptr,
    rstd_ptr,
    rows,
    cols,
    eps_hi,
    eps_lo,
    IS_RMS: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
    ACC: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    c = tl.arange(0, BLOCK)
    cm = c < cols
    m2 = (r[:, None] < rows) & cm[None, :]
    offs = r[:, None].to(tl.int64) * cols + c[None, :]
    x = _to_acc(tl.load(x_ptr + offs, mask=m2, other=0.0), ACC)
    n = tl.cast(cols, ACC)
    if IS_RMS:
        xc = x
    else:
        mean = div(tl.sum(x, axis=1), n)
        xc = tl.where(m2, x - mean[:, None], 0.0)
        tl.store(mean_ptr + r, mean, mask=r < rows)
    var = div(tl.sum(xc * xc, axis=1), n)
    rstd = div(tl.full([ROWS], 1.0, ACC), sqrt(var + _eps(eps_hi, eps_lo, ACC)))
    tl.store(rstd_ptr + r, rstd, mask=r < rows)
    y = xc * rstd[:, None]
    if HAS_W:
        y = y * _to_acc(tl.load(w_ptr + c, mask=cm, other=0.0), ACC)[None, :]
    if HAS_B:
        y = y + _to_acc(tl.load(b_ptr + c, mask=cm, other=0.0), ACC)[None, :]
    tl.store(y_ptr + offs, from_acc(y, y_ptr.dtype.element_ty), mask=m2)


@triton.jit
def _fwd_looped(
    x_ptr,
    y_ptr,
    w_ptr,
    b_ptr,
    mean_ptr,
    rstd_ptr,
    rows,
    cols,
    eps_hi,
    eps_lo,
    IS_RMS: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * cols
    lanes = tl.arange(0, BLOCK)
    n = tl.cast(cols, ACC)
    mean = tl.full((), 0.0, ACC)
    if not IS_RMS:
        acc = tl.zeros([BLOCK], ACC)
        for k in range(0, cols, BLOCK):
            acc += _to_acc(tl.load(x_row + k + lanes, mask=k + lanes < cols, other=0.0), ACC)
        mean = div(tl.sum(acc, axis=0), n)
        tl.store(mean_ptr + row, mean)
    acc = tl.zeros([BLOCK], ACC)
    for k in range(0, cols, BLOCK):
        m = k + lanes < cols
        xc = tl.where(m, _to_acc(tl.load(x_row + k + lanes, mask=m, other=0.0), ACC) - mean, 0.0)
        acc += xc * xc
    var = div(tl.sum(acc, axis=0), n)
    rstd = div(tl.full((), 1.0, ACC), sqrt(var + _eps(eps_hi, eps_lo, ACC)))
    tl.store(rstd_ptr + row, rstd)
    for k in range(0, cols, BLOCK):
        m = k + lanes < cols
        y = (_to_acc(tl.load(x_row + k + lanes, mask=m, other=0.0), ACC) - mean) * rstd
        if HAS_W:
            y = y * _to_acc(tl.load(w_ptr + k + lanes, mask=m, other=0.0), ACC)
        if HAS_B:
            y = y + _to_acc(tl.load(b_ptr + k + lanes, mask=m, other=0.0), ACC)
        tl.store(y_ptr + row * cols + k + lanes, from_acc(y, y_ptr.dtype.element_ty), mask=m)


def norm_fwd(x, weight, bias, eps, rows, cols, is_rms: bool):
    """``(y, mean, rstd)`` of the rows of ``x`` (``mean`` unused by RMS norm)."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    x = x.contiguous()
    y = torch.empty_like(x)
    mean = torch.empty(rows, dtype=acc, device=x.device)
    rstd = torch.empty(rows, dtype=acc, device=x.device)
    if rows == 0 or cols == 0:
        return y, mean.fill_(float("nan")), rstd.fill_(float("nan"))
    common = dict(IS_RMS=is_rms, HAS_W=weight is not None, HAS_B=bias is not None, ACC=acc_of(acc))
    args = (x, y, weight if weight is not None else x, bias if bias is not None else x, mean, rstd)
    args += (rows, cols, *split64(eps))
    if cols <= MAX_FUSED:
        block = next_pow2(cols)
        nrows = max(1, _TILE // block)
        launch(
            _fwd_fused,
            (triton.cdiv(rows, nrows),),
            *args,
            ROWS=nrows,
            BLOCK=block,
            num_warps=warps(nrows * block),
            **common,
        )
    else:
        launch(_fwd_looped, (rows,), *args, BLOCK=1024, **common)
    return y, mean, rstd


@triton.jit
def _xhat(
    s,
    mean,
    rstd,
    w,
    b,
    IS_RMS: tl.constexpr,
    ME: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
):
    # The normalized input: from the input and the statistics, or (memory_efficient) from the
    # output and the affine params, as Apex recomputes it.
    if ME:
        xh = s
        if HAS_B:
            xh = xh - b
        if HAS_W:
            xh = div(xh, w)
    else:
        if IS_RMS:
            xh = s * rstd
        else:
            xh = (s - mean) * rstd
    return xh


@triton.jit
def _row_grads(
    s,
    dy,
    w,
    b,
    mean,
    rstd,
    m,
    n,
    IS_RMS: tl.constexpr,
    ME: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
):
    # (xhat, g = dy * w, sum(g * xhat) / n, sum(g) / n) of one row held in one block.
    xh = _xhat(s, mean, rstd, w, b, IS_RMS, ME, HAS_W, HAS_B)
    g = dy
    if HAS_W:
        g = dy * w
    c1 = div(tl.sum(tl.where(m, g * xh, 0.0), axis=0), n)
    c2 = div(tl.sum(g, axis=0), n)
    return xh, g, c1, c2


@triton.jit
def _dx(g, xh, c1, c2, rstd, IS_RMS: tl.constexpr):
    dx = g - xh * c1
    if not IS_RMS:
        dx = dx - c2
    return dx * rstd


@triton.jit
def _bwd_fused(
    dy_ptr,
    s_ptr,
    w_ptr,
    b_ptr,
    mean_ptr,
    rstd_ptr,
    dx_ptr,
    pw_ptr,
    pb_ptr,
    rows,
    cols,
    per_prog,
    IS_RMS: tl.constexpr,
    ME: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    c = tl.arange(0, BLOCK)
    m = c < cols
    n = tl.cast(cols, ACC)
    w = _to_acc(tl.load(w_ptr + c, mask=m, other=1.0), ACC)
    b = _to_acc(tl.load(b_ptr + c, mask=m, other=0.0), ACC)
    dw = tl.zeros([BLOCK], ACC)
    db = tl.zeros([BLOCK], ACC)
    for row in range(pid * per_prog, tl.minimum(pid * per_prog + per_prog, rows)):
        base = tl.cast(row, tl.int64) * cols
        rstd = tl.load(rstd_ptr + row)
        mean = tl.full((), 0.0, ACC)
        if not IS_RMS:
            mean = tl.load(mean_ptr + row)
        s = _to_acc(tl.load(s_ptr + base + c, mask=m, other=0.0), ACC)
        dy = _to_acc(tl.load(dy_ptr + base + c, mask=m, other=0.0), ACC)
        xh, g, c1, c2 = _row_grads(s, dy, w, b, mean, rstd, m, n, IS_RMS, ME, HAS_W, HAS_B)
        dx = _dx(g, xh, c1, c2, rstd, IS_RMS)
        tl.store(dx_ptr + base + c, from_acc(dx, dx_ptr.dtype.element_ty), mask=m)
        dw += tl.where(m, dy * xh, 0.0)
        db += dy
    tl.store(pw_ptr + pid * cols + c, dw, mask=m)
    tl.store(pb_ptr + pid * cols + c, db, mask=m)


@triton.jit
def _bwd_looped(
    dy_ptr,
    s_ptr,
    w_ptr,
    b_ptr,
    mean_ptr,
    rstd_ptr,
    dx_ptr,
    pw_ptr,
    pb_ptr,
    rows,
    cols,
    per_prog,
    IS_RMS: tl.constexpr,
    ME: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # Rows longer than a block: two sweeps per row; this program's partial weight and bias
    # gradients accumulate in its own row of the partial buffers.
    pid = tl.program_id(0)
    lanes = tl.arange(0, BLOCK)
    n = tl.cast(cols, ACC)
    pw_row = pw_ptr + pid * cols
    pb_row = pb_ptr + pid * cols
    for k in range(0, cols, BLOCK):
        tl.store(pw_row + k + lanes, tl.zeros([BLOCK], ACC), mask=k + lanes < cols)
        tl.store(pb_row + k + lanes, tl.zeros([BLOCK], ACC), mask=k + lanes < cols)
    for row in range(pid * per_prog, tl.minimum(pid * per_prog + per_prog, rows)):
        base = tl.cast(row, tl.int64) * cols
        rstd = tl.load(rstd_ptr + row)
        mean = tl.full((), 0.0, ACC)
        if not IS_RMS:
            mean = tl.load(mean_ptr + row)
        c1 = tl.zeros([BLOCK], ACC)
        c2 = tl.zeros([BLOCK], ACC)
        for k in range(0, cols, BLOCK):
            m = k + lanes < cols
            s = _to_acc(tl.load(s_ptr + base + k + lanes, mask=m, other=0.0), ACC)
            dy = _to_acc(tl.load(dy_ptr + base + k + lanes, mask=m, other=0.0), ACC)
            w = _to_acc(tl.load(w_ptr + k + lanes, mask=m, other=1.0), ACC)
            b = _to_acc(tl.load(b_ptr + k + lanes, mask=m, other=0.0), ACC)
            xh = _xhat(s, mean, rstd, w, b, IS_RMS, ME, HAS_W, HAS_B)
            g = dy
            if HAS_W:
                g = dy * w
            c1 += tl.where(m, g * xh, 0.0)
            c2 += g
            dw = tl.load(pw_row + k + lanes, mask=m, other=0.0) + tl.where(m, dy * xh, 0.0)
            tl.store(pw_row + k + lanes, dw, mask=m)
            tl.store(
                pb_row + k + lanes, tl.load(pb_row + k + lanes, mask=m, other=0.0) + dy, mask=m
            )
        mc1 = div(tl.sum(c1, axis=0), n)
        mc2 = div(tl.sum(c2, axis=0), n)
        for k in range(0, cols, BLOCK):
            m = k + lanes < cols
            s = _to_acc(tl.load(s_ptr + base + k + lanes, mask=m, other=0.0), ACC)
            dy = _to_acc(tl.load(dy_ptr + base + k + lanes, mask=m, other=0.0), ACC)
            w = _to_acc(tl.load(w_ptr + k + lanes, mask=m, other=1.0), ACC)
            b = _to_acc(tl.load(b_ptr + k + lanes, mask=m, other=0.0), ACC)
            xh = _xhat(s, mean, rstd, w, b, IS_RMS, ME, HAS_W, HAS_B)
            g = dy
            if HAS_W:
                g = dy * w
            dx = _dx(g, xh, mc1, mc2, rstd, IS_RMS)
            tl.store(dx_ptr + base + k + lanes, from_acc(dx, dx_ptr.dtype.element_ty), mask=m)


@triton.jit
def _colsum_kernel(p_ptr, out_ptr, nprog, cols, ACC: tl.constexpr, BLOCK: tl.constexpr):
    c = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = c < cols
    acc = tl.zeros([BLOCK], ACC)
    for i in range(0, nprog):
        acc += tl.load(p_ptr + i * cols + c, mask=m, other=0.0)
    tl.store(out_ptr + c, from_acc(acc, out_ptr.dtype.element_ty), mask=m)


def _colsum(partial: torch.Tensor, like: torch.Tensor, acc) -> torch.Tensor:
    nprog, cols = partial.shape
    out = torch.empty_like(like, memory_format=torch.contiguous_format)
    if cols:
        launch(
            _colsum_kernel,
            (triton.cdiv(cols, 1024),),
            partial,
            out,
            nprog,
            cols,
            ACC=acc,
            BLOCK=1024,
        )
    return out


def norm_bwd(dy, saved, mean, rstd, weight, bias, me: bool, rows, cols, is_rms: bool):
    """``(dx, dw, db)``: ``dw``/``db`` empty tensors where there is no weight/bias."""
    acc = torch.float64 if saved.dtype == torch.float64 else torch.float32
    dy, saved = dy.contiguous(), saved.contiguous()
    dx = torch.empty_like(saved)
    nprog = max(1, min(rows, _MAX_PROGS))
    pw = torch.empty((nprog, cols), dtype=acc, device=saved.device)
    pb = torch.empty((nprog, cols), dtype=acc, device=saved.device)
    if rows and cols:
        per = triton.cdiv(rows, nprog)
        w = weight if weight is not None else saved
        b = bias if bias is not None else saved
        fused = cols <= BWD_FUSED
        launch(
            _bwd_fused if fused else _bwd_looped,
            (nprog,),
            dy,
            saved,
            w,
            b,
            mean if mean is not None else rstd,
            rstd,
            dx,
            pw,
            pb,
            rows,
            cols,
            per,
            IS_RMS=is_rms,
            ME=bool(me),
            HAS_W=weight is not None,
            HAS_B=bias is not None,
            ACC=acc_of(acc),
            BLOCK=next_pow2(cols) if fused else 1024,
            num_warps=warps(next_pow2(cols) if fused else 1024),
        )
    else:
        pw.zero_()
        pb.zero_()
    dw = saved.new_empty(0) if weight is None else _colsum(pw, weight, acc_of(acc))
    db = saved.new_empty(0) if bias is None else _colsum(pb, bias, acc_of(acc))
    return dx, dw, db
