"""Rotary position embedding in Triton: the launcher of ``mpnb::rope``.

``t`` is ``[s, b, h, d]``, ``[b, s, h, d]`` or ``[b, h, s, d]`` (``layout``) with any
strides, read as an ``[s, b, h, d]`` view; ``cos``/``sin`` are fp32 (fp64 for fp64 ``t``)
tables ``[s, d2]``. The first ``d2`` channels form groups of ``group`` channels, each rotated
as ``rotate_half`` (``y = x * cos + rotate_half(x) * sin``); ``backward`` applies the
transposed rotation; channels past ``d2`` pass through. Computed in fp32 (fp64), written in
``t``'s dtype (``stepwise``: tables, products and sum rounded to ``t``'s dtype, as Apex's
kernel). The result is allocated by the op's rule (``mpnb.core.ops.rotary._output``): laid
out as ``t``, or as ``[b, s, h, d]`` with ``transpose_output``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mpnb.core.ops.rotary import _output
from mpnb.core.ops.triton._common import cdiv, from_acc, launch, next_pow2, to_acc, warps

__all__ = ["rope"]

_TILE = 4096  # elements per program


@triton.jit
def _round(x, DT: tl.constexpr, ACC: tl.constexpr):
    """``x`` rounded to the storage dtype and widened back (Apex's stepwise rounding)."""
    return to_acc(from_acc(x, DT), ACC)


@triton.jit
def _rope_kernel(
    t,
    y_ptr,
    cos,
    sin,
    rows,
    B,
    H,
    d,
    d2,
    ts,
    tb,
    th,
    td,
    ys,
    yb,
    yh,
    yd,
    cs,
    cd,
    ss,
    sd,
    group: tl.constexpr,
    BACKWARD: tl.constexpr,
    STEPWISE: tl.constexpr,
    ACC: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    si = r // (B * H)
    bi = r // H % B
    hi = r % H
    c = tl.arange(0, BLOCK)[None, :]
    d_lim = tl.where(r < rows, d, 0)[:, None]
    inside = c < d_lim
    rot = c < tl.where(r < rows, d2, 0)[:, None]
    half: tl.constexpr = group // 2
    first = c % group < half
    partner = tl.where(first, c + half, c - half)
    t_row = (si * ts + bi * tb + hi * th)[:, None]
    x = to_acc(tl.load(t + t_row + c * td, mask=inside, other=0.0), ACC)
    xp = to_acc(tl.load(t + t_row + partner * td, mask=rot, other=0.0), ACC)
    cs_row = (si * cs)[:, None]
    sn_row = (si * ss)[:, None]
    cosv = tl.load(cos + cs_row + c * cd, mask=rot, other=1.0).to(ACC)
    if BACKWARD:  # y1 = x1 cos + x2 sin', y2 = x2 cos - x1 sin' (sin' at the partner channel)
        sinv = tl.load(sin + sn_row + partner * sd, mask=rot, other=0.0).to(ACC)
        sign = tl.where(first, 1.0, -1.0)
    else:  # y1 = x1 cos - x2 sin, y2 = x2 cos + x1 sin
        sinv = tl.load(sin + sn_row + c * sd, mask=rot, other=0.0).to(ACC)
        sign = tl.where(first, -1.0, 1.0)
    if STEPWISE:  # tables, products and (on store) the sum rounded to t's dtype
        dt = y_ptr.dtype.element_ty
        prod = _round(x * _round(cosv, dt, ACC), dt, ACC)
        y = tl.where(rot, prod + sign * _round(xp * _round(sinv, dt, ACC), dt, ACC), x)
    else:
        y = tl.where(rot, x * cosv + sign * (xp * sinv), x)
    y_row = (si * ys + bi * yb + hi * yh)[:, None]
    tl.store(y_ptr + y_row + c * yd, from_acc(y, y_ptr.dtype.element_ty), mask=inside)


def rope(args) -> torch.Tensor:
    """Rotate ``t`` by the position tables: the semantics of
    :func:`mpnb.core.ops.rotary.reference_rope`, whose arguments ``args`` holds by name
    (checked before the launch; see the module docstring).

    Example::

        >>> t = torch.randn(16, 2, 4, 64, device="cuda", dtype=torch.bfloat16)
        >>> ang = torch.randn(16, 64, device="cuda")
        >>> y = launcher("rope")(t, ang.cos(), ang.sin(), 64)
    """
    cos, sin = args.cos, args.sin
    perm = [args.layout.index(c) for c in "sbhd"]  # views t as [s, b, h, d]
    t = args.t.permute(perm)
    s, b, h, d = t.shape
    result = _output(args.t, args.transpose_output)
    y = result if args.transpose_output else result.permute(perm)
    rows = s * b * h
    if rows == 0 or d == 0:
        return result
    block = next_pow2(d)
    nrows = max(1, _TILE // block)
    ts, tb, th, td = t.stride()
    ys, yb, yh, yd = y.stride()
    cs, cd = cos.stride()
    ss, sd = sin.stride()
    launch(
        _rope_kernel,
        (cdiv(rows, nrows),),
        t=t,
        y_ptr=y,
        cos=cos,
        sin=sin,
        rows=rows,
        B=b,
        H=h,
        d=d,
        d2=cos.shape[1],
        ts=ts,
        tb=tb,
        th=th,
        td=td,
        ys=ys,
        yb=yb,
        yh=yh,
        yd=yd,
        cs=cs,
        cd=cd,
        ss=ss,
        sd=sd,
        group=int(args.group),
        BACKWARD=bool(args.backward),
        STEPWISE=bool(args.stepwise),
        ACC=tl.float64 if t.dtype == torch.float64 else tl.float32,
        ROWS=nrows,
        BLOCK=block,
        num_warps=warps(nrows * block),
    )
    return result
