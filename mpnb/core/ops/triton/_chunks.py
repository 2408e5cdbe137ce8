"""The chunk table: a whole tensor list in one launch, one program per chunk of a tensor.

A list op over ``n`` tensors launches one grid of ``sum(ceil(numel_i / CHUNK))`` programs.
The table is one int64 tensor on the device, built on the host and copied once per call:

* ``n`` rows of ``ROW = 2 + n_cols + n_lists`` values: the tensor's ``numel``, the index of
  its first chunk, ``n_cols`` per-tensor integers (SGD's ``first_run``), then the address of
  the tensor in each list (``data_ptr()``; every list has one dtype, given to the kernel by a
  "carrier" tensor of that list, so an address becomes a typed pointer);
* then one value per chunk: the index of its tensor (chunks of one tensor are consecutive).

A table is built once per list and kept on the device: its contents are a function of the
lists' element counts, addresses and ``cols`` alone, so those are its key (:meth:`ChunkTable.
build`), and a training loop whose tensors stay where they are (the params, the optimizer's
state, grads that the caching allocator hands back at the same addresses) pays for its tables
on the first step only. A call that hits the cache allocates no tensor and copies nothing.
Its host work is the key: a launcher passes the ids of its lists, read with its per-tensor
checks in one C++ pass (:func:`~mpnb.core.ops.triton._checks.guard_lists`: equal ids, equal
sizes and addresses, so a tensor moved, resized or replaced gives a new key); without them the
key is every tensor's ``numel()`` and ``data_ptr()``, read in Python. The cache keeps the
:data:`CACHE_SIZE` tables used last.

On CUDA a new table goes up from pinned memory without blocking (a plain copy from pageable
memory would synchronize the host with the stream on every call: :func:`upload`). A table a
CUDA graph captured (built during the capture or taken from the cache) is kept, with its pinned
buffer, for the life of the process: each replay reads it again.

Empty tensors get no chunk. Per-tensor reductions write one partial per chunk and
:func:`segment_sum_kernel` adds each tensor's partials in a fixed order (deterministic, no
atomics).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from mpnb.core.ops.triton._checks import ListIds
from mpnb.core.ops.triton._common import launch

__all__ = [
    "BLOCK",
    "CACHE_SIZE",
    "CHUNK",
    "WARPS",
    "ChunkTable",
    "chunk_info",
    "tensor_ptr",
    "tensor_col",
    "segment_sums",
    "upload",
    "clear_cache",
]

BLOCK = 1024  #: elements per vector step of a program
CHUNK = 8 * BLOCK  #: elements per program (a tensor of 20,000 elements takes 3 programs)
WARPS = 8  #: warps of a chunk program: 4 values per thread per step (Adam: 73 registers on sm_90)
SEG_BLOCK = 128  #: chunk partials a segment-sum program adds per step


CACHE_SIZE = 64  #: chunk tables kept on the device (an optimizer step uses two or three)

#: pinned host buffers and device tables that CUDA graphs captured (their replays read them)
_CAPTURED: list[torch.Tensor] = []
#: key (chunk, cols, the lists' ids; or device, chunk, cols, numels, addresses per list) -> its
#: table, the last used at the end
_TABLES: OrderedDict[tuple, ChunkTable] = OrderedDict()


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def clear_cache() -> None:
    """Drop the cached chunk tables (the next call of each list builds its table again)."""
    _TABLES.clear()


def upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` (a small CPU tensor) on ``device`` without making the host wait: on CUDA from
    pinned memory, asynchronously; while a CUDA graph is captured the pinned buffer is kept,
    since each replay of the graph copies from it."""
    if device.type != "cuda":
        return host.to(device)
    pinned = host.pin_memory()
    if _capturing(device):
        _CAPTURED.append(pinned)
    return pinned.to(device, non_blocking=True)


@dataclass(frozen=True, eq=False)  # compared by identity (a table is a tensor)
class ChunkTable:
    """One list op's launch plan; build with :meth:`build`.

    Attributes:
        table: the int64 table on the device (layout in the module docstring).
        n_tensors: tensors per list.
        n_chunks: programs to launch (0: nothing to do).
        row: values per tensor row (``ROW`` in the kernels).
        chunk: elements per program (``CHUNK`` in the kernels).
    """

    table: torch.Tensor
    n_tensors: int
    n_chunks: int
    row: int
    chunk: int = CHUNK

    @classmethod
    def build(
        cls,
        lists: Sequence[Sequence[torch.Tensor]],
        cols: Sequence[Sequence[int]] = (),
        chunk: int = CHUNK,
        ids: ListIds | None = None,
    ) -> ChunkTable:
        """The table of ``lists`` (sized by ``lists[0]``, not empty) with per-tensor integer
        ``cols``: the cached one when these lists were seen with the same element counts,
        addresses and ``cols`` (its contents would be the same), else a new one, cached.

        ``ids``: what :func:`~mpnb.core.ops.triton._checks.guard_lists` returned for the call
        whose lists these are (the key is then their ids, not every tensor's size and address).

        Example::

            >>> tab = ChunkTable.build([grads, master_grads])  # two lists of equal sizes
            >>> tab.n_chunks  # programs of one launch
        """
        first = lists[0]
        cols = tuple(map(tuple, cols))  # a tuple of tuples is kept as it is
        known = None
        if ids is not None:
            try:
                known = tuple(map(ids.__getitem__, map(id, lists)))
            except KeyError:  # a list the pass did not read
                known = None
        if known is not None:  # one id per list: its length, device, sizes and addresses
            key = (chunk, cols, *known)
        else:
            key = (
                first[0].device,
                chunk,
                cols,
                tuple(map(torch.Tensor.numel, first)),
                *(tuple(map(torch.Tensor.data_ptr, lst)) for lst in lists),
            )
        tab = _TABLES.get(key)
        if tab is None:
            tab = _TABLES[key] = cls._make(lists, cols, chunk)
            if len(_TABLES) > CACHE_SIZE:
                _TABLES.popitem(last=False)
        else:
            _TABLES.move_to_end(key)
        if first[0].is_cuda and _capturing(first[0].device):  # a replay reads it: it must
            _CAPTURED.append(tab.table)  # outlive its eviction
        return tab

    @classmethod
    def _make(
        cls, lists: Sequence[Sequence[torch.Tensor]], cols: Sequence[Sequence[int]], chunk: int
    ) -> ChunkTable:
        first = lists[0]
        n = len(first)
        numels = torch.tensor([t.numel() for t in first], dtype=torch.int64)
        counts = (numels + chunk - 1) // chunk
        starts = torch.cumsum(counts, 0) - counts
        parts = [numels[:, None], starts[:, None]]
        parts += [torch.tensor(list(c), dtype=torch.int64)[:, None] for c in cols]
        parts += [
            torch.tensor([t.data_ptr() for t in lst], dtype=torch.int64)[:, None] for lst in lists
        ]
        meta = torch.cat(parts, 1).reshape(-1)
        owner = torch.repeat_interleave(torch.arange(n, dtype=torch.int64), counts)
        table = torch.cat([meta, owner])
        table = upload(table, first[0].device)
        return cls(table, n, int(owner.numel()), 2 + len(cols) + len(lists), chunk)


def segment_sums(tab: ChunkTable, partials: torch.Tensor, ncol: int = 1) -> torch.Tensor:
    """Per-tensor sums ``(n_tensors, ncol)`` (fp64) of the chunks' ``partials (n_chunks, ncol)``."""
    out = torch.empty((tab.n_tensors, ncol), dtype=torch.float64, device=partials.device)
    if tab.n_tensors:
        launch(
            segment_sum_kernel,
            (tab.n_tensors,),
            tab.table,
            tab.n_tensors,
            partials,
            out,
            NCOL=ncol,
            ROW=tab.row,
            CHUNK=tab.chunk,
            SEG=SEG_BLOCK,
        )
    return out


@triton.jit
def chunk_info(table, n_tensors, ROW: tl.constexpr, CHUNK: tl.constexpr):
    """``(tensor index, first element, elements in this chunk)`` of the running program."""
    c = tl.program_id(0).to(tl.int64)
    t = tl.load(table + n_tensors * ROW + c)
    numel = tl.load(table + t * ROW)
    start = (c - tl.load(table + t * ROW + 1)) * CHUNK
    return t, start, tl.minimum(numel - start, CHUNK)


@triton.jit
def tensor_col(table, t, col, ROW: tl.constexpr):
    """The per-tensor integer ``col`` (0-based among the ``cols`` of :meth:`ChunkTable.build`)."""
    return tl.load(table + t * ROW + 2 + col)


@triton.jit
def tensor_ptr(table, t, col, carrier, ROW: tl.constexpr):
    """A typed pointer to tensor ``t`` of the list in column ``col`` (``carrier``: its dtype)."""
    addr = tl.load(table + t * ROW + col)
    return addr.to(tl.pointer_type(carrier.dtype.element_ty))


@triton.jit
def segment_sum_kernel(
    table,
    n_tensors,
    partials,
    out,
    NCOL: tl.constexpr,
    ROW: tl.constexpr,
    CHUNK: tl.constexpr,
    SEG: tl.constexpr,
):
    """``out[t, k] = sum of partials[c, k]`` over the chunks ``c`` of tensor ``t`` (fp64)."""
    t = tl.program_id(0).to(tl.int64)
    numel = tl.load(table + t * ROW)
    first = tl.load(table + t * ROW + 1)
    count = (numel + CHUNK - 1) // CHUNK
    lanes = tl.arange(0, SEG)
    for k in tl.static_range(NCOL):
        acc = tl.zeros([SEG], dtype=tl.float64)
        for j in range(0, count, SEG):
            m = j + lanes < count
            acc += tl.load(partials + (first + j + lanes) * NCOL + k, mask=m, other=0.0)
        tl.store(out + t * NCOL + k, tl.sum(acc, axis=0))
