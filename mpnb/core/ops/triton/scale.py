"""``multi_tensor_scale`` in Triton: ``dst = src * scale`` over lists, with the inf/NaN flag.

One launch for the whole list (see :mod:`~mpnb.core.ops.triton._chunks`); each element is
read once, checked, multiplied in fp32 (fp64 for fp64 lists) and written once in ``dst``'s
dtype: the unscale of half grads into fp32 master grads in one pass.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mpnb.core.ops.triton._checks import guard_lists
from mpnb.core.ops.triton._chunks import BLOCK, WARPS, ChunkTable, chunk_info
from mpnb.core.ops.triton._common import (
    acc_of,
    f32,
    flag_view,
    from_acc,
    launch,
    nonfinite,
    raise_flag,
    to_acc,
)
from mpnb.core.ops.triton._vector import aligned, column_ptr, span, span_mask, span_start

__all__ = ["multi_tensor_scale"]


@triton.jit
def _scale_span(
    table,
    t,
    start,
    lo,
    hi,
    s,
    src0,
    dst0,
    bad,
    ACC: tl.constexpr,
    ROW: tl.constexpr,
    BLOCK: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    # dst = src * s over the elements [lo, hi) of the chunk; returns the running inf/NaN lanes.
    src = column_ptr(table, t, 2, src0, ROW, ALIGNED)
    dst = column_ptr(table, t, 3, dst0, ROW, ALIGNED)
    lanes = tl.arange(0, BLOCK)
    for k in range(span_start(lo, BLOCK), hi, BLOCK):
        offs = start + k + lanes
        m = span_mask(k, lanes, lo, hi)
        x = to_acc(tl.load(src + offs, mask=m, other=0.0), ACC)
        bad = bad | nonfinite(x)
        tl.store(dst + offs, from_acc(x * s, dst0.dtype.element_ty), mask=m)
    return bad


@triton.jit
def _scale_kernel(
    table,
    n_tensors,
    noop_flag,
    scale_tensor,
    scale,
    src,
    dst,
    HAS_SCALE_TENSOR: tl.constexpr,
    ACC: tl.constexpr,
    ROW: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # Named as the op's arguments; ``src`` and ``dst`` carry their list's dtype (the lists'
    # addresses are in the table), ``scale_tensor`` is read only when HAS_SCALE_TENSOR.
    t, start, count = chunk_info(table, n_tensors, ROW, CHUNK)
    s = tl.cast(scale, ACC)
    if HAS_SCALE_TENSOR:
        s = s * to_acc(tl.load(scale_tensor), ACC)
    bad = tl.zeros([BLOCK], dtype=tl.int32)
    ok = aligned(table, t, 2, 3, ROW)
    for part in tl.static_range(2):  # the vector span, then the scalar rest (see _vector)
        lo, hi = span(part, count, ok)
        bad = _scale_span(table, t, start, lo, hi, s, src, dst, bad, ACC, ROW, BLOCK, part == 0)
    raise_flag(noop_flag, tl.max(bad, axis=0))


def multi_tensor_scale(args) -> None:
    """``dst[i] = src[i] * scale`` (times ``scale_tensor``), flagging inf/NaN in ``src``: the
    semantics of :func:`mpnb.core.ops.scale.reference_multi_tensor_scale`, whose arguments
    ``args`` holds by name (the per-tensor checks: :func:`guard_lists`).

    Example::

        >>> flag = torch.zeros(1, dtype=torch.int32, device="cuda")
        >>> grads = [torch.randn(10, device="cuda").bfloat16()]
        >>> master = [torch.empty(10, device="cuda")]
        >>> launcher("multi_tensor_scale")(flag, grads, master, 1 / 1024)
    """
    src, dst, noop_flag = args.src, args.dst, args.noop_flag
    scale, scale_tensor = args.scale, args.scale_tensor
    if not src:
        return
    ids = guard_lists(args, data=("src", "dst"))
    tab = ChunkTable.build([src, dst], ids=ids)
    if not tab.n_chunks:
        return
    acc = acc_of(src[0].dtype)
    if acc == tl.float64:  # a float argument is fp32 in a kernel: carry the scale in a tensor
        st = torch.full((), float(scale), dtype=torch.float64, device=src[0].device)
        if scale_tensor is not None:
            st = st * scale_tensor.to(torch.float64).reshape(())
        scale_tensor, scale = st, 1.0
    launch(
        _scale_kernel,
        (tab.n_chunks,),
        table=tab.table,
        n_tensors=tab.n_tensors,
        noop_flag=flag_view(noop_flag),
        scale_tensor=tab.table if scale_tensor is None else scale_tensor,
        scale=f32(scale),
        src=src[0],
        dst=dst[0],
        HAS_SCALE_TENSOR=scale_tensor is not None,
        ACC=acc,
        ROW=tab.row,
        CHUNK=tab.chunk,
        BLOCK=BLOCK,
        num_warps=WARPS,
    )


multi_tensor_scale.guards_lists = True
