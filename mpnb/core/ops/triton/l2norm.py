"""``multi_tensor_l2norm`` in Triton: the L2 norm of a whole list, and of each tensor.

Three small launches, deterministic (no atomics): one program per chunk writes its sum of
squares, :func:`~mpnb.core.ops.triton._chunks.segment_sums` adds each tensor's chunks in
order, and one program adds the tensors, takes the square roots and raises the flag.

Precision: squares are accumulated in fp64, as the reference does (an fp32 accumulation
overflows once a value passes ~1.8e19, which bf16 and fp32 values can), so the result matches
the reference to the last bits of an fp64 sum, whatever the summation order. On GPUs with
slow fp64 (consumer cards: 1/64 of the fp32 rate) this may make the kernel compute-bound;
the bench measures it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mpnb.core.ops.triton._checks import guard_lists
from mpnb.core.ops.triton._chunks import (
    BLOCK,
    WARPS,
    ChunkTable,
    chunk_info,
    segment_sums,
)
from mpnb.core.ops.triton._common import acc_of, flag_view, launch, nonfinite, raise_flag, to_acc
from mpnb.core.ops.triton._vector import aligned, column_ptr, span, span_mask, span_start

__all__ = ["multi_tensor_l2norm"]

_TAIL = 1024  # tensors the finishing program handles per step


@triton.jit
def _sumsq_span(
    table,
    t,
    start,
    lo,
    hi,
    inv,
    x0,
    acc,
    HAS_INV_SCALE: tl.constexpr,
    ACC: tl.constexpr,
    ROW: tl.constexpr,
    BLOCK: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    # Adds the squares of the elements [lo, hi) of the chunk into the lanes of acc (fp64).
    x_ptr = column_ptr(table, t, 2, x0, ROW, ALIGNED)
    lanes = tl.arange(0, BLOCK)
    for k in range(span_start(lo, BLOCK), hi, BLOCK):
        m = span_mask(k, lanes, lo, hi)
        v = to_acc(tl.load(x_ptr + start + k + lanes, mask=m, other=0.0), ACC)
        if HAS_INV_SCALE:
            v = v * inv
        w = v.to(tl.float64)
        acc += w * w
    return acc


@triton.jit
def _sumsq_kernel(
    table,
    n_tensors,
    inv_scale,
    partials,
    tensors,
    HAS_INV_SCALE: tl.constexpr,
    ACC: tl.constexpr,
    ROW: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # Named as the op's arguments; ``tensors`` carries the list's dtype (the addresses are in
    # the table), ``inv_scale`` is read only when HAS_INV_SCALE.
    t, start, count = chunk_info(table, n_tensors, ROW, CHUNK)
    inv = tl.full((), 1.0, ACC)
    if HAS_INV_SCALE:
        inv = to_acc(tl.load(inv_scale), ACC)
    acc = tl.zeros([BLOCK], dtype=tl.float64)
    ok = aligned(table, t, 2, 2, ROW)
    for part in tl.static_range(2):  # the vector span, then the scalar rest (see _vector):
        lo, hi = span(part, count, ok)  # each element keeps its lane, so the same sums
        acc = _sumsq_span(
            table, t, start, lo, hi, inv, tensors, acc, HAS_INV_SCALE, ACC, ROW, BLOCK, part == 0
        )
    tl.store(partials + tl.program_id(0), tl.sum(acc, axis=0))


@triton.jit
def _finish_kernel(
    sq,
    n_tensors,
    total_ptr,
    per_ptr,
    noop_flag,
    PER_TENSOR: tl.constexpr,
    ACC: tl.constexpr,
    TAIL: tl.constexpr,
):
    lanes = tl.arange(0, TAIL)
    acc = tl.zeros([TAIL], dtype=tl.float64)
    for j in range(0, n_tensors, TAIL):
        m = j + lanes < n_tensors
        s = tl.load(sq + j + lanes, mask=m, other=0.0)
        acc += s
        if PER_TENSOR:
            tl.store(per_ptr + j + lanes, tl.sqrt(s).to(ACC), mask=m)
    total = tl.sqrt(tl.sum(acc, axis=0)).to(ACC)
    tl.store(total_ptr, total)
    raise_flag(noop_flag, nonfinite(total))


def multi_tensor_l2norm(args) -> tuple[torch.Tensor, torch.Tensor]:
    """``(total, per_tensor_norms)`` of ``tensors`` (times ``inv_scale``), flagging a
    non-finite norm: the semantics of :func:`mpnb.core.ops.l2norm.reference_multi_tensor_l2norm`,
    whose arguments ``args`` holds by name (the per-tensor checks: :func:`guard_lists`).

    Example::

        >>> flag = torch.zeros(1, dtype=torch.int32, device="cuda")
        >>> total, per = launcher("multi_tensor_l2norm")(flag, [torch.ones(4, device="cuda")], True)
    """
    tensors, noop_flag, inv_scale = args.tensors, args.noop_flag, args.inv_scale
    if not tensors:
        dev = noop_flag.device
        return torch.zeros(1, device=dev), torch.empty(0, device=dev)
    dev = tensors[0].device
    ids = guard_lists(args, data=("tensors",))
    dtype = torch.float64 if tensors[0].dtype == torch.float64 else torch.float32
    acc = acc_of(dtype)
    tab = ChunkTable.build([tensors], ids=ids)
    partials = torch.empty(tab.n_chunks, dtype=torch.float64, device=dev)
    if tab.n_chunks:
        launch(
            _sumsq_kernel,
            (tab.n_chunks,),
            table=tab.table,
            n_tensors=tab.n_tensors,
            inv_scale=tab.table if inv_scale is None else inv_scale,
            partials=partials,
            tensors=tensors[0],
            HAS_INV_SCALE=inv_scale is not None,
            ACC=acc,
            ROW=tab.row,
            CHUNK=tab.chunk,
            BLOCK=BLOCK,
            num_warps=WARPS,
        )
    sq = segment_sums(tab, partials)
    total = torch.empty(1, dtype=dtype, device=dev)
    per = torch.empty(len(tensors) if args.per_tensor else 0, dtype=dtype, device=dev)
    launch(
        _finish_kernel,
        (1,),
        sq=sq,
        n_tensors=tab.n_tensors,
        total_ptr=total,
        per_ptr=per,
        noop_flag=flag_view(noop_flag),
        PER_TENSOR=bool(args.per_tensor),
        ACC=acc,
        TAIL=_TAIL,
    )
    return total, per


multi_tensor_l2norm.guards_lists = True
