"""``fused_lamb_`` in Triton: one LAMB step over lists, in two phases.

Phase 1 (one program per chunk) reads the (half) grad, the weight and both moments, writes the
new moments and each chunk's sums of ``w**2`` and ``u**2`` (``u`` the Adam-style update) in
fp64; the chunks of each tensor are then added in order (the per-tensor norms). Phase 2
recomputes ``u`` from the stored moments (the same operations, so the same values) and applies
the trust ratio ``||w|| / ||u||``, writing the fp32 master and the rounded half param. A set
``found_inf`` writes nothing; everything stays on the device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mpnb.core.ops.triton._checks import check_same_device
from mpnb.core.ops.triton._chunks import (
    BLOCK,
    WARPS,
    ChunkTable,
    chunk_info,
    segment_sums,
    upload,
)
from mpnb.core.ops.triton._common import f32, flag_view, join64, launch, split64, to_acc
from mpnb.core.ops.triton._optim import (
    advance_steps,
    bias_corrections,
    guard_step,
    load_grad,
    load_scale,
    load_weight,
    not_found,
    step_of,
    store_weight,
)
from mpnb.core.ops.triton._rounding import keys_of, store_rounded
from mpnb.core.ops.triton._vector import aligned, column_ptr, span, span_mask, span_start

__all__ = ["fused_lamb_", "fused_lamb_bf16_"]

# Table columns: numel, first chunk, then (2) params, (3) grads, (4) exp_avgs, (5) exp_avg_sqs,
# (6) the fp32 weights (masters, or the params themselves) and (7) steps.


@triton.jit
def _corrections(table, t, s0, b1_hi, b1_lo, b2_hi, b2_lo, BIAS: tl.constexpr, ROW: tl.constexpr):
    if BIAS:
        step = step_of(table, t, 7, s0, ROW)
        bc1, bc2 = bias_corrections(step, join64(b1_hi, b1_lo), join64(b2_hi, b2_lo))
        out1, out2 = bc1.to(tl.float32), bc2.to(tl.float32)
    else:
        out1, out2 = tl.full((), 1.0, tl.float32), tl.full((), 1.0, tl.float32)
    return out1, out2


@triton.jit
def _update(m, v, w, bc1, bc2, eps, wd, DECOUPLED: tl.constexpr):
    # u = (m / bc1) / (sqrt(v / bc2) + eps) (+ wd * w): LAMB's Adam-style direction.
    u = tl.div_rn(tl.div_rn(m, bc1), tl.sqrt_rn(tl.div_rn(v, bc2)) + eps)
    if DECOUPLED:
        u = u + wd * w
    return u


@triton.jit
def _trust_ratio(sq, t, lr, TRUST: tl.constexpr):
    # lr * ||w|| / ||u|| from the tensor's sums of squares (lr when a norm is 0, or no TRUST).
    ratio = tl.cast(lr, tl.float32)
    if TRUST:
        pn = tl.sqrt(tl.load(sq + 2 * t)).to(tl.float32)
        un = tl.sqrt(tl.load(sq + 2 * t + 1)).to(tl.float32)
        ratio = tl.where((pn != 0.0) & (un != 0.0), ratio * tl.div_rn(pn, un), ratio)
    return ratio


@triton.jit
def _phase1_span(
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
    clip,
    bc1,
    bc2,
    beta1,
    beta3,
    beta2,
    one_m_b2,
    eps,
    wd,
    w_sq,
    u_sq,
    L2_WD: tl.constexpr,
    DECOUPLED: tl.constexpr,
    HAS_MASTER: tl.constexpr,
    HAS_INV: tl.constexpr,
    ROW: tl.constexpr,
    BLOCK: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    # Phase 1 on the elements [lo, hi) of the chunk; returns the running squares' lanes.
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
        g = tl.div_rn(g, clip)
        if L2_WD:
            g = g + wd * w
        m = tl.load(m_ptr + offs, mask=mask, other=0.0) * beta1 + beta3 * g
        v = tl.load(v_ptr + offs, mask=mask, other=0.0) * beta2 + one_m_b2 * g * g
        tl.store(m_ptr + offs, m, mask=mask)
        tl.store(v_ptr + offs, v, mask=mask)
        u = tl.where(mask, _update(m, v, w, bc1, bc2, eps, wd, DECOUPLED), 0.0)
        w64 = w.to(tl.float64)
        u64 = u.to(tl.float64)
        w_sq += w64 * w64
        u_sq += u64 * u64
    return w_sq, u_sq


@triton.jit
def _phase2_span(
    table,
    t,
    start,
    lo,
    hi,
    key,
    p0,
    m0,
    w0,
    c0,
    ratio,
    bc1,
    bc2,
    eps,
    wd,
    DECOUPLED: tl.constexpr,
    HAS_MASTER: tl.constexpr,
    ROUND: tl.constexpr,
    KAHAN: tl.constexpr,
    C_COL: tl.constexpr,
    ROW: tl.constexpr,
    BLOCK: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    # Phase 2 on the elements [lo, hi): the fp32 weight written (ROUND: rounded to bf16).
    p_ptr = column_ptr(table, t, 2, p0, ROW, ALIGNED)
    m_ptr = column_ptr(table, t, 4, m0, ROW, ALIGNED)
    v_ptr = column_ptr(table, t, 5, m0, ROW, ALIGNED)
    w_ptr = column_ptr(table, t, 6, w0, ROW, ALIGNED)
    lanes = tl.arange(0, BLOCK)
    for k in range(span_start(lo, BLOCK), hi, BLOCK):
        offs = start + k + lanes
        mask = span_mask(k, lanes, lo, hi)
        m = tl.load(m_ptr + offs, mask=mask, other=0.0)
        v = tl.load(v_ptr + offs, mask=mask, other=0.0)
        if ROUND:
            w = load_weight(p_ptr, p_ptr, offs, mask, False)
            x = w - ratio * _update(m, v, w, bc1, bc2, eps, wd, DECOUPLED)
            c_ptr = column_ptr(table, t, C_COL, c0, ROW, ALIGNED)
            store_rounded(p_ptr, c_ptr, offs, x, mask, key, KAHAN)
        else:
            w = load_weight(p_ptr, w_ptr, offs, mask, HAS_MASTER)
            w = w - ratio * _update(m, v, w, bc1, bc2, eps, wd, DECOUPLED)
            store_weight(p_ptr, w_ptr, offs, w, mask, HAS_MASTER)


@triton.jit
def _lamb_phase1(
    table,
    n_tensors,
    inv_ptr,
    found_ptr,
    gnorm_ptr,
    partials,
    p0,
    g0,
    m0,
    w0,
    s0,
    b1_hi,
    b1_lo,
    b2_hi,
    b2_lo,
    mx_hi,
    mx_lo,
    max_norm,
    beta1,
    beta3,
    beta2,
    one_m_b2,
    eps,
    wd,
    L2_WD: tl.constexpr,
    DECOUPLED: tl.constexpr,
    BIAS: tl.constexpr,
    HAS_MASTER: tl.constexpr,
    HAS_INV: tl.constexpr,
    HAS_FOUND: tl.constexpr,
    ROW: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    t, start, count = chunk_info(table, n_tensors, ROW, CHUNK)
    count = count * not_found(found_ptr, HAS_FOUND)
    bc1, bc2 = _corrections(table, t, s0, b1_hi, b1_lo, b2_hi, b2_lo, BIAS, ROW)
    gn = to_acc(tl.load(gnorm_ptr), tl.float32)
    mx = join64(mx_hi, mx_lo)
    clipped = (mx > 0.0) & (mx < gn.to(tl.float64))
    clip = tl.where(clipped, tl.div_rn(gn, tl.cast(max_norm, tl.float32)), 1.0)
    inv = load_scale(inv_ptr, HAS_INV)
    w_sq = tl.zeros([BLOCK], dtype=tl.float64)
    u_sq = tl.zeros([BLOCK], dtype=tl.float64)
    ok = aligned(table, t, 2, 6, ROW)
    for part in tl.static_range(2):  # the vector span, then the scalar rest (see _vector)
        lo, hi = span(part, count, ok)
        w_sq, u_sq = _phase1_span(
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
            clip,
            bc1,
            bc2,
            beta1,
            beta3,
            beta2,
            one_m_b2,
            eps,
            wd,
            w_sq,
            u_sq,
            L2_WD,
            DECOUPLED,
            HAS_MASTER,
            HAS_INV,
            ROW,
            BLOCK,
            part == 0,
        )
    c = tl.program_id(0)
    tl.store(partials + 2 * c, tl.sum(w_sq, axis=0))
    tl.store(partials + 2 * c + 1, tl.sum(u_sq, axis=0))


@triton.jit
def _lamb_phase2(
    table,
    n_tensors,
    found_ptr,
    sq,
    p0,
    m0,
    w0,
    s0,
    b1_hi,
    b1_lo,
    b2_hi,
    b2_lo,
    lr,
    eps,
    wd,
    TRUST: tl.constexpr,
    DECOUPLED: tl.constexpr,
    BIAS: tl.constexpr,
    HAS_MASTER: tl.constexpr,
    HAS_FOUND: tl.constexpr,
    ROW: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    t, start, count = chunk_info(table, n_tensors, ROW, CHUNK)
    count = count * not_found(found_ptr, HAS_FOUND)
    bc1, bc2 = _corrections(table, t, s0, b1_hi, b1_lo, b2_hi, b2_lo, BIAS, ROW)
    ratio = _trust_ratio(sq, t, lr, TRUST)
    ok = aligned(table, t, 2, 6, ROW)
    for part in tl.static_range(2):  # the vector span, then the scalar rest (see _vector)
        lo, hi = span(part, count, ok)
        _phase2_span(
            table,
            t,
            start,
            lo,
            hi,
            0,
            p0,
            m0,
            w0,
            w0,
            ratio,
            bc1,
            bc2,
            eps,
            wd,
            DECOUPLED,
            HAS_MASTER,
            False,
            False,
            6,
            ROW,
            BLOCK,
            part == 0,
        )


def fused_lamb_(args) -> None:
    """One LAMB step over lists, in place: the semantics of
    :func:`mpnb.core.ops.lamb.reference_fused_lamb_`, whose arguments ``args`` holds by name
    (its per-tensor checks: :func:`~mpnb.core.ops.triton._optim.guard_step`).

    Example::

        >>> launcher("fused_lamb_")(params, grads, exp_avgs, exp_avg_sqs, masters, steps,
        ...                         grad_norm, 1e-3, 0.9, 0.999, 1e-6, 0.01)
    """
    params, grads, masters = args.params, args.grads, args.masters
    exp_avgs, exp_avg_sqs, steps = args.exp_avgs, args.exp_avg_sqs, args.steps
    global_grad_norm, lr, beta1, beta2 = args.global_grad_norm, args.lr, args.beta1, args.beta2
    eps, weight_decay, max_grad_norm = args.eps, args.weight_decay, args.max_grad_norm
    inv_scale, found_inf = args.inv_scale, args.found_inf
    if not params:
        return
    ids = guard_step(args, "exp_avgs", "exp_avg_sqs")
    flags = dict(global_grad_norm=global_grad_norm, inv_scale=inv_scale, found_inf=found_inf)
    check_same_device(args.op_name, params[0], **flags)
    w_list = masters if masters else params
    tab = ChunkTable.build([params, grads, exp_avgs, exp_avg_sqs, w_list, steps], ids=ids)
    found = tab.table if found_inf is None else flag_view(found_inf)
    decoupled = weight_decay != 0 and bool(args.adam_w_mode)
    bias = (*split64(beta1), *split64(beta2))
    if tab.n_chunks:
        partials = torch.empty((tab.n_chunks, 2), dtype=torch.float64, device=params[0].device)
        beta3 = 1.0 - beta1 if args.grad_averaging else 1.0
        launch(
            _lamb_phase1,
            (tab.n_chunks,),
            tab.table,
            tab.n_tensors,
            tab.table if inv_scale is None else inv_scale,
            found,
            global_grad_norm,
            partials,
            params[0],
            grads[0],
            exp_avgs[0],
            w_list[0],
            steps[0],
            *bias,
            *split64(max_grad_norm),
            f32(max_grad_norm),
            f32(beta1),
            f32(beta3),
            f32(beta2),
            f32(1.0 - beta2),
            f32(eps),
            f32(weight_decay),
            L2_WD=weight_decay != 0 and not args.adam_w_mode,
            DECOUPLED=decoupled,
            BIAS=bool(args.bias_correction),
            HAS_MASTER=bool(masters),
            HAS_INV=inv_scale is not None,
            HAS_FOUND=found_inf is not None,
            ROW=tab.row,
            CHUNK=tab.chunk,
            BLOCK=BLOCK,
            num_warps=WARPS,
        )
        sq = segment_sums(tab, partials, 2)
        launch(
            _lamb_phase2,
            (tab.n_chunks,),
            tab.table,
            tab.n_tensors,
            found,
            sq,
            params[0],
            exp_avgs[0],
            w_list[0],
            steps[0],
            *bias,
            f32(lr),
            f32(eps),
            f32(weight_decay),
            TRUST=bool(args.use_nvlamb) or weight_decay != 0,
            DECOUPLED=decoupled,
            BIAS=bool(args.bias_correction),
            HAS_MASTER=bool(masters),
            HAS_FOUND=found_inf is not None,
            ROW=tab.row,
            CHUNK=tab.chunk,
            BLOCK=BLOCK,
            num_warps=WARPS,
        )
    advance_steps(tab, 7, steps, found_inf)


# ---- pure bf16: stochastic rounding or Kahan summation ------------------------------------
# The table of fused_lamb_ (the params are the weights) plus (8) the compensations (the params
# for stochastic rounding); phase 1 is fused_lamb_'s, phase 2 rounds the new weights to bf16.
# The norms are tree sums here, not the reference's fixed sequential blocks: the trust ratio
# (and so the update) may differ by an fp32 ulp from the reference's.


@triton.jit
def _lamb_bf16_phase2(
    table,
    n_tensors,
    found_ptr,
    sq,
    keys,
    p0,
    m0,
    c0,
    s0,
    b1_hi,
    b1_lo,
    b2_hi,
    b2_lo,
    lr,
    eps,
    wd,
    TRUST: tl.constexpr,
    DECOUPLED: tl.constexpr,
    BIAS: tl.constexpr,
    KAHAN: tl.constexpr,
    HAS_FOUND: tl.constexpr,
    ROW: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    t, start, count = chunk_info(table, n_tensors, ROW, CHUNK)
    count = count * not_found(found_ptr, HAS_FOUND)
    key = tl.load(keys + t).to(tl.uint32)
    bc1, bc2 = _corrections(table, t, s0, b1_hi, b1_lo, b2_hi, b2_lo, BIAS, ROW)
    ratio = _trust_ratio(sq, t, lr, TRUST)
    ok = aligned(table, t, 2, 6, ROW) & aligned(table, t, 8, 8, ROW)  # (7: the steps)
    for part in tl.static_range(2):  # the vector span, then the scalar rest (see _vector)
        lo, hi = span(part, count, ok)
        _phase2_span(
            table,
            t,
            start,
            lo,
            hi,
            key,
            p0,
            m0,
            p0,
            c0,
            ratio,
            bc1,
            bc2,
            eps,
            wd,
            DECOUPLED,
            False,
            True,
            KAHAN,
            8,
            ROW,
            BLOCK,
            part == 0,
        )


def fused_lamb_bf16_(args) -> None:
    """One pure-bf16 LAMB step: the semantics of
    :func:`mpnb.core.ops.lamb.reference_fused_lamb_bf16_`, whose arguments ``args`` holds by
    name (its per-tensor checks: :func:`~mpnb.core.ops.triton._optim.guard_step`); the
    rounding is bitwise the reference's, the trust ratio's norms are tree sums.

    Example::

        >>> launcher("fused_lamb_bf16_")(params, grads, m, v, [], steps, grad_norm, 1e-3, 0.9,
        ...                              0.999, 1e-6, 0.01, True, True, True, 1.0, False,
        ...                              "stochastic", 1, 1)
    """
    params, grads, comps = args.params, args.grads, args.compensations
    exp_avgs, exp_avg_sqs, steps = args.exp_avgs, args.exp_avg_sqs, args.steps
    global_grad_norm, lr, beta1, beta2 = args.global_grad_norm, args.lr, args.beta1, args.beta2
    eps, weight_decay, max_grad_norm = args.eps, args.weight_decay, args.max_grad_norm
    inv_scale, found_inf = args.inv_scale, args.found_inf
    if not params:
        return
    ids = guard_step(args, "exp_avgs", "exp_avg_sqs", masters=None, rounding=True)
    flags = dict(global_grad_norm=global_grad_norm, inv_scale=inv_scale, found_inf=found_inf)
    check_same_device(args.op_name, params[0], **flags)
    kahan = args.rounding == "kahan"
    c_list = comps if kahan else params
    dev = params[0].device
    keys = keys_of(len(params), args.seed, args.rng_step, kahan)
    keys = upload(torch.tensor(keys, dtype=torch.int64), dev)  # no host wait
    tab = ChunkTable.build([params, grads, exp_avgs, exp_avg_sqs, params, steps, c_list], ids=ids)
    found = tab.table if found_inf is None else flag_view(found_inf)
    decoupled = weight_decay != 0 and bool(args.adam_w_mode)
    bias = (*split64(beta1), *split64(beta2))
    if tab.n_chunks:
        partials = torch.empty((tab.n_chunks, 2), dtype=torch.float64, device=dev)
        beta3 = 1.0 - beta1 if args.grad_averaging else 1.0
        launch(
            _lamb_phase1,
            (tab.n_chunks,),
            tab.table,
            tab.n_tensors,
            tab.table if inv_scale is None else inv_scale,
            found,
            global_grad_norm,
            partials,
            params[0],
            grads[0],
            exp_avgs[0],
            params[0],
            steps[0],
            *bias,
            *split64(max_grad_norm),
            f32(max_grad_norm),
            f32(beta1),
            f32(beta3),
            f32(beta2),
            f32(1.0 - beta2),
            f32(eps),
            f32(weight_decay),
            L2_WD=weight_decay != 0 and not args.adam_w_mode,
            DECOUPLED=decoupled,
            BIAS=bool(args.bias_correction),
            HAS_MASTER=False,
            HAS_INV=inv_scale is not None,
            HAS_FOUND=found_inf is not None,
            ROW=tab.row,
            CHUNK=tab.chunk,
            BLOCK=BLOCK,
            num_warps=WARPS,
        )
        sq = segment_sums(tab, partials, 2)
        launch(
            _lamb_bf16_phase2,
            (tab.n_chunks,),
            tab.table,
            tab.n_tensors,
            found,
            sq,
            keys,
            params[0],
            exp_avgs[0],
            c_list[0],
            steps[0],
            *bias,
            f32(lr),
            f32(eps),
            f32(weight_decay),
            TRUST=bool(args.use_nvlamb) or weight_decay != 0,
            DECOUPLED=decoupled,
            BIAS=bool(args.bias_correction),
            KAHAN=kahan,
            HAS_FOUND=found_inf is not None,
            ROW=tab.row,
            CHUNK=tab.chunk,
            BLOCK=BLOCK,
            num_warps=WARPS,
        )
    advance_steps(tab, 7, steps, found_inf)


fused_lamb_.guards_lists = fused_lamb_bf16_.guards_lists = True
