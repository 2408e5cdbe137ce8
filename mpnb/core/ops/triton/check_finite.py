"""``multi_tensor_check_finite`` in Triton: is any element of a tensor list inf or NaN?

One launch for the whole list (see :mod:`~mpnb.core.ops.triton._chunks`), read-only: each
element is read once, in its own dtype (2 bytes per element of half grads), and tested on its
raw bits, never converted: a value is inf or NaN exactly when its exponent field is all ones
(:data:`_EXPONENT`), whatever its sign and payload. Each program holds its whole chunk as one
vector (every load of a thread in flight at once, no loop-carried wait), in 16-byte loads
where the tensor's address is 16-byte aligned (any tensor the allocator made; a view at an odd
offset is read element by element: :mod:`~mpnb.core.ops.triton._vector`), then raises the
flag if it saw such a value; nothing is written to the tensors and nothing is read on the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mpnb.core.ops.triton._checks import guard_lists
from mpnb.core.ops.triton._chunks import WARPS, ChunkTable, chunk_info
from mpnb.core.ops.triton._common import flag_view, launch, raise_flag
from mpnb.core.ops.triton._vector import aligned, column_ptr, span, span_mask

__all__ = ["multi_tensor_check_finite"]

#: dtype -> (the signed integer of its width, its exponent field): all ones there is inf/NaN.
_EXPONENT = {
    torch.float16: (tl.int16, 0x7C00),
    torch.bfloat16: (tl.int16, 0x7F80),
    torch.float32: (tl.int32, 0x7F800000),
    torch.float64: (tl.int64, 0x7FF0000000000000),
}


@triton.jit
def _bad(bits, EXP: tl.constexpr):
    """1 when any of ``bits`` (raw floating bits) has its exponent field all ones, else 0."""
    return tl.max(((bits & EXP) == EXP).to(tl.int32), axis=0)


@triton.jit
def _bad_span(
    table,
    t,
    start,
    lo,
    hi,
    x0,
    BITS: tl.constexpr,
    EXP: tl.constexpr,
    ROW: tl.constexpr,
    CHUNK: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    """1 when an element in ``[lo, hi)`` of the chunk is inf or NaN: one step (CHUNK lanes)."""
    x = column_ptr(table, t, 2, x0, ROW, ALIGNED) + start
    lanes = tl.arange(0, CHUNK)
    m = span_mask(0, lanes, lo, hi)
    return _bad(tl.load(x + lanes, mask=m, other=0.0).to(BITS, bitcast=True), EXP)


@triton.jit
def _check_finite_kernel(
    table,
    n_tensors,
    noop_flag,
    tensors,
    BITS: tl.constexpr,
    EXP: tl.constexpr,
    ROW: tl.constexpr,
    CHUNK: tl.constexpr,
):
    # Named as the op's arguments; ``tensors`` carries the list's dtype (addresses: the table).
    t, start, count = chunk_info(table, n_tensors, ROW, CHUNK)
    ok = aligned(table, t, 2, 2, ROW)
    bad = tl.full((), 0, tl.int32)
    for part in tl.static_range(2):  # 16-byte loads, then the scalar rest (see _vector)
        lo, hi = span(part, count, ok)
        bad = bad | _bad_span(table, t, start, lo, hi, tensors, BITS, EXP, ROW, CHUNK, part == 0)
    raise_flag(noop_flag, bad)


def multi_tensor_check_finite(args) -> None:
    """Set ``noop_flag`` to 1 when any element of ``tensors`` is inf or NaN, never lowering it:
    the semantics of :func:`mpnb.core.ops.check_finite.reference_multi_tensor_check_finite`,
    whose arguments ``args`` holds by name (the per-tensor checks: :func:`guard_lists`).

    Example::

        >>> flag = torch.zeros(1, dtype=torch.int32, device="cuda")
        >>> grads = [torch.randn(10, device="cuda").bfloat16()]
        >>> launcher("multi_tensor_check_finite")(flag, grads)   # flag stays 0
    """
    tensors, noop_flag = args.tensors, args.noop_flag
    if not tensors:
        return
    ids = guard_lists(args, data=("tensors",))
    tab = ChunkTable.build([tensors], ids=ids)
    if not tab.n_chunks:
        return
    bits, exponent = _EXPONENT[tensors[0].dtype]
    launch(
        _check_finite_kernel,
        (tab.n_chunks,),
        table=tab.table,
        n_tensors=tab.n_tensors,
        noop_flag=flag_view(noop_flag),
        tensors=tensors[0],
        BITS=bits,
        EXP=exponent,
        ROW=tab.row,
        CHUNK=tab.chunk,
        num_warps=WARPS,
    )


multi_tensor_check_finite.guards_lists = True
