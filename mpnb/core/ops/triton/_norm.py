"""The Triton kernels behind ``layer_norm`` and ``rms_norm`` (one kernel, ``IS_RMS`` picks).

Statistics in fp32 (fp64 for fp64 data), half in and out, weights of the input's dtype or
fp32.

Forward: rows that fit in one block (``cols <= MAX_FUSED``) are read once, one row per
program or several for narrow rows (``_fwd_fused``, tuned over :data:`._tune.ROW_CONFIGS`);
longer rows get a program each and are walked in blocks (``_fwd_looped``, tuned over
:data:`._tune.LOOP_CONFIGS`; three reads for layer norm, two for RMS norm).

Backward, in two stages as Apex's ``cuda_layer_norm`` and Liger do. Stage one: ``nprog``
programs (:func:`bwd_layout`) each walk tiles of ``ROWS`` rows (tile ``t`` to program
``t % nprog``), write ``dx`` and keep their weight and bias gradients in fp32 registers, then
fold the ``ROWS`` partial rows pairwise and store one partial row each (``_bwd_fused``, rows up
to ``BWD_FUSED``; longer rows one row at a time in ``_bwd_looped``, the partial row kept in
memory). Stage two (``_colsum_kernel``) sums the ``nprog`` partial rows in program order.
Every step of the ``dw``/``db`` sums is an elementwise fp32 add in a fixed order, so the
result does not depend on the tuned config, the card or the run (no atomics); the layout
(``ROWS``, ``nprog``) comes from the shape alone and is therefore not tuned. Only the warps of
``_bwd_fused`` are (:data:`BWD_CONFIGS`)::

    num_warps=8 | num_warps=4 | num_warps=16

and the block of ``_bwd_looped`` (:data:`._tune.LOOP_CONFIGS`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mpnb.core.ops.triton._common import (
    acc_of,
    cdiv,
    div,
    from_acc,
    join64,
    launch,
    next_pow2,
    split64,
    sqrt,
)
from mpnb.core.ops.triton._common import to_acc as _to_acc
from mpnb.core.ops.triton._tune import LOOP_CONFIGS, ROW_CONFIGS, rows_per, tuned

__all__ = ["MAX_FUSED", "BWD_FUSED", "BWD_CONFIGS", "bwd_layout", "norm_fwd", "norm_bwd"]

MAX_FUSED = 8192  #: the longest row the forward holds in one block
BWD_FUSED = 8192  #: the longest row the backward holds in one block
BWD_TILE = 2048  #: elements of one backward tile (``ROWS`` rows of the padded width)
MAX_PROGS = 256  #: the most programs of the backward (rows of its partial-gradient buffer)
#: the backward's one-block kernel: only the warps are tuned (the layout fixes the sums' order)
BWD_CONFIGS = (
    triton.Config({}, num_warps=8),
    triton.Config({}, num_warps=4),
    triton.Config({}, num_warps=16),
)


@triton.jit
def _eps(hi, lo, ACC: tl.constexpr):
    if ACC == tl.float64:
        e = join64(hi, lo)
    else:
        e = tl.cast(hi, tl.float32)
    return e


@tuned(ROW_CONFIGS, key=["cols"])
@triton.jit
def _fwd_fused(
    input,
    y_ptr,
    weight,
    bias,
    mean_ptr,
    rstd_ptr,
    rows,
    cols,
    eps_hi,
    eps_lo,
    IS_RMS: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK: tl.constexpr,
    TILE: tl.constexpr,
):
    ROWS: tl.constexpr = (TILE + BLOCK - 1) // BLOCK  # rows_per(TILE, BLOCK)
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    c = tl.arange(0, BLOCK)
    cm = c < cols
    m2 = (r[:, None] < rows) & cm[None, :]
    offs = r[:, None].to(tl.int64) * cols + c[None, :]
    x = _to_acc(tl.load(input + offs, mask=m2, other=0.0), ACC)
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
    if HAS_WEIGHT:
        y = y * _to_acc(tl.load(weight + c, mask=cm, other=0.0), ACC)[None, :]
    if HAS_BIAS:
        y = y + _to_acc(tl.load(bias + c, mask=cm, other=0.0), ACC)[None, :]
    tl.store(y_ptr + offs, from_acc(y, y_ptr.dtype.element_ty), mask=m2)


@tuned(LOOP_CONFIGS, key=["cols"])
@triton.jit
def _fwd_looped(
    input,
    y_ptr,
    weight,
    bias,
    mean_ptr,
    rstd_ptr,
    rows,
    cols,
    eps_hi,
    eps_lo,
    IS_RMS: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = input + row * cols
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
        if HAS_WEIGHT:
            y = y * _to_acc(tl.load(weight + k + lanes, mask=m, other=0.0), ACC)
        if HAS_BIAS:
            y = y + _to_acc(tl.load(bias + k + lanes, mask=m, other=0.0), ACC)
        tl.store(y_ptr + row * cols + k + lanes, from_acc(y, y_ptr.dtype.element_ty), mask=m)


def norm_fwd(*, input, weight, bias, eps, rows, cols, is_rms: bool):
    """``(y, mean, rstd)`` of the rows of ``input`` (``mean`` unused by RMS norm); the
    arguments named as the ops' (``rows``, ``cols``: :func:`~mpnb.core.ops._norm.rows_cols`)."""
    acc = torch.float64 if input.dtype == torch.float64 else torch.float32
    x = input.contiguous()
    y = torch.empty_like(x)
    mean = torch.empty(rows, dtype=acc, device=x.device)
    rstd = torch.empty(rows, dtype=acc, device=x.device)
    if rows == 0 or cols == 0:
        return y, mean.fill_(float("nan")), rstd.fill_(float("nan"))
    eps_hi, eps_lo = split64(eps)
    kernel_args = dict(
        input=x,
        y_ptr=y,
        weight=x if weight is None else weight,
        bias=x if bias is None else bias,
        mean_ptr=mean,
        rstd_ptr=rstd,
        rows=rows,
        cols=cols,
        eps_hi=eps_hi,
        eps_lo=eps_lo,
        IS_RMS=is_rms,
        HAS_WEIGHT=weight is not None,
        HAS_BIAS=bias is not None,
        ACC=acc_of(acc),
    )
    if cols <= MAX_FUSED:  # TILE (and num_warps) are the autotuner's
        block = next_pow2(cols)

        def grid(meta):
            return (cdiv(rows, rows_per(meta["TILE"], block)),)

        launch(_fwd_fused, grid, BLOCK=block, **kernel_args)
    else:  # BLOCK (and num_warps) are the autotuner's
        launch(_fwd_looped, (rows,), **kernel_args)
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
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    # The normalized input: from the input and the statistics, or (memory_efficient) from the
    # output and the affine params, as Apex recomputes it.
    if ME:
        xh = s
        if HAS_BIAS:
            xh = xh - b
        if HAS_WEIGHT:
            xh = div(xh, w)
    else:
        if IS_RMS:
            xh = s * rstd
        else:
            xh = (s - mean) * rstd
    return xh


@triton.jit
def _dx(g, xh, c1, c2, rstd, IS_RMS: tl.constexpr):
    dx = g - xh * c1
    if not IS_RMS:
        dx = dx - c2
    return dx * rstd


@triton.jit
def _fold(acc, ROWS: tl.constexpr, FOLDS: tl.constexpr, BLOCK: tl.constexpr):
    # [ROWS, BLOCK] -> [BLOCK]: row i plus row i + half, halving until one row is left. Each
    # step adds exactly two values, so the result is the same whatever the layout (num_warps).
    for i in tl.static_range(FOLDS):
        acc = tl.sum(tl.reshape(acc, [2, ROWS >> (i + 1), BLOCK]), axis=0)
    return tl.reshape(acc, [BLOCK])


@tuned(BWD_CONFIGS, key=["cols"])
@triton.jit
def _bwd_fused(
    grad_out,
    saved,
    weight,
    bias,
    mean,
    invvar,
    dx_ptr,
    pw_ptr,
    pb_ptr,
    rows,
    cols,
    nprog,
    IS_RMS: tl.constexpr,
    MEMORY_EFFICIENT: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACC: tl.constexpr,
    ROWS: tl.constexpr,
    FOLDS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # Tiles of ROWS rows, tile t in program t % nprog; dw and db in [ROWS, BLOCK] registers.
    pid = tl.program_id(0)
    c = tl.arange(0, BLOCK)
    cm = c < cols
    n = tl.cast(cols, ACC)
    w = _to_acc(tl.load(weight + c, mask=cm, other=1.0), ACC)[None, :]
    b = _to_acc(tl.load(bias + c, mask=cm, other=0.0), ACC)[None, :]
    dw = tl.zeros([ROWS, BLOCK], ACC)
    db = tl.zeros([ROWS, BLOCK], ACC)
    for t in range(pid, tl.cdiv(rows, ROWS), nprog):
        r = t * ROWS + tl.arange(0, ROWS)
        rm = r < rows
        m = rm[:, None] & cm[None, :]
        offs = r.to(tl.int64)[:, None] * cols + c[None, :]
        rstd = tl.load(invvar + r, mask=rm, other=0.0)[:, None]
        mu = tl.zeros([ROWS, 1], ACC)
        if not IS_RMS:
            mu = tl.load(mean + r, mask=rm, other=0.0)[:, None]
        s = _to_acc(tl.load(saved + offs, mask=m, other=0.0), ACC)
        dy = _to_acc(tl.load(grad_out + offs, mask=m, other=0.0), ACC)
        xh = _xhat(s, mu, rstd, w, b, IS_RMS, MEMORY_EFFICIENT, HAS_WEIGHT, HAS_BIAS)
        g = dy
        if HAS_WEIGHT:
            g = dy * w
        c1 = div(tl.sum(tl.where(m, g * xh, 0.0), axis=1), n)[:, None]
        c2 = div(tl.sum(g, axis=1), n)[:, None]
        dx = _dx(g, xh, c1, c2, rstd, IS_RMS)
        tl.store(dx_ptr + offs, from_acc(dx, dx_ptr.dtype.element_ty), mask=m)
        dw += tl.where(m, dy * xh, 0.0)
        db += dy
    tl.store(pw_ptr + pid * cols + c, _fold(dw, ROWS, FOLDS, BLOCK), mask=cm)
    tl.store(pb_ptr + pid * cols + c, _fold(db, ROWS, FOLDS, BLOCK), mask=cm)


@tuned(LOOP_CONFIGS, key=["cols"])
@triton.jit
def _bwd_looped(
    grad_out,
    saved,
    weight,
    bias,
    mean,
    invvar,
    dx_ptr,
    pw_ptr,
    pb_ptr,
    rows,
    cols,
    nprog,
    IS_RMS: tl.constexpr,
    MEMORY_EFFICIENT: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # Rows longer than a block, row r in program r % nprog: two sweeps per row; this program's
    # partial weight and bias gradients accumulate in its own row of the partial buffers.
    pid = tl.program_id(0)
    lanes = tl.arange(0, BLOCK)
    n = tl.cast(cols, ACC)
    pw_row = pw_ptr + pid * cols
    pb_row = pb_ptr + pid * cols
    for k in range(0, cols, BLOCK):
        tl.store(pw_row + k + lanes, tl.zeros([BLOCK], ACC), mask=k + lanes < cols)
        tl.store(pb_row + k + lanes, tl.zeros([BLOCK], ACC), mask=k + lanes < cols)
    for row in range(pid, rows, nprog):
        base = tl.cast(row, tl.int64) * cols
        rstd = tl.load(invvar + row)
        mu = tl.full((), 0.0, ACC)
        if not IS_RMS:
            mu = tl.load(mean + row)
        c1 = tl.zeros([BLOCK], ACC)
        c2 = tl.zeros([BLOCK], ACC)
        for k in range(0, cols, BLOCK):
            m = k + lanes < cols
            s = _to_acc(tl.load(saved + base + k + lanes, mask=m, other=0.0), ACC)
            dy = _to_acc(tl.load(grad_out + base + k + lanes, mask=m, other=0.0), ACC)
            w = _to_acc(tl.load(weight + k + lanes, mask=m, other=1.0), ACC)
            b = _to_acc(tl.load(bias + k + lanes, mask=m, other=0.0), ACC)
            xh = _xhat(s, mu, rstd, w, b, IS_RMS, MEMORY_EFFICIENT, HAS_WEIGHT, HAS_BIAS)
            g = dy
            if HAS_WEIGHT:
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
            s = _to_acc(tl.load(saved + base + k + lanes, mask=m, other=0.0), ACC)
            dy = _to_acc(tl.load(grad_out + base + k + lanes, mask=m, other=0.0), ACC)
            w = _to_acc(tl.load(weight + k + lanes, mask=m, other=1.0), ACC)
            b = _to_acc(tl.load(bias + k + lanes, mask=m, other=0.0), ACC)
            xh = _xhat(s, mu, rstd, w, b, IS_RMS, MEMORY_EFFICIENT, HAS_WEIGHT, HAS_BIAS)
            g = dy
            if HAS_WEIGHT:
                g = dy * w
            dx = _dx(g, xh, mc1, mc2, rstd, IS_RMS)
            tl.store(dx_ptr + base + k + lanes, from_acc(dx, dx_ptr.dtype.element_ty), mask=m)


@triton.jit
def _colsum_kernel(p_ptr, out_ptr, nprog, cols, ACC: tl.constexpr, BLOCK: tl.constexpr):
    # Stage two: the partial rows summed in program order (deterministic).
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
            (cdiv(cols, 1024),),
            p_ptr=partial,
            out_ptr=out,
            nprog=nprog,
            cols=cols,
            ACC=acc,
            BLOCK=1024,
        )
    return out


def bwd_layout(rows: int, cols: int) -> tuple[int, int]:
    """``(rows_per_tile, nprog)`` of the backward: ``ROWS`` rows per tile (one tile of
    :data:`BWD_TILE` elements; one row per tile past :data:`BWD_FUSED`) and the programs,
    which are the rows of the partial-gradient buffers. It depends on the shape only, so the
    order of the weight and bias gradients' sums is the same on every run and card.

    Example::

        >>> bwd_layout(16384, 768)  # 2 rows of 1024 padded columns per tile, 256 programs
        (2, 256)
    """
    per = rows_per(BWD_TILE, next_pow2(cols)) if cols <= BWD_FUSED else 1
    return per, max(1, min(cdiv(rows, per), MAX_PROGS))


def norm_bwd(
    *, grad_out, saved, mean, invvar, weight, bias, memory_efficient: bool, rows, cols, is_rms: bool
):
    """``(dx, dw, db)``: ``dw``/``db`` empty tensors where there is no weight/bias; the
    arguments named as the ops' (``mean`` and ``bias`` None for RMS norm)."""
    acc = torch.float64 if saved.dtype == torch.float64 else torch.float32
    dy, saved = grad_out.contiguous(), saved.contiguous()
    dx = torch.empty_like(saved)
    per, nprog = bwd_layout(rows, cols)
    pw = torch.empty((nprog, cols), dtype=acc, device=saved.device)
    pb = torch.empty((nprog, cols), dtype=acc, device=saved.device)
    if rows and cols:
        kernel_args = dict(
            grad_out=dy,
            saved=saved,
            weight=saved if weight is None else weight,
            bias=saved if bias is None else bias,
            mean=invvar if mean is None else mean,
            invvar=invvar,
            dx_ptr=dx,
            pw_ptr=pw,
            pb_ptr=pb,
            rows=rows,
            cols=cols,
            nprog=nprog,
            IS_RMS=is_rms,
            MEMORY_EFFICIENT=bool(memory_efficient),
            HAS_WEIGHT=weight is not None,
            HAS_BIAS=bias is not None,
            ACC=acc_of(acc),
        )
        if cols <= BWD_FUSED:  # num_warps is the autotuner's; the layout is the shape's
            block = next_pow2(cols)
            launch(
                _bwd_fused,
                (nprog,),
                ROWS=per,
                FOLDS=per.bit_length() - 1,
                BLOCK=block,
                **kernel_args,
            )
        else:  # BLOCK (and num_warps) are the autotuner's
            launch(_bwd_looped, (nprog,), **kernel_args)
    else:
        pw.zero_()
        pb.zero_()
    dw = saved.new_empty(0) if weight is None else _colsum(pw, weight, acc_of(acc))
    db = saved.new_empty(0) if bias is None else _colsum(pb, bias, acc_of(acc))
    return dx, dw, db
