"""``fused_sgd_`` in Triton: one SGD step (momentum, dampening, nesterov) over lists, one pass.

Half grads are read and unscaled on the fly, the fp32 master and the momentum buffer (fp32, or
the param dtype without masters: stored rounded) are updated and the half param receives the
rounded master; a set ``found_inf`` writes nothing.
Each tensor's ``first_run`` (the buffer is initialised with the grad) is a column of the
chunk table. ``fused_sgd_bf16_`` (bf16 params without masters, rounded stochastically or with
Kahan summation) runs the same kernel with its ``ROUNDING`` (:mod:`._rounding`).
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from mpnb.core.ops.triton._chunks import ChunkTable, chunk_info, tensor_col
from mpnb.core.ops.triton._common import f32s_struct, from_acc, to_acc
from mpnb.core.ops.triton._optim import (
    OpKernel,
    guard_step,
    load_grad,
    load_scale,
    load_weight,
    not_found,
    store_step,
)
from mpnb.core.ops.triton._rounding import RNG_WORDS, key_of, rng_words, rounding_code
from mpnb.core.ops.triton._vector import aligned, column_ptr, span, span_mask, span_start

__all__ = ["fused_sgd_", "fused_sgd_bf16_"]

# Table columns: numel, first chunk, (2) first_run, then from column P = 3 params, grads,
# momentum buffers (the params when there is no momentum) and the fp32 weights (masters, or the
# params themselves; with a rounding Kahan's compensations, or the params). The random-bit
# keys: on the device (key_of).


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
    alpha_momentum,
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
    # alphas of its adds, alpha_momentum, one_m_damp and wd, come rounded to DT).
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
            g = _r(g + alpha_momentum * buf, DT, STEPWISE)
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
    key,
    p0,
    g0,
    b0,
    w0,
    inv,
    alpha_lr,
    momentum,
    alpha_momentum,
    alpha_dampening,
    alpha_weight_decay,
    HAS_MOMENTUM: tl.constexpr,
    NESTEROV: tl.constexpr,
    HAS_WEIGHT_DECAY: tl.constexpr,
    WD_AFTER_MOMENTUM: tl.constexpr,
    HAS_MASTERS: tl.constexpr,
    HAS_INV_SCALE: tl.constexpr,
    STEPWISE: tl.constexpr,
    ROUNDING: tl.constexpr,
    P: tl.constexpr,
    ROW: tl.constexpr,
    BLOCK: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    # The update of the elements [lo, hi) of the chunk (the lists from table column P); the
    # alpha_* are the alphas of the step's adds (ATen's add(..., alpha)), with STEPWISE
    # rounded to the param dtype.
    p_ptr = column_ptr(table, t, P, p0, ROW, ALIGNED)
    g_ptr = column_ptr(table, t, P + 1, g0, ROW, ALIGNED)
    b_ptr = column_ptr(table, t, P + 2, b0, ROW, ALIGNED)
    w_ptr = column_ptr(table, t, P + 3, w0, ROW, ALIGNED)
    lanes = tl.arange(0, BLOCK)
    for k in range(span_start(lo, BLOCK), hi, BLOCK):
        offs = start + k + lanes
        mask = span_mask(k, lanes, lo, hi)
        g = load_grad(g_ptr, offs, mask, inv, HAS_INV_SCALE)
        w = load_weight(p_ptr, w_ptr, offs, mask, HAS_MASTERS)
        g = _direction(
            g,
            w,
            b_ptr,
            offs,
            mask,
            first_run,
            momentum,
            alpha_momentum,
            alpha_dampening,
            alpha_weight_decay,
            HAS_MOMENTUM,
            NESTEROV,
            HAS_WEIGHT_DECAY,
            WD_AFTER_MOMENTUM,
            STEPWISE,
            p0.dtype.element_ty,
        )
        w = w + alpha_lr * g
        store_step(p_ptr, w_ptr, offs, w, mask, key, HAS_MASTERS, ROUNDING)


@triton.jit(do_not_specialize=RNG_WORDS)
def _sgd_kernel(
    table,
    n_tensors,
    inv_scale,
    found_inf,
    p0,
    g0,
    b0,
    w0,
    alpha_lr,
    momentum,
    alpha_momentum,
    alpha_dampening,
    alpha_weight_decay,
    HAS_MOMENTUM: tl.constexpr,
    NESTEROV: tl.constexpr,
    HAS_WEIGHT_DECAY: tl.constexpr,
    WD_AFTER_MOMENTUM: tl.constexpr,
    HAS_INV_SCALE: tl.constexpr,
    HAS_FOUND_INF: tl.constexpr,
    ROW: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
    rng_hi=0,
    rng_lo=0,
    HAS_MASTERS: tl.constexpr = False,
    STEPWISE: tl.constexpr = False,
    ROUNDING: tl.constexpr = 0,  # NEAREST
):
    P: tl.constexpr = 3  # the first list's column
    t, start, count = chunk_info(table, n_tensors, ROW, CHUNK)
    count = count * not_found(found_inf, HAS_FOUND_INF)
    first_run = tensor_col(table, t, 0, ROW) != 0
    key = key_of(t, rng_hi, rng_lo, ROUNDING)
    inv = load_scale(inv_scale, HAS_INV_SCALE)
    ok = aligned(table, t, P, P + 3, ROW)
    for part in tl.static_range(2):  # the vector span, then the scalar rest (see _vector)
        lo, hi = span(part, count, ok)
        _sgd_span(
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
            w0,
            inv,
            alpha_lr,
            momentum,
            alpha_momentum,
            alpha_dampening,
            alpha_weight_decay,
            HAS_MOMENTUM,
            NESTEROV,
            HAS_WEIGHT_DECAY,
            WD_AFTER_MOMENTUM,
            HAS_MASTERS,
            HAS_INV_SCALE,
            STEPWISE,
            ROUNDING,
            P,
            ROW,
            BLOCK,
            part == 0,
        )


_SGD = OpKernel(_sgd_kernel)


def _momentum_columns(args, params: list) -> tuple[list, tuple[int, ...]]:
    """The momentum buffers' list and the ``first_run`` column of the chunk table. Without
    momentum there are no buffers (the params stand in, unread) and the optimizer passes no
    ``first_run`` flags: a zero column."""
    if args.momentum == 0:
        return params, _zeros(len(params))
    return args.momentum_buffers, tuple(args.first_run)  # bools: the ints 0 and 1


@functools.lru_cache(maxsize=16)
def _zeros(n: int) -> tuple[int, ...]:
    return (0,) * n


def _alphas(dtype: torch.dtype, xs: tuple[float, ...]) -> tuple[float, ...]:
    """The alphas ``xs`` of a stepwise step's adds as the kernel takes them: rounded to the
    param ``dtype`` (ATen's add(..., alpha) on half tensors rounds alpha to their dtype; not
    stepwise, the launch rounds them to fp32 with :data:`_ALPHAS`)."""
    return _rounded(dtype, xs, tuple(math.copysign(1.0, x) for x in xs))


_ALPHAS = f32s_struct(4)  #: the four alphas rounded to fp32 together (floats: the op's schema)


@functools.lru_cache(maxsize=256)
def _rounded(dtype: torch.dtype, xs: tuple[float, ...], signs: tuple[float, ...]):
    # kept per value, a training loop passing the same ones (signs: 0.0 == -0.0 as keys)
    return tuple(float(torch.tensor(x).to(dtype)) for x in xs)


def _step(args, ids, weights: list, stepwise: bool, **given) -> None:
    """Both ops' launch after their checks (``ids``: the lists' ids): the chunk table of the
    lists with ``weights`` fourth and the ``first_run`` column, the kernel with the add alphas
    (rounded to the param dtype when ``stepwise``) and the launcher's keywords ``given``."""
    params = args.params
    b_list, first = _momentum_columns(args, params)
    lists = [params, args.grads, b_list, weights]
    tab = ChunkTable.build(lists, cols=(first,), ids=ids)
    if not tab.n_chunks:
        return
    alphas = -args.lr, args.momentum, 1.0 - args.dampening, args.weight_decay
    if stepwise:
        lr, momentum, damp, wd = _alphas(params[0].dtype, alphas)
    else:  # fp32, the four together
        lr, momentum, damp, wd = _ALPHAS.unpack(_ALPHAS.pack(*alphas))
    _SGD(
        tab,
        args,
        p0=params[0],
        g0=args.grads[0],
        b0=b_list[0],
        w0=weights[0],
        alpha_lr=lr,
        alpha_momentum=momentum,
        alpha_dampening=damp,
        alpha_weight_decay=wd,
        **given,
    )


def fused_sgd_(args) -> None:
    """One SGD step over lists, in place: the semantics of
    :func:`mpnb.core.ops.sgd.reference_fused_sgd_`, whose arguments ``args`` holds by name
    (its per-tensor checks: :func:`~mpnb.core.ops.triton._optim.guard_step`;
    ``momentum_buffers`` may be empty without momentum).

    Example::

        >>> launcher("fused_sgd_")(params, grads, bufs, masters, [False] * len(params),
        ...                        0.1, 0.9, 0.0, 1e-4, True, False)
    """
    if not args.params:
        return
    ids = guard_step(args)
    _step(args, ids, args.masters or args.params, bool(args.stepwise))


def fused_sgd_bf16_(args) -> None:
    """One pure-bf16 SGD step: the semantics of
    :func:`mpnb.core.ops.sgd.reference_fused_sgd_bf16_`, whose arguments ``args`` holds by
    name (its per-tensor checks: :func:`~mpnb.core.ops.triton._optim.guard_step`).

    Example::

        >>> launcher("fused_sgd_bf16_")(params, grads, bufs, [], [False] * len(params), 0.1,
        ...                             0.9, 0.0, 0.0, False, False, "stochastic", 1, 1)
    """
    if not args.params:
        return
    ids = guard_step(args, masters=None, rounding=True)
    weights = args.compensations if args.rounding == "kahan" else args.params
    rounding = rounding_code(args.rounding)
    _step(args, ids, weights, False, ROUNDING=rounding, **rng_words(args.seed, args.rng_step))


fused_sgd_.guards_lists = fused_sgd_bf16_.guards_lists = True
