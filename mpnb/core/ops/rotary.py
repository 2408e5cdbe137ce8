"""``mpnb::rope``: Apex's fused rotary position embedding, forward and backward in one op.

The op is :func:`rope` (``mpnb.core.ops.rope``); this module is ``mpnb.core.ops.rotary`` (the
family of ``csrc/cpu/rotary.cpp``), so the function never shadows its module. ``t`` is
``[s, b, h, d]`` (any strides), ``cos``/``sin`` are fp32 (fp64 for fp64 ``t``) tables
``[s, d2]``, ``d2 <= d``. The first ``d2`` channels form groups of ``group`` channels, each
rotated as ``rotate_half`` (``y = x * cos + rotate_half(x) * sin``); the other channels pass
through. ``backward=True`` applies the transposed rotation (the gradient), which is also the
op's autograd formula. ``transpose_output`` lays the result out as ``[b, s, h, d]`` in memory
(Apex's ``transpose_output_memory``), still shaped ``[s, b, h, d]``.

Rounding, the rule ``stepwise`` selects (the two differ for fp16/bf16 ``t`` only):

* ``stepwise=False`` (mpnb's default): computed in fp32 from the fp32 tables, rounded once to
  ``t``'s dtype; the more accurate result.
* ``stepwise=True``: Apex's kernel, and what ``t * cos + rotate_half(t) * sin`` gives in
  ``t``'s dtype: the tables are cast to ``t``'s dtype, each product and the sum are rounded to
  it (the backward alike, as autograd of that expression does).

Kernels: ``csrc/cpu/rotary.cpp`` (CPU); the reference elsewhere.
"""

from __future__ import annotations

import torch

from mpnb.core.ops._checks import acc_dtype, check_float
from mpnb.core.ops._library import Sample, Tensor, define

__all__ = ["rope", "reference_rope"]


def reference_rope(
    t: Tensor,
    cos: Tensor,
    sin: Tensor,
    group: int,
    transpose_output: bool = False,
    backward: bool = False,
    stepwise: bool = False,
) -> Tensor:
    """Rotate ``t`` by the position tables (differentiable in ``t``); see
    :mod:`mpnb.core.ops.rotary`. The reference computes in fp32 (fp64 for fp64); with
    ``stepwise`` it runs the ops of ``t * cos + rotate_half(t) * sin`` in ``t``'s dtype (torch
    rounds each one to it).

    Args:
        t: ``[s, b, h, d]`` (any strides; fp32, fp16, bf16 or fp64).
        cos, sin: ``[s, d2]`` tables, fp32 (fp64 for fp64 ``t``), ``d2 <= d``.
        group: channels per rotated group (even; ``d2`` a multiple of it).
        transpose_output: return a tensor laid out as ``[b, s, h, d]`` in memory.
        backward: apply the inverse (transposed) rotation.
        stepwise: round as Apex's kernel does (tables cast to ``t``'s dtype, each product and
            the sum rounded to it) instead of once from fp32.

    Example::

        >>> f = torch.arange(4.0)[:, None].expand(4, 8)
        >>> rope(torch.randn(4, 2, 3, 8), f.cos(), f.sin(), 8).shape
        torch.Size([4, 2, 3, 8])
    """
    acc = t.dtype if stepwise else acc_dtype(t)
    cos, sin = cos.to(acc), sin.to(acc)
    d2 = cos.shape[1]
    half = group // 2
    x = t.to(acc)
    xr = x[..., :d2].unflatten(-1, (d2 // group, 2, half))
    c = cos[:, None, None, :].unflatten(-1, (d2 // group, 2, half))
    s = sin[:, None, None, :].unflatten(-1, (d2 // group, 2, half))
    x1, x2 = xr[..., 0, :], xr[..., 1, :]
    if backward:
        y1 = x1 * c[..., 0, :] + x2 * s[..., 1, :]
        y2 = x2 * c[..., 1, :] - x1 * s[..., 0, :]
    else:
        y1 = x1 * c[..., 0, :] - x2 * s[..., 0, :]
        y2 = x2 * c[..., 1, :] + x1 * s[..., 1, :]
    y = torch.cat([torch.stack([y1, y2], -2).flatten(-3), x[..., d2:]], -1).to(t.dtype)
    return y.transpose(0, 1).contiguous().transpose(0, 1) if transpose_output else y


def _check(args, per_tensor: bool) -> None:
    op, t, cos, sin, group = args.op_name, args.t, args.cos, args.sin, args.group
    check_float(op, t, "t")
    if t.dim() != 4:
        raise ValueError(
            f"{op}: t must be [s, b, h, d], got shape {tuple(t.shape)}; add the missing dims "
            "(e.g. t.unsqueeze(1) for [s, h, d])."
        )
    acc = acc_dtype(t)
    s, _, _, d = t.shape
    for name, tab in (("cos", cos), ("sin", sin)):
        if tab.dim() != 2 or tab.shape[0] != s or tab.shape[1] > d or tab.dtype != acc:
            raise ValueError(
                f"{op}: {name} must be a {str(acc)[6:]} table [s={s}, d2<={d}], got "
                f"{tuple(tab.shape)} {tab.dtype}; the freqs/cos/sin must cover every position."
            )
        if tab.device != t.device:
            raise ValueError(
                f"{op}: {name} is on {tab.device} but t is on {t.device}; move both to one device."
            )
    if cos.shape != sin.shape:
        raise ValueError(
            f"{op}: cos {tuple(cos.shape)} and sin {tuple(sin.shape)} differ; build both "
            "from the same frequencies."
        )
    d2 = cos.shape[1]
    if group <= 0 or group % 2 or d2 % group:
        raise ValueError(
            f"{op}: the rotary dim {d2} must be a multiple of an even group, got "
            f"group={group}; use an even number of rotary channels."
        )


def _fake(args):
    t = args.t
    if args.transpose_output:
        s, b, h, d = t.shape
        return t.new_empty(b, s, h, d).transpose(0, 1)
    return t.new_empty(t.shape)


def _setup_context(ctx, args, output):
    ctx.group, ctx.backward, ctx.stepwise = args.group, args.backward, args.stepwise
    ctx.save_for_backward(args.cos, args.sin)


def _backward(ctx, grad_y):
    cos, sin = ctx.saved_tensors
    return {"t": _op(grad_y, cos, sin, ctx.group, False, not ctx.backward, ctx.stepwise)}


def _tables(s, d2, acc):
    inv = 1.0 / 10000 ** (torch.arange(0, d2, 2, dtype=torch.float64) / d2)
    f = torch.outer(torch.arange(s, dtype=torch.float64), inv)
    f = torch.cat([f, f], -1).to(acc)
    return f.cos(), f.sin()


def _samples(dtype):
    acc = acc_dtype(torch.empty(0, dtype=dtype))

    def make(shape, d2, seed, grad=False):
        g = torch.Generator().manual_seed(seed)
        t = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
        cos, sin = _tables(shape[0], d2, acc)
        return dict(t=t.requires_grad_(True) if grad else t, cos=cos, sin=sin)

    # opcheck runs the first sample: its layout (and rounding rule) differs across the dtypes
    first = dtype in (torch.float32, torch.bfloat16)
    opcheck = dict(group=8, transpose_output=first, backward=False, stepwise=not first)
    yield Sample(make((4, 2, 3, 10), 8, 0, grad=True) | opcheck, name="opcheck")
    for d, d2 in ((64, 64), (64, 32), (6, 2), (130, 66)):
        for transpose in (False, True):
            for backward in (False, True):
                for stepwise in (False, True):
                    kw = dict(group=d2, transpose_output=transpose, backward=backward)
                    kw |= dict(stepwise=stepwise)
                    name = f"d={d} d2={d2} transpose={transpose} backward={backward}"
                    yield Sample(
                        make((7, 3, 2, d), d2, d + d2) | kw, name=name + " stepwise" * stepwise
                    )
    for stepwise in (False, True):
        kw = make((9, 3, 4, 32), 32, 1) | dict(group=16, stepwise=stepwise)  # two groups of 16
        yield Sample(kw, name=f"two groups {stepwise=}")
    kw = make((3, 9, 4, 32), 32, 2)
    kw |= dict(t=kw["t"].transpose(0, 1), cos=_tables(9, 32, acc)[0], sin=_tables(9, 32, acc)[1])
    yield Sample(kw | dict(group=32, stepwise=True), name="strided t, stepwise")  # bshd memory
    yield Sample(make((0, 2, 3, 8), 8, 3) | dict(group=8), name="empty")


OP = define(
    reference_rope,
    family="rotary",
    check=_check,
    fake=_fake,
    triton="rotary",
    autograd=(_backward, _setup_context),
    sample_inputs=_samples,  # kernel and reference agree bitwise (the same products and sums)
)
rope = OP.wrapper
_op = OP.overload  # the autograd formula calls the op itself (its inputs are checked)
