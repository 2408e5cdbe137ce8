"""``fused_sgd_`` in Triton: one SGD step (momentum, dampening, nesterov) over lists, one pass.

Half grads are read and unscaled on the fly, the fp32 master and the momentum buffer (fp32, or
the param dtype without masters: stored rounded) are updated and the half param receives the
rounded master; a set ``found_inf`` writes nothing.
Each tensor's ``first_run`` (the buffer is initialised with the grad) is a column of the
chunk table.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mpnb.core.ops.triton._chunks import (
    BLOCK,
    WARPS,
    ChunkTable,
    chunk_info,
    tensor_col,
)
from mpnb.core.ops.triton._common import f32, flag_view, from_acc, launch, to_acc
from mpnb.core.ops.triton._optim import (
    check_flags,
    guard_step,
    load_grad,
    load_scale,
    load_weight,
    not_found,
    store_weight,
)
from mpnb.core.ops.triton._rounding import keys_of, store_rounded
from mpnb.core.ops.triton._vector import aligned, column_ptr, span, span_mask, span_start

__all__ = ["fused_sgd_", "fused_sgd_bf16_"]

# Table columns: numel, first chunk, (2) first_run, then (3) params, (4) grads,
# (5) momentum buffers (the params when there is no momentum) and (6) the fp32 weights.


@triton.jit
def _r(x, DT: tl.constexpr, STEPWISE: tl.constexpr):
    """``x`` rounded to ``DT`` and widened back with ``STEPWISE`` (else ``x``)."""
    if STEPWISE:
        x = to_acc(from_acc(x, DT), tl.float32)
    return x


@triton.jit
def _direction(
    g,
    w,
    b_ptr,
    offs,
    mask,
    first_run,
    momentum,
    mom_add,
    one_m_damp,
    wd,
    HAS_MOMENTUM: tl.constexpr,
    NESTEROV: tl.constexpr,
    HAS_WD: tl.constexpr,
    WD_AFTER: tl.constexpr,
    STEPWISE: tl.constexpr,
    DT: tl.constexpr,
):
    # The step direction (weight decay, momentum, nesterov); updates the momentum buffer.
    # STEPWISE: every operation rounded to the param dtype DT (torch.optim.SGD's half ops; the
    # alphas of its adds, mom_add, one_m_damp and wd, come rounded to DT).
    g = _r(g, DT, STEPWISE)
    if HAS_WD:
        if not WD_AFTER:
            g = _r(g + wd * w, DT, STEPWISE)
    if HAS_MOMENTUM:  # an fp32 buffer, or one in the param dtype (stored rounded)
        buf = to_acc(tl.load(b_ptr + offs, mask=mask, other=0.0), tl.float32)
        buf = tl.where(
            first_run, g, _r(_r(buf * momentum, DT, STEPWISE) + one_m_damp * g, DT, STEPWISE)
        )
        tl.store(b_ptr + offs, from_acc(buf, b_ptr.dtype.element_ty), mask=mask)
        if NESTEROV:
            g = _r(g + mom_add * buf, DT, STEPWISE)
        else:
            g = buf
    if HAS_WD:
        if WD_AFTER:
            g = _r(g + wd * w, DT, STEPWISE)
    return g


@triton.jit
def _sgd_span(
    table,
    t,
    start,
    lo,
    hi,
    first_run,
    p0,
    g0,
    b0,
    w0,
    inv,
    neg_lr,
    momentum,
    mom_add,
    one_m_damp,
    wd,
    HAS_MOMENTUM: tl.constexpr,
    NESTEROV: tl.constexpr,
    HAS_WD: tl.constexpr,
    WD_AFTER: tl.constexpr,
    HAS_MASTER: tl.constexpr,
    HAS_INV: tl.constexpr,
    STEPWISE: tl.constexpr,
    ROW: tl.constexpr,
    BLOCK: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    # The update of the elements [lo, hi) of the chunk.
    p_ptr = column_ptr(table, t, 3, p0, ROW, ALIGNED)
    g_ptr = column_ptr(table, t, 4, g0, ROW, ALIGNED)
    b_ptr = column_ptr(table, t, 5, b0, ROW, ALIGNED)
    w_ptr = column_ptr(table, t, 6, w0, ROW, ALIGNED)
    lanes = tl.arange(0, BLOCK)
    for k in range(span_start(lo, BLOCK), hi, BLOCK):
        offs = start + k + lanes
        mask = span_mask(k, lanes, lo, hi)
        g = load_grad(g_ptr, offs, mask, inv, HAS_INV)
        w = load_weight(p_ptr, w_ptr, offs, mask, HAS_MASTER)
        g = _direction(
            g,
            w,
            b_ptr,
            offs,
            mask,
            first_run,
            momentum,
            mom_add,
            one_m_damp,
            wd,
            HAS_MOMENTUM,
            NESTEROV,
            HAS_WD,
            WD_AFTER,
            STEPWISE,
            p0.dtype.element_ty,
        )
        w = w + neg_lr * g
        store_weight(p_ptr, w_ptr, offs, w, mask, HAS_MASTER)


@triton.jit
def _sgd_kernel(
    table,
    n_tensors,
    inv_ptr,
    found_ptr,
    p0,
    g0,
    b0,
    w0,
    neg_lr,
    momentum,
    mom_add,
    one_m_damp,
    wd,
    HAS_MOMENTUM: tl.constexpr,
    NESTEROV: tl.constexpr,
    HAS_WD: tl.constexpr,
    WD_AFTER: tl.constexpr,
    HAS_MASTER: tl.constexpr,
    HAS_INV: tl.constexpr,
    HAS_FOUND: tl.constexpr,
    STEPWISE: tl.constexpr,
    ROW: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    t, start, count = chunk_info(table, n_tensors, ROW, CHUNK)
    count = count * not_found(found_ptr, HAS_FOUND)
    first_run = tensor_col(table, t, 0, ROW) != 0
    inv = load_scale(inv_ptr, HAS_INV)
    ok = aligned(table, t, 3, 6, ROW)
    for part in tl.static_range(2):  # the vector span, then the scalar rest (see _vector)
        lo, hi = span(part, count, ok)
        _sgd_span(
            table,
            t,
            start,
            lo,
            hi,
            first_run,
            p0,
            g0,
            b0,
            w0,
            inv,
            neg_lr,
            momentum,
            mom_add,
            one_m_damp,
            wd,
            HAS_MOMENTUM,
            NESTEROV,
            HAS_WD,
            WD_AFTER,
            HAS_MASTER,
            HAS_INV,
            STEPWISE,
            ROW,
            BLOCK,
            part == 0,
        )


def _momentum_columns(args, params: list) -> tuple[list, list[int]]:
    """The momentum buffers' list and the ``first_run`` column of the chunk table. Without
    momentum there are no buffers (the params stand in, unread) and the optimizer passes no
    ``first_run`` flags: a zero column."""
    if args.momentum == 0:
        return params, [0] * len(params)
    return args.momentum_buffers, [int(bool(f)) for f in args.first_run]


def fused_sgd_(args) -> None:
    """One SGD step over lists, in place: the semantics of
    :func:`mpnb.core.ops.sgd.reference_fused_sgd_`, whose arguments ``args`` holds by name
    (its per-tensor checks: :func:`~mpnb.core.ops.triton._optim.guard_step`;
    ``momentum_buffers`` may be empty without momentum).

    Example::

        >>> launcher("fused_sgd_")(params, grads, bufs, masters, [False] * len(params),
        ...                        0.1, 0.9, 0.0, 1e-4, True, False)
    """
    params, grads, masters = args.params, args.grads, args.masters
    momentum, weight_decay, stepwise = args.momentum, args.weight_decay, args.stepwise
    inv_scale, found_inf = args.inv_scale, args.found_inf
    if not params:
        return
    ids = guard_step(args)
    check_flags(args)
    w_list = masters if masters else params

    def alpha(x: float) -> float:
        # ATen's add(..., alpha) on half tensors rounds alpha to their dtype (stepwise rule)
        return float(torch.tensor(x).to(params[0].dtype)) if stepwise else f32(x)

    b_list, first = _momentum_columns(args, params)
    tab = ChunkTable.build([params, grads, b_list, w_list], cols=[first], ids=ids)
    if not tab.n_chunks:
        return
    launch(
        _sgd_kernel,
        (tab.n_chunks,),
        tab.table,
        tab.n_tensors,
        tab.table if inv_scale is None else inv_scale,
        tab.table if found_inf is None else flag_view(found_inf),
        params[0],
        grads[0],
        b_list[0],
        w_list[0],
        alpha(-args.lr),
        f32(momentum),
        alpha(momentum),
        alpha(1.0 - args.dampening),
        alpha(weight_decay),
        HAS_MOMENTUM=momentum != 0,
        NESTEROV=bool(args.nesterov),
        HAS_WD=weight_decay != 0,
        WD_AFTER=bool(args.wd_after_momentum),
        HAS_MASTER=bool(masters),
        HAS_INV=inv_scale is not None,
        HAS_FOUND=found_inf is not None,
        STEPWISE=bool(stepwise),
        ROW=tab.row,
        CHUNK=tab.chunk,
        BLOCK=BLOCK,
        num_warps=WARPS,
    )


# ---- pure bf16: stochastic rounding or Kahan summation ------------------------------------
# Table columns: numel, first chunk, (2) first_run, (3) the random-bit key, then (4) params,
# (5) grads, (6) momentum buffers (the params without momentum) and (7) compensations (the
# params for stochastic rounding).


@triton.jit
def _sgd_bf16_span(
    table,
    t,
    start,
    lo,
    hi,
    first_run,
    key,
    p0,
    g0,
    b0,
    c0,
    inv,
    lr,
    momentum,
    one_m_damp,
    wd,
    HAS_MOMENTUM: tl.constexpr,
    NESTEROV: tl.constexpr,
    HAS_WD: tl.constexpr,
    WD_AFTER: tl.constexpr,
    KAHAN: tl.constexpr,
    HAS_INV: tl.constexpr,
    ROW: tl.constexpr,
    BLOCK: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    # The update of the elements [lo, hi) of the chunk, rounded into the bf16 params.
    p_ptr = column_ptr(table, t, 4, p0, ROW, ALIGNED)
    g_ptr = column_ptr(table, t, 5, g0, ROW, ALIGNED)
    b_ptr = column_ptr(table, t, 6, b0, ROW, ALIGNED)
    c_ptr = column_ptr(table, t, 7, c0, ROW, ALIGNED)
    lanes = tl.arange(0, BLOCK)
    for k in range(span_start(lo, BLOCK), hi, BLOCK):
        offs = start + k + lanes
        mask = span_mask(k, lanes, lo, hi)
        g = load_grad(g_ptr, offs, mask, inv, HAS_INV)
        w = load_weight(p_ptr, p_ptr, offs, mask, False)
        g = _direction(
            g,
            w,
            b_ptr,
            offs,
            mask,
            first_run,
            momentum,
            momentum,
            one_m_damp,
            wd,
            HAS_MOMENTUM,
            NESTEROV,
            HAS_WD,
            WD_AFTER,
            False,
            p0.dtype.element_ty,
        )
        store_rounded(p_ptr, c_ptr, offs, w - lr * g, mask, key, KAHAN)


@triton.jit
def _sgd_bf16_kernel(
    table,
    n_tensors,
    inv_ptr,
    found_ptr,
    p0,
    g0,
    b0,
    c0,
    lr,
    momentum,
    one_m_damp,
    wd,
    HAS_MOMENTUM: tl.constexpr,
    NESTEROV: tl.constexpr,
    HAS_WD: tl.constexpr,
    WD_AFTER: tl.constexpr,
    KAHAN: tl.constexpr,
    HAS_INV: tl.constexpr,
    HAS_FOUND: tl.constexpr,
    ROW: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    t, start, count = chunk_info(table, n_tensors, ROW, CHUNK)
    count = count * not_found(found_ptr, HAS_FOUND)
    first_run = tensor_col(table, t, 0, ROW) != 0
    key = tensor_col(table, t, 1, ROW).to(tl.uint32)
    inv = load_scale(inv_ptr, HAS_INV)
    ok = aligned(table, t, 4, 7, ROW)
    for part in tl.static_range(2):  # the vector span, then the scalar rest (see _vector)
        lo, hi = span(part, count, ok)
        _sgd_bf16_span(
            table,
            t,
            start,
            lo,
            hi,
            first_run,
            key,
            p0,
            g0,
            b0,
            c0,
            inv,
            lr,
            momentum,
            one_m_damp,
            wd,
            HAS_MOMENTUM,
            NESTEROV,
            HAS_WD,
            WD_AFTER,
            KAHAN,
            HAS_INV,
            ROW,
            BLOCK,
            part == 0,
        )


def fused_sgd_bf16_(args) -> None:
    """One pure-bf16 SGD step: the semantics of
    :func:`mpnb.core.ops.sgd.reference_fused_sgd_bf16_`, whose arguments ``args`` holds by
    name (its per-tensor checks: :func:`~mpnb.core.ops.triton._optim.guard_step`).

    Example::

        >>> launcher("fused_sgd_bf16_")(params, grads, bufs, [], [False] * len(params), 0.1,
        ...                             0.9, 0.0, 0.0, False, False, "stochastic", 1, 1)
    """
    params, grads, comps = args.params, args.grads, args.compensations
    momentum, weight_decay = args.momentum, args.weight_decay
    inv_scale, found_inf = args.inv_scale, args.found_inf
    if not params:
        return
    ids = guard_step(args, masters=None, rounding=True)
    check_flags(args)
    kahan = args.rounding == "kahan"
    b_list, first = _momentum_columns(args, params)
    c_list = comps if kahan else params
    keys = keys_of(len(params), args.seed, args.rng_step, kahan)
    tab = ChunkTable.build([params, grads, b_list, c_list], cols=[first, keys], ids=ids)
    if not tab.n_chunks:
        return
    launch(
        _sgd_bf16_kernel,
        (tab.n_chunks,),
        tab.table,
        tab.n_tensors,
        tab.table if inv_scale is None else inv_scale,
        tab.table if found_inf is None else flag_view(found_inf),
        params[0],
        grads[0],
        b_list[0],
        c_list[0],
        f32(args.lr),
        f32(momentum),
        f32(1.0 - args.dampening),
        f32(weight_decay),
        HAS_MOMENTUM=momentum != 0,
        NESTEROV=bool(args.nesterov),
        HAS_WD=weight_decay != 0,
        WD_AFTER=bool(args.wd_after_momentum),
        KAHAN=kahan,
        HAS_INV=inv_scale is not None,
        HAS_FOUND=found_inf is not None,
        ROW=tab.row,
        CHUNK=tab.chunk,
        BLOCK=BLOCK,
        num_warps=WARPS,
    )


fused_sgd_.guards_lists = fused_sgd_bf16_.guards_lists = True
