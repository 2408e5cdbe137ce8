"""``fused_lamb_`` and ``fused_lamb_bf16_`` in Triton: one LAMB step over lists, in two phases.

Phase 1 (one program per chunk) reads the (half) grad, the weight and both moments, writes the
new moments and each chunk's sums of ``w**2`` and ``u**2`` (``u`` the Adam-style update) in
fp64; the chunks of each tensor are then added in order (the per-tensor norms). Phase 2
recomputes ``u`` from the stored moments (the same operations, so the same values) and applies
the trust ratio ``||w|| / ||u||``, writing the fp32 master and the rounded half param, or, for
the pure-bf16 op (``ROUNDING``), the new weight rounded stochastically or with Kahan summation
into the bf16 param. A set ``found_inf`` writes nothing; everything stays on the device.

Both ops launch the same two kernels, by keyword from the op's arguments
(:class:`~mpnb.core.ops.triton._optim.OpKernel`), so an argument added to the op reaches a
kernel that names it without a change to the launchers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mpnb.core.ops.triton._chunks import ChunkTable, chunk_info, segment_sums
from mpnb.core.ops.triton._common import f32, join64, to_acc
from mpnb.core.ops.triton._optim import (
    OpKernel,
    advance_steps,
    bias_corrections,
    guard_step,
    load_grad,
    load_scale,
    load_weight,
    not_found,
    step_of,
    store_step,
)
from mpnb.core.ops.triton._rounding import RNG_WORDS, key_of, rng_words, rounding_code
from mpnb.core.ops.triton._vector import aligned, column_ptr, span, span_mask, span_start

__all__ = ["fused_lamb_", "fused_lamb_bf16_"]

# Table columns: numel, first chunk, then (P = 2) params, (P+1) grads, (P+2) exp_avgs,
# (P+3) exp_avg_sqs, (P+4) the weights W and (P+5) steps. fused_lamb_: W the fp32 weights
# (masters, or the params themselves); fused_lamb_bf16_ (ROUNDING): W the compensations (the
# params for stochastic rounding), the random-bit keys computed on the device (key_of).


@triton.jit
def _corrections(
    table, t, s0, b1_hi, b1_lo, b2_hi, b2_lo, BIAS: tl.constexpr, S: tl.constexpr, ROW: tl.constexpr
):
    if BIAS:
        step = step_of(table, t, S, s0, ROW)
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
    HAS_MASTERS: tl.constexpr,
    HAS_INV_SCALE: tl.constexpr,
    P: tl.constexpr,
    ROW: tl.constexpr,
    BLOCK: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    # Phase 1 on the elements [lo, hi) of the chunk; returns the running squares' lanes.
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
    ratio,
    bc1,
    bc2,
    eps,
    wd,
    DECOUPLED: tl.constexpr,
    HAS_MASTERS: tl.constexpr,
    ROUNDING: tl.constexpr,
    P: tl.constexpr,
    ROW: tl.constexpr,
    BLOCK: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    # Phase 2 on the elements [lo, hi): the new weight written (ROUNDING: rounded to bf16,
    # the W column holding the compensations).
    p_ptr = column_ptr(table, t, P, p0, ROW, ALIGNED)
    m_ptr = column_ptr(table, t, P + 2, m0, ROW, ALIGNED)
    v_ptr = column_ptr(table, t, P + 3, m0, ROW, ALIGNED)
    w_ptr = column_ptr(table, t, P + 4, w0, ROW, ALIGNED)
    lanes = tl.arange(0, BLOCK)
    for k in range(span_start(lo, BLOCK), hi, BLOCK):
        offs = start + k + lanes
        mask = span_mask(k, lanes, lo, hi)
        m = tl.load(m_ptr + offs, mask=mask, other=0.0)
        v = tl.load(v_ptr + offs, mask=mask, other=0.0)
        w = load_weight(p_ptr, w_ptr, offs, mask, HAS_MASTERS)
        w = w - ratio * _update(m, v, w, bc1, bc2, eps, wd, DECOUPLED)
        store_step(p_ptr, w_ptr, offs, w, mask, key, HAS_MASTERS, ROUNDING)


@triton.jit
def _lamb_phase1(
    table,
    n_tensors,
    inv_scale,
    found_inf,
    global_grad_norm,
    partials,
    p0,
    g0,
    m0,
    w0,
    s0,
    beta1,
    beta1_hi,
    beta1_lo,
    beta2,
    beta2_hi,
    beta2_lo,
    beta3,
    one_m_beta2,
    eps,
    weight_decay,
    max_grad_norm,
    max_grad_norm_hi,
    max_grad_norm_lo,
    ADAM_W_MODE: tl.constexpr,
    BIAS_CORRECTION: tl.constexpr,
    HAS_WEIGHT_DECAY: tl.constexpr,
    HAS_INV_SCALE: tl.constexpr,
    HAS_FOUND_INF: tl.constexpr,
    ROW: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_MASTERS: tl.constexpr = False,
):
    P: tl.constexpr = 2  # the first list's column
    t, start, count = chunk_info(table, n_tensors, ROW, CHUNK)
    count = count * not_found(found_inf, HAS_FOUND_INF)
    bc1, bc2 = _corrections(
        table, t, s0, beta1_hi, beta1_lo, beta2_hi, beta2_lo, BIAS_CORRECTION, P + 5, ROW
    )
    gn = to_acc(tl.load(global_grad_norm), tl.float32)
    mx = join64(max_grad_norm_hi, max_grad_norm_lo)
    clipped = (mx > 0.0) & (mx < gn.to(tl.float64))
    clip = tl.where(clipped, tl.div_rn(gn, tl.cast(max_grad_norm, tl.float32)), 1.0)
    inv = load_scale(inv_scale, HAS_INV_SCALE)
    w_sq = tl.zeros([BLOCK], dtype=tl.float64)
    u_sq = tl.zeros([BLOCK], dtype=tl.float64)
    ok = aligned(table, t, P, P + 4, ROW)
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
            one_m_beta2,
            eps,
            weight_decay,
            w_sq,
            u_sq,
            HAS_WEIGHT_DECAY and not ADAM_W_MODE,
            HAS_WEIGHT_DECAY and ADAM_W_MODE,
            HAS_MASTERS,
            HAS_INV_SCALE,
            P,
            ROW,
            BLOCK,
            part == 0,
        )
    c = tl.program_id(0)
    tl.store(partials + 2 * c, tl.sum(w_sq, axis=0))
    tl.store(partials + 2 * c + 1, tl.sum(u_sq, axis=0))


@triton.jit(do_not_specialize=RNG_WORDS)
def _lamb_phase2(
    table,
    n_tensors,
    found_inf,
    sq,
    p0,
    m0,
    w0,
    s0,
    lr,
    beta1_hi,
    beta1_lo,
    beta2_hi,
    beta2_lo,
    eps,
    weight_decay,
    ADAM_W_MODE: tl.constexpr,
    BIAS_CORRECTION: tl.constexpr,
    USE_NVLAMB: tl.constexpr,
    HAS_WEIGHT_DECAY: tl.constexpr,
    HAS_FOUND_INF: tl.constexpr,
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
    bc1, bc2 = _corrections(
        table, t, s0, beta1_hi, beta1_lo, beta2_hi, beta2_lo, BIAS_CORRECTION, P + 5, ROW
    )
    ratio = _trust_ratio(sq, t, lr, USE_NVLAMB or HAS_WEIGHT_DECAY)
    ok = aligned(table, t, P, P + 4, ROW)
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
            w0,
            ratio,
            bc1,
            bc2,
            eps,
            weight_decay,
            HAS_WEIGHT_DECAY and ADAM_W_MODE,
            HAS_MASTERS,
            ROUNDING,
            P,
            ROW,
            BLOCK,
            part == 0,
        )


_PHASE1 = OpKernel(_lamb_phase1)
_PHASE2 = OpKernel(_lamb_phase2)


def _step(args, ids, weights: list, **rounding) -> None:
    """Both ops' launch after their checks (``ids``: the lists' ids): the chunk table of the
    lists with ``weights`` fifth, both phases (the second with the pure-bf16 op's keywords
    ``rounding``: its ``ROUNDING`` and random-bit words), the step counts."""
    params, steps = args.params, args.steps
    lists = [params, args.grads, args.exp_avgs, args.exp_avg_sqs, weights, steps]
    tab = ChunkTable.build(lists, ids=ids)
    if tab.n_chunks:
        given = dict(p0=params[0], m0=args.exp_avgs[0], w0=weights[0], s0=steps[0])
        partials = torch.empty((tab.n_chunks, 2), dtype=torch.float64, device=params[0].device)
        beta3 = f32(1.0 - args.beta1 if args.grad_averaging else 1.0)
        _PHASE1(tab, args, partials=partials, g0=args.grads[0], beta3=beta3, **given)
        _PHASE2(tab, args, sq=segment_sums(tab, partials, 2), **rounding, **given)
    advance_steps(tab, tab.row - 1, steps, args.found_inf)


def fused_lamb_(args) -> None:
    """One LAMB step over lists, in place: the semantics of
    :func:`mpnb.core.ops.lamb.reference_fused_lamb_`, whose arguments ``args`` holds by name
    (its per-tensor checks: :func:`~mpnb.core.ops.triton._optim.guard_step`).

    Example::

        >>> launcher("fused_lamb_")(params, grads, exp_avgs, exp_avg_sqs, masters, steps,
        ...                         grad_norm, 1e-3, 0.9, 0.999, 1e-6, 0.01)
    """
    if not args.params:
        return
    ids = guard_step(args, "exp_avgs", "exp_avg_sqs")
    _step(args, ids, args.masters or args.params)


def fused_lamb_bf16_(args) -> None:
    """One pure-bf16 LAMB step: the semantics of
    :func:`mpnb.core.ops.lamb.reference_fused_lamb_bf16_`, whose arguments ``args`` holds by
    name (its per-tensor checks: :func:`~mpnb.core.ops.triton._optim.guard_step`); the
    rounding is bitwise the reference's, the trust ratio's norms are tree sums (not the
    reference's fixed sequential blocks: the trust ratio, and so the update, may differ from
    the reference's by an fp32 ulp).

    Example::

        >>> launcher("fused_lamb_bf16_")(params, grads, m, v, [], steps, grad_norm, 1e-3, 0.9,
        ...                              0.999, 1e-6, 0.01, True, True, True, 1.0, False,
        ...                              "stochastic", 1, 1)
    """
    if not args.params:
        return
    ids = guard_step(args, "exp_avgs", "exp_avg_sqs", masters=None, rounding=True)
    weights = args.compensations if args.rounding == "kahan" else args.params
    rounding = rounding_code(args.rounding)
    _step(args, ids, weights, ROUNDING=rounding, **rng_words(args.seed, args.rng_step))


fused_lamb_.guards_lists = fused_lamb_bf16_.guards_lists = True
