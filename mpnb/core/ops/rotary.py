"""``mpnb::rope``: Apex's fused rotary position embedding, forward and backward in one op.

The op is :func:`rope` (``mpnb.core.ops.rope``); this module is ``mpnb.core.ops.rotary`` (the
family of ``csrc/cpu/rotary.cpp``), so the function never shadows its module. ``cos``/``sin``
are fp32 (fp64 for fp64 ``t``) tables ``[s, d2]``, ``d2 <= d``. The first ``d2`` channels form
groups of ``group`` channels, each rotated as ``rotate_half`` (``y = x * cos +
rotate_half(x) * sin``); the other channels pass through. ``backward=True`` applies the
transposed rotation (the gradient), which is also the op's autograd formula.

Layouts: ``layout`` names ``t``'s dims, one of :data:`LAYOUTS`: ``"sbhd"`` (Apex's, the
default), ``"bshd"`` or ``"bhsd"`` (what attention code holds). ``t`` may be contiguous or any
strided view whose last dim has stride 1 (``x.transpose(1, 2)`` of a ``[b, s, h, d]`` tensor
passed as ``"bhsd"``, ``x.permute(2, 0, 1, 3)`` of a ``[b, h, s, d]`` one passed as ``"sbhd"``,
the heads sliced out of a fused QKV tensor...): the CPU kernel walks the rows in ``t``'s memory
order (positions in blocks where ``s`` is the fastest dim), so every layout and view runs at
the speed of the contiguous ``[s, b, h, d]`` case and nothing is copied (only a last dim of
another stride is copied first).

The output has ``t``'s shape and memory layout: the strides of ``torch.empty_like(t)`` (``t``'s
own when ``t`` is dense, contiguous or a permutation of a contiguous tensor; otherwise dense,
its dims in ``t``'s memory order), contiguous where those would not leave ``d`` innermost.
``transpose_output`` (``"sbhd"`` only) lays it out as ``[b, s, h, d]`` in memory instead
(Apex's ``transpose_output_memory``).

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

__all__ = ["rope", "reference_rope", "LAYOUTS"]

#: The layouts of ``t`` the op accepts: the order of its dims (``d`` last, stride 1).
LAYOUTS = ("sbhd", "bshd", "bhsd")


def _sbhd(layout: str) -> list[int]:
    """The permutation that views a ``layout`` tensor as ``[s, b, h, d]``."""
    return [layout.index(c) for c in "sbhd"]


def _output(t: Tensor, transpose_output: bool) -> Tensor:
    """The op's result, uninitialized: laid out as ``t`` (``torch.empty_like``) unless that
    gives ``d`` a stride other than 1 (a ``t`` whose last dim is not its innermost: then
    contiguous), or as ``[b, s, h, d]`` with ``transpose_output``. The CPU kernel, the Triton
    launcher and the fake allocate by this rule."""
    if transpose_output:
        s, b, h, d = t.shape
        return t.new_empty(b, s, h, d).transpose(0, 1)
    out = torch.empty_like(t)
    return out if out.stride(-1) == 1 else t.new_empty(t.shape)


def reference_rope(
    t: Tensor,
    cos: Tensor,
    sin: Tensor,
    group: int,
    transpose_output: bool = False,
    backward: bool = False,
    stepwise: bool = False,
    *,
    layout: str = "sbhd",
) -> Tensor:
    """Rotate ``t`` by the position tables (differentiable in ``t``); see
    :mod:`mpnb.core.ops.rotary`. The reference computes in fp32 (fp64 for fp64); with
    ``stepwise`` it runs the ops of ``t * cos + rotate_half(t) * sin`` in ``t``'s dtype (torch
    rounds each one to it).

    Args:
        t: ``[s, b, h, d]``, ``[b, s, h, d]`` or ``[b, h, s, d]`` as ``layout`` says,
            contiguous or a strided view (fp32, fp16, bf16 or fp64).
        cos, sin: ``[s, d2]`` tables, fp32 (fp64 for fp64 ``t``), ``d2 <= d``.
        group: channels per rotated group (even; ``d2`` a multiple of it).
        transpose_output: return a tensor laid out as ``[b, s, h, d]`` in memory
            (``layout="sbhd"`` only); otherwise the output has ``t``'s memory layout.
        backward: apply the inverse (transposed) rotation.
        stepwise: round as Apex's kernel does (tables cast to ``t``'s dtype, each product and
            the sum rounded to it) instead of once from fp32.
        layout: the order of ``t``'s dims, one of :data:`LAYOUTS`.

    Returns:
        The rotated tensor, shaped as ``t`` and laid out in memory as ``t`` (the strides of
        ``torch.empty_like(t)``; contiguous where those would not leave ``d`` innermost), or
        as ``[b, s, h, d]`` with ``transpose_output``.

    Example::

        >>> f = torch.arange(4.0)[:, None].expand(4, 8)
        >>> rope(torch.randn(4, 2, 3, 8), f.cos(), f.sin(), 8).shape
        torch.Size([4, 2, 3, 8])
        >>> q = torch.randn(2, 4, 3, 8).transpose(1, 2)  # [b, h, s, d] held as [b, s, h, d]
        >>> rope(q, f.cos(), f.sin(), 8, layout="bhsd").stride() == q.stride()
        True
    """
    out = _output(t, transpose_output)
    t = t.permute(_sbhd(layout))
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
    out.permute(_sbhd(layout)).copy_(y)
    return out


def _check(args, per_tensor: bool) -> None:
    op, t, cos, sin, group = args.op_name, args.t, args.cos, args.sin, args.group
    layout = args.layout
    check_float(op, t, "t")
    if layout not in LAYOUTS:
        raise ValueError(
            f"{op}: layout {layout!r} is not one of {LAYOUTS}; name t's dims in order "
            "(a strided view of another layout is passed as the layout of its shape)."
        )
    if t.dim() != 4:
        dims = ", ".join(layout)
        raise ValueError(
            f"{op}: t must be [{dims}] (layout={layout!r}), got shape {tuple(t.shape)}; add "
            "the missing dims (e.g. t.unsqueeze(1) for [s, h, d])."
        )
    if args.transpose_output and layout != "sbhd":
        raise ValueError(
            f"{op}: transpose_output lays out an [s, b, h, d] result as [b, s, h, d]; with "
            f"layout={layout!r} drop it: the output already has t's memory layout."
        )
    acc = acc_dtype(t)
    s, d = t.shape[layout.index("s")], t.shape[3]
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
    return _output(args.t, args.transpose_output)


def _setup_context(ctx, args, output):
    ctx.group, ctx.backward, ctx.stepwise = args.group, args.backward, args.stepwise
    ctx.layout = args.layout
    ctx.save_for_backward(args.cos, args.sin)


def _backward(ctx, grad_y):
    cos, sin = ctx.saved_tensors
    g = _op(grad_y, cos, sin, ctx.group, False, not ctx.backward, ctx.stepwise, ctx.layout)
    return {"t": g}


def _tables(s, d2, acc):
    inv = 1.0 / 10000 ** (torch.arange(0, d2, 2, dtype=torch.float64) / d2)
    f = torch.outer(torch.arange(s, dtype=torch.float64), inv)
    f = torch.cat([f, f], -1).to(acc)
    return f.cos(), f.sin()


def _contiguous(x):
    """``x`` as it is."""
    return x


def _bhsd_of_bshd(x):
    """A ``[b, s, h, d]`` tensor seen as ``[b, h, s, d]`` (``q.transpose(1, 2)``)."""
    return x.transpose(1, 2)


def _bshd_of_bhsd(x):
    """A ``[b, h, s, d]`` tensor seen as ``[b, s, h, d]``."""
    return x.transpose(1, 2)


def _sbhd_of_bhsd(x):
    """A ``[b, h, s, d]`` tensor seen as ``[s, b, h, d]``."""
    return x.permute(2, 0, 1, 3)


def _sbhd_of_bshd(x):
    """A ``[b, s, h, d]`` tensor seen as ``[s, b, h, d]``."""
    return x.transpose(0, 1)


#: (layout, shape of the tensor made, the view passed): s=7, b=3, h=2, d=40 with d2=32.
_LAYOUT_CASES = (
    ("sbhd", (7, 3, 2, 40), _contiguous),
    ("sbhd", (3, 2, 7, 40), _sbhd_of_bhsd),
    ("sbhd", (3, 7, 2, 40), _sbhd_of_bshd),
    ("bshd", (3, 7, 2, 40), _contiguous),
    ("bshd", (3, 2, 7, 40), _bshd_of_bhsd),
    ("bhsd", (3, 2, 7, 40), _contiguous),
    ("bhsd", (3, 7, 2, 40), _bhsd_of_bshd),
)


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
    # every layout, contiguous and as the strided views attention code holds (s=7, b=3, h=2)
    for layout, shape, view in _LAYOUT_CASES:
        for backward, stepwise in ((False, False), (True, True)):
            kw = make(shape, 32, 4)
            kw |= dict(t=view(kw["t"]).requires_grad_(True), group=32, backward=backward)
            kw |= dict(cos=_tables(7, 32, acc)[0], sin=_tables(7, 32, acc)[1], stepwise=stepwise)
            name = f"layout={layout} {view.__name__[1:]} {backward=}"
            yield Sample(kw | dict(layout=layout), name=name)
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
