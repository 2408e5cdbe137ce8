"""``fused_adam_`` in Triton: one Adam/AdamW step over lists, in one pass per element.

The O2 mixed-precision step: half grads are read and unscaled on the fly, the fp32 master
weight and both moments are updated, and the half param receives the rounded master, all in
one read and one write of each tensor; a set ``found_inf`` writes nothing. The bias
corrections are computed per tensor on the device in fp64 from its step count (no host sync).
``fused_adam_bf16_`` (bf16 params without masters, rounded stochastically or with Kahan
summation) runs the same kernel with its ``ROUNDING`` (:mod:`._rounding`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from mpnb.core.ops.triton._chunks import ChunkTable, chunk_info
from mpnb.core.ops.triton._common import f32, join64
from mpnb.core.ops.triton._optim import (
    OpKernel,
    advance_steps,
    bias_corrections,
    guard_step,
    learning_rate,
    load_grad,
    load_scale,
    load_weight,
    not_found,
    step_of,
    store_step,
)
from mpnb.core.ops.triton._rounding import NEAREST, RNG_WORDS, key_of, rng_words, rounding_code
from mpnb.core.ops.triton._vector import aligned, column_ptr, span, span_mask, span_start

__all__ = ["fused_adam_", "fused_adam_bf16_"]

# Table columns: numel, first chunk, then from column P = 2 params, grads, exp_avgs,
# exp_avg_sqs, the fp32 weights (masters, or the params themselves; with a rounding Kahan's
# compensations, or the params) and steps. The random-bit keys: on the device (key_of).


@triton.jit
def _lerp(a, b, wt, SMALL: tl.constexpr):
    # torch.lerp's two formulas (exact at both ends), chosen by |weight| < 0.5.
    if SMALL:
        out = a + wt * (b - a)
    else:
        out = b - (b - a) * (1.0 - wt)
    return out


@triton.jit
def _adam_span(
    table,
    t,
    start,
    lo,
    hi,
    key,
    p0,
    g0,
    m0,
    w0,
    inv,
    step_size,
    sqrt_bc2,
    decay,
    beta1,
    one_m_beta1,
    beta2,
    one_m_beta2,
    eps,
    weight_decay,
    ADAM_W_MODE: tl.constexpr,
    HAS_WEIGHT_DECAY: tl.constexpr,
    LERP_SMALL: tl.constexpr,
    HAS_MASTERS: tl.constexpr,
    HAS_INV_SCALE: tl.constexpr,
    ROUNDING: tl.constexpr,
    P: tl.constexpr,
    ROW: tl.constexpr,
    BLOCK: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    # The update of the elements [lo, hi) of the chunk (the lists from table column P).
    p_ptr = column_ptr(table, t, P, p0, ROW, ALIGNED)
    g_ptr = column_ptr(table, t, P + 1, g0, ROW, ALIGNED)
    m_ptr = column_ptr(table, t, P + 2, m0, ROW, ALIGNED)
    v_ptr = column_ptr(table, t, P + 3, m0, ROW, ALIGNED)
    w_ptr = column_ptr(table, t, P + 4, w0, ROW, ALIGNED)
    lanes = tl.arange(0, BLOCK)
    for k in range(span_start(lo, BLOCK), hi, BLOCK):
        offs = start + k + lanes
        mask = span_mask(k, lanes, lo, hi)
        g = load_grad(g_ptr, offs, mask, inv, HAS_INV_SCALE)
        w = load_weight(p_ptr, w_ptr, offs, mask, HAS_MASTERS)
        if HAS_WEIGHT_DECAY:
            if ADAM_W_MODE:
                w = w * decay
            else:
                g = g + weight_decay * w
        m = tl.load(m_ptr + offs, mask=mask, other=0.0)
        if ROUNDING == NEAREST:  # the reference's torch.lerp
            m = _lerp(m, g, one_m_beta1, LERP_SMALL)
        else:  # the pure-bf16 reference's formula, one rounding per operation
            m = m * beta1 + one_m_beta1 * g
        v = tl.load(v_ptr + offs, mask=mask, other=0.0) * beta2 + one_m_beta2 * g * g
        denom = tl.div_rn(tl.sqrt_rn(v), sqrt_bc2) + eps
        w = w + tl.div_rn(step_size * m, denom)
        tl.store(m_ptr + offs, m, mask=mask)
        tl.store(v_ptr + offs, v, mask=mask)
        store_step(p_ptr, w_ptr, offs, w, mask, key, HAS_MASTERS, ROUNDING)


@triton.jit(do_not_specialize=RNG_WORDS)
def _adam_kernel(
    table,
    n_tensors,
    inv_scale,
    found_inf,
    lr_tensor,
    p0,
    g0,
    m0,
    w0,
    s0,
    lr_hi,
    lr_lo,
    beta1_hi,
    beta1_lo,
    beta2_hi,
    beta2_lo,
    weight_decay_hi,
    weight_decay_lo,
    neg_lr,
    beta1,
    one_m_beta1,
    beta2,
    one_m_beta2,
    eps,
    weight_decay,
    decay,
    ADAM_W_MODE: tl.constexpr,
    HAS_WEIGHT_DECAY: tl.constexpr,
    BIAS_CORRECTION: tl.constexpr,
    LERP_SMALL: tl.constexpr,
    HAS_INV_SCALE: tl.constexpr,
    HAS_FOUND_INF: tl.constexpr,
    HAS_LR_TENSOR: tl.constexpr,
    ROW: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
    rng_hi=0,
    rng_lo=0,
    HAS_MASTERS: tl.constexpr = False,
    ROUNDING: tl.constexpr = 0,  # NEAREST
):
    P: tl.constexpr = 2  # the first list's column
    t, start, count = chunk_info(table, n_tensors, ROW, CHUNK)
    count = count * not_found(found_inf, HAS_FOUND_INF)
    key = key_of(t, rng_hi, rng_lo, ROUNDING)
    lr, neg_lr, decay = learning_rate(
        lr_tensor, lr_hi, lr_lo, weight_decay_hi, weight_decay_lo, neg_lr, decay, HAS_LR_TENSOR
    )
    if BIAS_CORRECTION:
        step = step_of(table, t, P + 5, s0, ROW)
        bc1, bc2 = bias_corrections(step, join64(beta1_hi, beta1_lo), join64(beta2_hi, beta2_lo))
        step_size = (-lr / bc1).to(tl.float32)
        sqrt_bc2 = tl.sqrt(bc2).to(tl.float32)
    else:
        step_size = neg_lr
        sqrt_bc2 = tl.full((), 1.0, tl.float32)
    inv = load_scale(inv_scale, HAS_INV_SCALE)
    ok = aligned(table, t, P, P + 4, ROW)
    for part in tl.static_range(2):  # the vector span, then the scalar rest (see _vector)
        lo, hi = span(part, count, ok)
        _adam_span(
            table,
            t,
            start,
            lo,
            hi,
            key,
            p0,
            g0,
            m0,
            w0,
            inv,
            step_size,
            sqrt_bc2,
            decay,
            beta1,
            one_m_beta1,
            beta2,
            one_m_beta2,
            eps,
            weight_decay,
            ADAM_W_MODE,
            HAS_WEIGHT_DECAY,
            LERP_SMALL,
            HAS_MASTERS,
            HAS_INV_SCALE,
            ROUNDING,
            P,
            ROW,
            BLOCK,
            part == 0,
        )


_ADAM = OpKernel(_adam_kernel)


def _step(args, ids, weights: list, **given) -> None:
    """Both ops' launch after their checks (``ids``: the lists' ids): the chunk table of the
    lists with ``weights`` fifth, the kernel (with the launcher's keywords ``given``), the step
    counts."""
    params, steps = args.params, args.steps
    lists = [params, args.grads, args.exp_avgs, args.exp_avg_sqs, weights, steps]
    tab = ChunkTable.build(lists, ids=ids)
    if tab.n_chunks:
        _ADAM(
            tab,
            args,
            p0=params[0],
            g0=args.grads[0],
            m0=args.exp_avgs[0],
            w0=weights[0],
            s0=steps[0],
            decay=f32(1.0 - args.lr * args.weight_decay),
            LERP_SMALL=abs(1.0 - args.beta1) < 0.5,
            **given,
        )
    advance_steps(tab, tab.row - 1, steps, args.found_inf)


def fused_adam_(args) -> None:
    """One Adam/AdamW step over lists, in place: the semantics of
    :func:`mpnb.core.ops.adam.reference_fused_adam_`, whose arguments ``args`` holds by name
    (its per-tensor checks: :func:`~mpnb.core.ops.triton._optim.guard_step`).

    Example::

        >>> launcher("fused_adam_")(params, grads, exp_avgs, exp_avg_sqs, masters, steps,
        ...                         1e-3, 0.9, 0.999, 1e-8, 0.01, True, True)
    """
    if not args.params:
        return
    ids = guard_step(args, "exp_avgs", "exp_avg_sqs")
    _step(args, ids, args.masters or args.params)


def fused_adam_bf16_(args) -> None:
    """One pure-bf16 Adam/AdamW step: the semantics of
    :func:`mpnb.core.ops.adam.reference_fused_adam_bf16_`, whose arguments ``args`` holds by
    name (its per-tensor checks: :func:`~mpnb.core.ops.triton._optim.guard_step`); the bias
    corrections are computed on the device from the step counts.

    Example::

        >>> launcher("fused_adam_bf16_")(params, grads, m, v, [], steps, 1e-3, 0.9, 0.999,
        ...                              1e-8, 0.01, True, True, "stochastic", 1, 1)
    """
    if not args.params:
        return
    ids = guard_step(args, "exp_avgs", "exp_avg_sqs", masters=None, rounding=True)
    weights = args.compensations if args.rounding == "kahan" else args.params
    rounding = rounding_code(args.rounding)
    _step(args, ids, weights, ROUNDING=rounding, **rng_words(args.seed, args.rng_step))


fused_adam_.guards_lists = fused_adam_bf16_.guards_lists = True
