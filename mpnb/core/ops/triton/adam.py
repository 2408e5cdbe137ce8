"""``fused_adam_`` in Triton: one Adam/AdamW step over lists, in one pass per element.

The O2 mixed-precision step: half grads are read and unscaled on the fly, the fp32 master
weight and both moments are updated, and the half param receives the rounded master, all in
one read and one write of each tensor; a set ``found_inf`` writes nothing. The bias
corrections are computed per tensor on the device in fp64 from its step count (no host sync).
"""

from __future__ import annotations

import triton
import triton.language as tl

from mpnb.core.ops.triton._chunks import (
    BLOCK,
    WARPS,
    ChunkTable,
    chunk_info,
    tensor_col,
)
from mpnb.core.ops.triton._common import f32, flag_view, join64, launch, split64
from mpnb.core.ops.triton._optim import (
    advance_steps,
    bias_corrections,
    check_flags,
    guard_step,
    learning_rate,
    load_grad,
    load_scale,
    load_weight,
    not_found,
    step_of,
    store_weight,
)
from mpnb.core.ops.triton._rounding import keys_of, store_rounded
from mpnb.core.ops.triton._vector import aligned, column_ptr, span, span_mask, span_start

__all__ = ["fused_adam_", "fused_adam_bf16_"]

# Table columns: numel, first chunk, then (2) params, (3) grads, (4) exp_avgs, (5) exp_avg_sqs,
# (6) the fp32 weights (masters, or the params themselves) and (7) steps.


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
    p0,
    g0,
    m0,
    w0,
    inv,
    step_size,
    sqrt_bc2,
    decay,
    one_m_b1,
    beta2,
    one_m_b2,
    eps,
    wd,
    ADAM_W: tl.constexpr,
    HAS_WD: tl.constexpr,
    LERP_SMALL: tl.constexpr,
    HAS_MASTER: tl.constexpr,
    HAS_INV: tl.constexpr,
    ROW: tl.constexpr,
    BLOCK: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    # The update of the elements [lo, hi) of the chunk.
    p_ptr = column_ptr(table, t, 2, p0, ROW, ALIGNED)
    g_ptr = column_ptr(table, t, 3, g0, ROW, ALIGNED)
    m_ptr = column_ptr(table, t, 4, m0, ROW, ALIGNED)
    v_ptr = column_ptr(table, t, 5, m0, ROW, ALIGNED)
    w_ptr = column_ptr(table, t, 6, w0, ROW, ALIGNED)
    lanes = tl.arange(0, BLOCK)
    for k in range(span_start(lo, BLOCK), hi, BLOCK):
        offs = start + k + lanes
        mask = span_mask(k, lanes, lo, hi)
        g = load_grad(g_ptr, offs, mask, inv, HAS_INV)
        w = load_weight(p_ptr, w_ptr, offs, mask, HAS_MASTER)
        if HAS_WD:
            if ADAM_W:
                w = w * decay
            else:
                g = g + wd * w
        m = _lerp(tl.load(m_ptr + offs, mask=mask, other=0.0), g, one_m_b1, LERP_SMALL)
        v = tl.load(v_ptr + offs, mask=mask, other=0.0) * beta2 + one_m_b2 * g * g
        denom = tl.div_rn(tl.sqrt_rn(v), sqrt_bc2) + eps
        w = w + tl.div_rn(step_size * m, denom)
        tl.store(m_ptr + offs, m, mask=mask)
        tl.store(v_ptr + offs, v, mask=mask)
        store_weight(p_ptr, w_ptr, offs, w, mask, HAS_MASTER)


@triton.jit
def _adam_kernel(
    table,
    n_tensors,
    inv_ptr,
    found_ptr,
    lr_ptr,
    p0,
    g0,
    m0,
    w0,
    s0,
    lr_hi,
    lr_lo,
    b1_hi,
    b1_lo,
    b2_hi,
    b2_lo,
    wd_hi,
    wd_lo,
    neg_lr,
    one_m_b1,
    beta2,
    one_m_b2,
    eps,
    wd,
    decay,
    ADAM_W: tl.constexpr,
    HAS_WD: tl.constexpr,
    BIAS_CORRECTION: tl.constexpr,
    LERP_SMALL: tl.constexpr,
    HAS_MASTER: tl.constexpr,
    HAS_INV: tl.constexpr,
    HAS_FOUND: tl.constexpr,
    HAS_LR_T: tl.constexpr,
    ROW: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    t, start, count = chunk_info(table, n_tensors, ROW, CHUNK)
    count = count * not_found(found_ptr, HAS_FOUND)
    lr, neg_lr, decay = learning_rate(lr_ptr, lr_hi, lr_lo, wd_hi, wd_lo, neg_lr, decay, HAS_LR_T)
    if BIAS_CORRECTION:
        step = step_of(table, t, 7, s0, ROW)
        bc1, bc2 = bias_corrections(step, join64(b1_hi, b1_lo), join64(b2_hi, b2_lo))
        step_size = (-lr / bc1).to(tl.float32)
        sqrt_bc2 = tl.sqrt(bc2).to(tl.float32)
    else:
        step_size = neg_lr
        sqrt_bc2 = tl.full((), 1.0, tl.float32)
    inv = load_scale(inv_ptr, HAS_INV)
    ok = aligned(table, t, 2, 6, ROW)
    for part in tl.static_range(2):  # the vector span, then the scalar rest (see _vector)
        lo, hi = span(part, count, ok)
        _adam_span(
            table,
            t,
            start,
            lo,
            hi,
            p0,
            g0,
            m0,
            w0,
            inv,
            step_size,
            sqrt_bc2,
            decay,
            one_m_b1,
            beta2,
            one_m_b2,
            eps,
            wd,
            ADAM_W,
            HAS_WD,
            LERP_SMALL,
            HAS_MASTER,
            HAS_INV,
            ROW,
            BLOCK,
            part == 0,
        )


def fused_adam_(args) -> None:
    """One Adam/AdamW step over lists, in place: the semantics of
    :func:`mpnb.core.ops.adam.reference_fused_adam_`, whose arguments ``args`` holds by name
    (its per-tensor checks: :func:`~mpnb.core.ops.triton._optim.guard_step`).

    Example::

        >>> launcher("fused_adam_")(params, grads, exp_avgs, exp_avg_sqs, masters, steps,
        ...                         1e-3, 0.9, 0.999, 1e-8, 0.01, True, True)
    """
    params, grads, masters = args.params, args.grads, args.masters
    exp_avgs, exp_avg_sqs, steps = args.exp_avgs, args.exp_avg_sqs, args.steps
    lr, beta1, beta2, weight_decay = args.lr, args.beta1, args.beta2, args.weight_decay
    inv_scale, found_inf, lr_tensor = args.inv_scale, args.found_inf, args.lr_tensor
    if not params:
        return
    ids = guard_step(args, "exp_avgs", "exp_avg_sqs")
    check_flags(args)
    w_list = masters if masters else params
    tab = ChunkTable.build([params, grads, exp_avgs, exp_avg_sqs, w_list, steps], ids=ids)
    wt = 1.0 - beta1
    if tab.n_chunks:
        launch(
            _adam_kernel,
            (tab.n_chunks,),
            tab.table,
            tab.n_tensors,
            tab.table if inv_scale is None else inv_scale,
            tab.table if found_inf is None else flag_view(found_inf),
            tab.table if lr_tensor is None else lr_tensor,
            params[0],
            grads[0],
            exp_avgs[0],
            w_list[0],
            steps[0],
            *split64(lr),
            *split64(beta1),
            *split64(beta2),
            *split64(weight_decay),
            f32(-lr),
            f32(wt),
            f32(beta2),
            f32(1.0 - beta2),
            f32(args.eps),
            f32(weight_decay),
            f32(1.0 - lr * weight_decay),
            ADAM_W=bool(args.adam_w_mode),
            HAS_WD=weight_decay != 0,
            BIAS_CORRECTION=bool(args.bias_correction),
            LERP_SMALL=abs(wt) < 0.5,
            HAS_MASTER=bool(masters),
            HAS_INV=inv_scale is not None,
            HAS_FOUND=found_inf is not None,
            HAS_LR_T=lr_tensor is not None,
            ROW=tab.row,
            CHUNK=tab.chunk,
            BLOCK=BLOCK,
            num_warps=WARPS,
        )
    advance_steps(tab, 7, steps, found_inf)


# ---- pure bf16: stochastic rounding or Kahan summation ------------------------------------
# Table columns: numel, first chunk, (2) the tensor's random-bit key, then (3) params,
# (4) grads, (5) exp_avgs, (6) exp_avg_sqs, (7) compensations (the params for stochastic
# rounding) and (8) steps.


@triton.jit
def _adam_bf16_span(
    table,
    t,
    start,
    lo,
    hi,
    key,
    p0,
    g0,
    m0,
    c0,
    inv,
    step_size,
    sqrt_bc2,
    decay,
    beta1,
    one_m_b1,
    beta2,
    one_m_b2,
    eps,
    wd,
    ADAM_W: tl.constexpr,
    HAS_WD: tl.constexpr,
    KAHAN: tl.constexpr,
    HAS_INV: tl.constexpr,
    ROW: tl.constexpr,
    BLOCK: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    # The update of the elements [lo, hi) of the chunk, rounded into the bf16 params.
    p_ptr = column_ptr(table, t, 3, p0, ROW, ALIGNED)
    g_ptr = column_ptr(table, t, 4, g0, ROW, ALIGNED)
    m_ptr = column_ptr(table, t, 5, m0, ROW, ALIGNED)
    v_ptr = column_ptr(table, t, 6, m0, ROW, ALIGNED)
    c_ptr = column_ptr(table, t, 7, c0, ROW, ALIGNED)
    lanes = tl.arange(0, BLOCK)
    for k in range(span_start(lo, BLOCK), hi, BLOCK):
        offs = start + k + lanes
        mask = span_mask(k, lanes, lo, hi)
        g = load_grad(g_ptr, offs, mask, inv, HAS_INV)
        w = load_weight(p_ptr, p_ptr, offs, mask, False)
        if HAS_WD:
            if ADAM_W:
                w = w * decay
            else:
                g = g + wd * w
        m = tl.load(m_ptr + offs, mask=mask, other=0.0) * beta1 + one_m_b1 * g
        v = tl.load(v_ptr + offs, mask=mask, other=0.0) * beta2 + (one_m_b2 * g) * g
        denom = tl.div_rn(tl.sqrt_rn(v), sqrt_bc2) + eps
        x = w + tl.div_rn(step_size * m, denom)
        tl.store(m_ptr + offs, m, mask=mask)
        tl.store(v_ptr + offs, v, mask=mask)
        store_rounded(p_ptr, c_ptr, offs, x, mask, key, KAHAN)


@triton.jit
def _adam_bf16_kernel(
    table,
    n_tensors,
    inv_ptr,
    found_ptr,
    lr_ptr,
    p0,
    g0,
    m0,
    c0,
    s0,
    lr_hi,
    lr_lo,
    b1_hi,
    b1_lo,
    b2_hi,
    b2_lo,
    wd_hi,
    wd_lo,
    neg_lr,
    beta1,
    one_m_b1,
    beta2,
    one_m_b2,
    eps,
    wd,
    decay,
    ADAM_W: tl.constexpr,
    HAS_WD: tl.constexpr,
    BIAS_CORRECTION: tl.constexpr,
    KAHAN: tl.constexpr,
    HAS_INV: tl.constexpr,
    HAS_FOUND: tl.constexpr,
    HAS_LR_T: tl.constexpr,
    ROW: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    t, start, count = chunk_info(table, n_tensors, ROW, CHUNK)
    count = count * not_found(found_ptr, HAS_FOUND)
    key = tensor_col(table, t, 0, ROW).to(tl.uint32)
    lr, neg_lr, decay = learning_rate(lr_ptr, lr_hi, lr_lo, wd_hi, wd_lo, neg_lr, decay, HAS_LR_T)
    if BIAS_CORRECTION:
        step = step_of(table, t, 8, s0, ROW)
        bc1, bc2 = bias_corrections(step, join64(b1_hi, b1_lo), join64(b2_hi, b2_lo))
        step_size = (-lr / bc1).to(tl.float32)
        sqrt_bc2 = tl.sqrt(bc2).to(tl.float32)
    else:
        step_size = neg_lr
        sqrt_bc2 = tl.full((), 1.0, tl.float32)
    inv = load_scale(inv_ptr, HAS_INV)
    ok = aligned(table, t, 3, 7, ROW)
    for part in tl.static_range(2):  # the vector span, then the scalar rest (see _vector)
        lo, hi = span(part, count, ok)
        _adam_bf16_span(
            table,
            t,
            start,
            lo,
            hi,
            key,
            p0,
            g0,
            m0,
            c0,
            inv,
            step_size,
            sqrt_bc2,
            decay,
            beta1,
            one_m_b1,
            beta2,
            one_m_b2,
            eps,
            wd,
            ADAM_W,
            HAS_WD,
            KAHAN,
            HAS_INV,
            ROW,
            BLOCK,
            part == 0,
        )


def fused_adam_bf16_(args) -> None:
    """One pure-bf16 Adam/AdamW step: the semantics of
    :func:`mpnb.core.ops.adam.reference_fused_adam_bf16_`, whose arguments ``args`` holds by
    name (its per-tensor checks: :func:`~mpnb.core.ops.triton._optim.guard_step`); the bias
    corrections are computed on the device from the step counts.

    Example::

        >>> launcher("fused_adam_bf16_")(params, grads, m, v, [], steps, 1e-3, 0.9, 0.999,
        ...                              1e-8, 0.01, True, True, "stochastic", 1, 1)
    """
    params, grads, comps = args.params, args.grads, args.compensations
    exp_avgs, exp_avg_sqs, steps = args.exp_avgs, args.exp_avg_sqs, args.steps
    lr, beta1, beta2, weight_decay = args.lr, args.beta1, args.beta2, args.weight_decay
    inv_scale, found_inf, lr_tensor = args.inv_scale, args.found_inf, args.lr_tensor
    if not params:
        return
    ids = guard_step(args, "exp_avgs", "exp_avg_sqs", masters=None, rounding=True)
    check_flags(args)
    kahan = args.rounding == "kahan"
    c_list = comps if kahan else params
    tab = ChunkTable.build(
        [params, grads, exp_avgs, exp_avg_sqs, c_list, steps],
        cols=[keys_of(len(params), args.seed, args.rng_step, kahan)],
        ids=ids,
    )
    if tab.n_chunks:
        launch(
            _adam_bf16_kernel,
            (tab.n_chunks,),
            tab.table,
            tab.n_tensors,
            tab.table if inv_scale is None else inv_scale,
            tab.table if found_inf is None else flag_view(found_inf),
            tab.table if lr_tensor is None else lr_tensor,
            params[0],
            grads[0],
            exp_avgs[0],
            c_list[0],
            steps[0],
            *split64(lr),
            *split64(beta1),
            *split64(beta2),
            *split64(weight_decay),
            f32(-lr),
            f32(beta1),
            f32(1.0 - beta1),
            f32(beta2),
            f32(1.0 - beta2),
            f32(args.eps),
            f32(weight_decay),
            f32(1.0 - lr * weight_decay),
            ADAM_W=bool(args.adam_w_mode),
            HAS_WD=weight_decay != 0,
            BIAS_CORRECTION=bool(args.bias_correction),
            KAHAN=kahan,
            HAS_INV=inv_scale is not None,
            HAS_FOUND=found_inf is not None,
            HAS_LR_T=lr_tensor is not None,
            ROW=tab.row,
            CHUNK=tab.chunk,
            BLOCK=BLOCK,
            num_warps=WARPS,
        )
    advance_steps(tab, 8, steps, found_inf)


fused_adam_.guards_lists = fused_adam_bf16_.guards_lists = True
