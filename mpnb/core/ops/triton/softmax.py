"""Apex's fused scaled (masked, causal) softmax in Triton, forward and backward.

Softmax over the last dim computed in fp32 (fp64 for fp64 input), output in the input dtype.
Masked scores become -10000 after scaling (Apex/Megatron: a fully masked row is uniform, or
zero with ``zero_all_masked``, Apex's generic kernel);
the causal variant excludes the columns after the diagonal (their probability is exactly 0).
The backward, ``scale * y * (dy - sum(dy * y))``, serves every forward.

Rows that fit in one block (``k <= MAX_FUSED``) are read once and held in registers, one row
per program or several for narrow rows (``_fwd_fused``, ``_bwd_fused``, tuned over
:data:`._tune.ROW_CONFIGS`). Longer rows get a program each and are walked in blocks
(``_fwd_looped``, ``_bwd_looped``, tuned over :data:`._tune.LOOP_CONFIGS`): the forward keeps a
running maximum and a sum rescaled to it per lane (online softmax), so it reads the scores
twice (statistics, then output) instead of three times; the backward reads twice.
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
    to_acc,
)
from mpnb.core.ops.triton._tune import LOOP_CONFIGS, ROW_CONFIGS, rows_per, tuned

__all__ = [
    "scaled_softmax_fwd",
    "scaled_masked_softmax_fwd",
    "scaled_upper_triang_masked_softmax_fwd",
    "scaled_softmax_bwd",
]

MASKED_VALUE = -10000.0
_MASKED = tl.constexpr(MASKED_VALUE)  # what a kernel may read of a module constant
MAX_FUSED = 8192  #: the longest row held in one block

# MODE of the forward kernels: odd modes read a mask; _MASK_ZERO (Apex's generic kernel) also
# zeroes the rows whose every position is masked.
_NONE, _MASK, _CAUSAL, _MASK_ZERO = 0, 1, 2, 3


@triton.jit
def _scale(hi, lo, ACC: tl.constexpr):
    if ACC == tl.float64:
        s = join64(hi, lo)
    else:
        s = tl.cast(hi, tl.float32)
    return s


@triton.jit
def _scores(x_ptr, m_ptr, row, mrow, cols, lim, s, MODE: tl.constexpr, ACC: tl.constexpr):
    """Scaled scores of columns ``cols < lim`` (masked: -10000), -inf for the others."""
    inside = cols < lim
    x = to_acc(tl.load(x_ptr + row + cols, mask=inside, other=0.0), ACC) * s
    if MODE % 2 == 1:
        masked = tl.load(m_ptr + mrow + cols, mask=inside, other=0) != 0
        x = tl.where(masked, _MASKED, x)
    return tl.where(inside, x, float("-inf")), inside


@triton.jit
def _unmasked(m_ptr, mrow, cols, lim):
    """How many columns ``cols < lim`` of a mask row are not masked (along the last axis)."""
    masked = tl.load(m_ptr + mrow + cols, mask=cols < lim, other=1) != 0
    return tl.sum(tl.where(masked, 0, 1), axis=-1)


@triton.jit
def _limit(r, k, SQ, MODE: tl.constexpr):
    # Columns a row keeps: all k, or 0..i for row i of a causal block.
    lim = tl.zeros_like(r) + k
    if MODE == 2:
        lim = tl.minimum(lim, r % SQ + 1)
    return lim


@tuned(ROW_CONFIGS, key=["k"])
@triton.jit
def _fwd_fused(
    input,
    y_ptr,
    mask,
    rows,
    k,
    SQ,
    H,
    msb,
    msh,
    msq,
    scale_hi,
    scale_lo,
    MODE: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK: tl.constexpr,
    TILE: tl.constexpr,
):
    ROWS: tl.constexpr = (TILE + BLOCK - 1) // BLOCK  # rows_per(TILE, BLOCK)
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    rvalid = r < rows
    lim = tl.where(rvalid, _limit(r, k, SQ, MODE), 0)
    cols = tl.arange(0, BLOCK)[None, :]
    row = r[:, None] * k
    mrow = (r // (SQ * H) * msb + r // SQ % H * msh + r % SQ * msq)[:, None]
    s = _scale(scale_hi, scale_lo, ACC)
    x, inside = _scores(input, mask, row, mrow, cols, lim[:, None], s, MODE, ACC)
    x = tl.where(rvalid[:, None], x, 0.0)
    e = tl.where(inside, tl.exp(x - tl.max(x, axis=1)[:, None]), 0.0)
    y = div(e, tl.sum(e, axis=1)[:, None])
    if MODE == 3:  # a row that sees nothing attends to nothing
        y = tl.where((_unmasked(mask, mrow, cols, lim[:, None]) > 0)[:, None], y, 0.0)
    out = cols < tl.where(rvalid, k, 0)[:, None]
    tl.store(y_ptr + row + cols, from_acc(y, y_ptr.dtype.element_ty), mask=out)


@tuned(LOOP_CONFIGS, key=["k"])
@triton.jit
def _fwd_looped(
    input,
    y_ptr,
    mask,
    rows,
    k,
    SQ,
    H,
    msb,
    msh,
    msq,
    scale_hi,
    scale_lo,
    MODE: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    lim = _limit(r, k, SQ, MODE)
    row = r * k
    mrow = r // (SQ * H) * msb + r // SQ % H * msh + r % SQ * msq
    s = _scale(scale_hi, scale_lo, ACC)
    lanes = tl.arange(0, BLOCK)
    # One sweep for the statistics: per lane, the largest score seen and the sum of exp(score -
    # that maximum), rescaled whenever the maximum grows (a lane that has seen only -inf keeps
    # a zero sum: exp(-inf - -inf) would be NaN).
    mx = tl.full([BLOCK], float("-inf"), ACC)
    acc = tl.zeros([BLOCK], ACC)
    seen = tl.sum(tl.zeros([BLOCK], tl.int32), axis=0)  # unmasked columns (MODE 3)
    for j in range(0, k, BLOCK):
        x, inside = _scores(input, mask, row, mrow, j + lanes, lim, s, MODE, ACC)
        top = tl.maximum(mx, x)
        live = top > float("-inf")
        acc = tl.where(live, acc * tl.exp(mx - top) + tl.where(inside, tl.exp(x - top), 0.0), 0.0)
        mx = top
        if MODE == 3:
            seen += _unmasked(mask, mrow, j + lanes, lim)
    top = tl.max(mx, axis=0)
    total = tl.sum(tl.where(mx > float("-inf"), acc * tl.exp(mx - top), 0.0), axis=0)
    for j in range(0, k, BLOCK):
        x, inside = _scores(input, mask, row, mrow, j + lanes, lim, s, MODE, ACC)
        y = div(tl.where(inside, tl.exp(x - top), 0.0), total)
        if MODE == 3:  # a row that sees nothing attends to nothing
            y = tl.where(seen > 0, y, 0.0)
        tl.store(y_ptr + row + j + lanes, from_acc(y, y_ptr.dtype.element_ty), mask=j + lanes < k)


def _forward(x: torch.Tensor, mask: torch.Tensor | None, scale: float, mode: int) -> torch.Tensor:
    x = x.contiguous()
    y = torch.empty_like(x)
    k = x.shape[-1] if x.dim() else 1
    rows = x.numel() // k if k else 0
    if rows == 0:
        return y
    sq = x.shape[-2] if mode != _NONE else 1
    h = x.shape[1] if mode in (_MASK, _MASK_ZERO) else 1
    if mask is not None:
        b, hh = x.shape[:2]
        m = mask.expand(b, hh, sq, k)
        if m.stride(-1) != 1:
            m = m.contiguous()
        m = m.view(torch.uint8) if m.dtype == torch.bool else m
        msb, msh, msq = m.stride(0), m.stride(1), m.stride(2)
    else:
        m, msb, msh, msq = x, 0, 0, 0
    scale_hi, scale_lo = split64(scale)
    kernel_args = dict(
        input=x,
        y_ptr=y,
        mask=m,
        rows=rows,
        k=k,
        SQ=sq,
        H=h,
        msb=msb,
        msh=msh,
        msq=msq,
        scale_hi=scale_hi,
        scale_lo=scale_lo,
        MODE=mode,
        ACC=acc_of(x.dtype),
    )
    _launch_rows(_fwd_fused, _fwd_looped, rows, k, kernel_args)
    return y


def _launch_rows(fused, looped, rows: int, k: int, kernel_args: dict) -> None:
    """Rows of ``k <= MAX_FUSED`` columns to the one-block kernel ``fused`` (its ``TILE`` and
    warps tuned), longer rows to ``looped``, one program per row (its ``BLOCK`` and warps
    tuned): the tuned meta-parameters are the autotuner's, never passed here."""
    if k <= MAX_FUSED:
        launch(fused, _row_grid(rows, k), BLOCK=next_pow2(k), **kernel_args)
    else:
        launch(looped, (rows,), **kernel_args)


def _row_grid(rows: int, k: int):
    """The grid of a one-block kernel: as many programs as its tuned tile needs."""
    block = next_pow2(k)

    def grid(meta):
        return (cdiv(rows, rows_per(meta["TILE"], block)),)

    return grid


def scaled_softmax_fwd(args) -> torch.Tensor:
    """``softmax(input * scale)`` over the last dim: the semantics of
    :func:`mpnb.core.ops.softmax.reference_scaled_softmax_fwd` (``args``: its arguments by
    name, checked before the launch)."""
    return _forward(args.input, None, args.scale, _NONE)


def scaled_masked_softmax_fwd(args) -> torch.Tensor:
    """Masked softmax of ``[b, np, sq, sk]`` scores: the semantics of
    :func:`mpnb.core.ops.softmax.reference_scaled_masked_softmax_fwd`.

    Example::

        >>> x = torch.randn(2, 4, 8, 8, device="cuda", dtype=torch.float16)
        >>> pad = torch.zeros(2, 1, 8, 8, dtype=torch.bool, device="cuda"); pad[..., 6:] = True
        >>> y = launcher("scaled_masked_softmax_fwd")(x, pad, 0.125)
    """
    mode = _MASK_ZERO if args.zero_all_masked else _MASK
    return _forward(args.input, args.mask, args.scale, mode)


def scaled_upper_triang_masked_softmax_fwd(args) -> torch.Tensor:
    """Causal softmax of ``[..., sq, sq]`` scores: the semantics of
    :func:`mpnb.core.ops.softmax.reference_scaled_upper_triang_masked_softmax_fwd`."""
    return _forward(args.input, None, args.scale, _CAUSAL)


@tuned(ROW_CONFIGS, key=["k"])
@triton.jit
def _bwd_fused(
    grad_out,
    output,
    dx_ptr,
    rows,
    k,
    scale_hi,
    scale_lo,
    ACC: tl.constexpr,
    BLOCK: tl.constexpr,
    TILE: tl.constexpr,
):
    ROWS: tl.constexpr = (TILE + BLOCK - 1) // BLOCK  # rows_per(TILE, BLOCK)
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    m = (r[:, None] < rows) & (cols[None, :] < k)
    offs = r.to(tl.int64)[:, None] * k + cols[None, :]
    y = to_acc(tl.load(output + offs, mask=m, other=0.0), ACC)
    dy = to_acc(tl.load(grad_out + offs, mask=m, other=0.0), ACC)
    dot = tl.sum(dy * y, axis=1)
    dx = _scale(scale_hi, scale_lo, ACC) * y * (dy - dot[:, None])
    tl.store(dx_ptr + offs, from_acc(dx, dx_ptr.dtype.element_ty), mask=m)


@tuned(LOOP_CONFIGS, key=["k"])
@triton.jit
def _bwd_looped(
    grad_out, output, dx_ptr, rows, k, scale_hi, scale_lo, ACC: tl.constexpr, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64) * k
    lanes = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], ACC)
    for j in range(0, k, BLOCK):
        m = j + lanes < k
        y = to_acc(tl.load(output + row + j + lanes, mask=m, other=0.0), ACC)
        acc += y * to_acc(tl.load(grad_out + row + j + lanes, mask=m, other=0.0), ACC)
    dot = tl.sum(acc, axis=0)
    s = _scale(scale_hi, scale_lo, ACC)
    for j in range(0, k, BLOCK):
        m = j + lanes < k
        y = to_acc(tl.load(output + row + j + lanes, mask=m, other=0.0), ACC)
        dy = to_acc(tl.load(grad_out + row + j + lanes, mask=m, other=0.0), ACC)
        tl.store(
            dx_ptr + row + j + lanes, from_acc(s * y * (dy - dot), dx_ptr.dtype.element_ty), mask=m
        )


def scaled_softmax_bwd(args) -> torch.Tensor:
    """``scale * y * (dy - sum(dy * y))``, the backward of every softmax forward here: the
    semantics of :func:`mpnb.core.ops.softmax.reference_scaled_softmax_bwd` (``upper_triang``
    changes nothing in the result: the causal zeros stay zero)."""
    output, grad_out, scale = args.output, args.grad_out, args.scale
    y, dy = output.contiguous(), grad_out.contiguous()
    dx = torch.empty_like(y)
    k = y.shape[-1] if y.dim() else 1
    rows = y.numel() // k if k else 0
    if rows == 0:
        return dx
    scale_hi, scale_lo = split64(scale)
    kernel_args = dict(
        grad_out=dy,
        output=y,
        dx_ptr=dx,
        rows=rows,
        k=k,
        scale_hi=scale_hi,
        scale_lo=scale_lo,
        ACC=acc_of(y.dtype),
    )
    _launch_rows(_bwd_fused, _bwd_looped, rows, k, kernel_args)
    return dx
