"""16-byte loads and stores for the list kernels: the aligned span of a chunk, and its rest.

An address read from the chunk table carries no alignment the compiler can see, and a mask
set by the runtime element count may change at any element: either one makes every access
one element wide. A list kernel therefore splits its chunk in two spans and runs its loop
body once on each:

* the *vector span* ``[0, whole)``, where every tensor of the row starts on a 16-byte
  boundary (:func:`aligned`: any tensor the allocator made) and ``whole`` is the chunk's
  count rounded down to a multiple of :data:`VEC` (:func:`span`); there the pointers
  carry the hint (:func:`column_ptr` with ``ALIGNED``, used in that span only) and the mask
  is constant over groups of :data:`VEC` elements, so each group is one 16-byte access;
* the *scalar span* ``[whole, count)``: the last ``count % VEC`` elements of a tensor, or
  the whole chunk of a view at an odd address (a slice of a flat buffer; ``whole`` is 0).

A kernel walks the two with ``for part in tl.static_range(2)``, one call of its span body
with ``ALIGNED=part == 0``.

Both spans walk the same ``BLOCK``-wide steps from the chunk's start (:func:`span_start`,
:func:`span_mask`), so an element sits in the same lane of the same step as in a single
loop: a per-lane accumulation adds the same values in the same order (bit for bit).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["VEC", "aligned", "span", "column_ptr", "span_start", "span_mask"]

#: elements per group of the vector span: 16 bytes of the narrowest dtype (2-byte halves);
#: a multiple of every wider dtype's 16-byte group, so one rounding serves every list.
VEC: tl.constexpr = tl.constexpr(8)


@triton.jit
def aligned(table, t, FIRST: tl.constexpr, LAST: tl.constexpr, ROW: tl.constexpr):
    """True when the addresses of tensor ``t`` in columns ``FIRST..LAST`` are 16-byte aligned."""
    bits = tl.load(table + t * ROW + FIRST)
    for col in tl.static_range(FIRST + 1, LAST + 1):
        bits = bits | tl.load(table + t * ROW + col)
    return bits % 16 == 0


@triton.jit
def span(PART: tl.constexpr, count, ok):
    """``(lo, hi)``: the chunk's vector span (``PART`` 0) or its scalar rest (``PART`` 1).

    The vector span ends at ``count`` rounded down to a multiple of :data:`VEC` when ``ok``
    (every address of the row aligned, :func:`aligned`), and is empty otherwise: its hinted
    pointers are then never dereferenced.
    """
    whole = tl.where(ok, (count // VEC) * VEC, 0)
    if PART == 0:
        lo, hi = 0, whole
    else:
        lo, hi = whole, count
    return lo, hi


@triton.jit
def column_ptr(table, t, col, carrier, ROW: tl.constexpr, ALIGNED: tl.constexpr):
    """A typed pointer to tensor ``t`` of the list in column ``col`` (``carrier``: its dtype),
    hinted 16-byte aligned with ``ALIGNED`` (use it only where :func:`aligned` held)."""
    ptr = tl.load(table + t * ROW + col).to(tl.pointer_type(carrier.dtype.element_ty))
    if ALIGNED:
        ptr = tl.multiple_of(ptr, 16)
    return ptr


@triton.jit
def span_start(lo, BLOCK: tl.constexpr):
    """The first ``BLOCK`` step of the chunk that holds element ``lo`` of the span ``[lo, hi)``."""
    return (lo // BLOCK) * BLOCK


@triton.jit
def span_mask(k, lanes, lo, hi):
    """The lanes of step ``k`` inside the span ``[lo, hi)`` (``lo`` 0: ``hi`` alone decides)."""
    return (k + lanes >= lo) & (lanes < hi - k)
