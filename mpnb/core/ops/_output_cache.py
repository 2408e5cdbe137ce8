"""The output cache of the C++ layer kernels: report it, change its limit, empty it.

LayerNorm, RMSNorm, the softmaxes and RoPE on the CPU take an output of 16 MiB or more from
memory that an earlier output of the same size (2 MiB granularity) gave back, instead of a
fresh ``mmap`` whose every page the OS zeroes on the kernel's first write
(``csrc/cpu/output_cache.h`` says how, and what it measured). PyTorch's CUDA caching
allocator keeps freed blocks for the same reason; its CPU allocator does not.

The cache holds at most ``MPNB_CPU_OUTPUT_CACHE_MB`` MiB (default 1024; ``0`` turns it off)
in blocks no tensor uses; :func:`output_cache` reports it, changes the limit and empties it.
The functions it calls are plain C functions of the loaded library, not ops: they touch no
tensor.
"""

from __future__ import annotations

import ctypes
import os

from mpnb.core.ops._build import cpu_extension
from mpnb.core.ops._library import ensure_kernels

__all__ = ["CACHE_MIN_BYTES", "ENV", "env_problem", "output_cache"]

#: Outputs below this size are not cached (``kCacheMinBytes``, ``output_cache.h``): malloc
#: reuses them already.
CACHE_MIN_BYTES = 16 << 20
#: The variable the C++ cache reads its limit from, once, when first used.
ENV = "MPNB_CPU_OUTPUT_CACHE_MB"
_FIELDS = ("limit_mib", "held_mib", "held_blocks", "in_use_mib", "hits", "misses", "min_mib")
_lib: list = []


def _library():
    if not _lib:
        if not ensure_kernels():
            return None
        lib = ctypes.CDLL(cpu_extension().status().path)  # the loaded one: same handle
        lib.mpnb_output_cache_stats.argtypes = [ctypes.POINTER(ctypes.c_int64)]
        lib.mpnb_output_cache_configure.argtypes = [ctypes.c_int64, ctypes.c_int]
        _lib.append(lib)
    return _lib[0]


def env_problem() -> str:
    """What is wrong with ``MPNB_CPU_OUTPUT_CACHE_MB`` ("" when unset or valid): the C++ cache
    ignores a value that is not a whole number of MiB >= 0 and keeps its default, 1024."""
    value = os.environ.get(ENV, "")
    if value == "" or (value.isascii() and value.isdigit()):
        return ""
    return (
        f"{ENV}={value!r} is not a whole number of MiB >= 0, so the default (1024) is used; "
        f"set it to e.g. 512, or 0 to turn the cache off"
    )


def output_cache(limit_mib: float | None = None, *, empty: bool = False) -> dict:
    """Report the CPU kernels' output cache; optionally set its limit or empty it first.

    Args:
        limit_mib: the most MiB to hold in free blocks (``0`` turns the cache off and frees
            what it holds; freed outputs past the limit go back to the OS, oldest first).
            ``None`` keeps the limit (``MPNB_CPU_OUTPUT_CACHE_MB``, default 1024).
        empty: return every free block to the OS (outputs in use are not touched; they
            return to the cache when freed, within the limit).

    Returns:
        ``{"available", "limit_mib", "held_mib", "held_blocks", "in_use_mib", "hits",
        "misses", "min_mib"}``: ``available`` is False (and the rest 0) when the C++ kernels
        are not loaded; ``in_use_mib`` counts live outputs the cache handed out; ``hits`` /
        ``misses`` count large outputs served from a free block / from new memory;
        ``min_mib`` is the smallest output the kernels take from the cache (the C++ value;
        :data:`CACHE_MIN_BYTES` states it for Python).

    Example::

        >>> output_cache()["limit_mib"]          # 1024.0 unless MPNB_CPU_OUTPUT_CACHE_MB is set
        >>> output_cache(empty=True)["held_mib"]  # 0.0
    """
    if limit_mib is not None and not limit_mib >= 0:
        raise ValueError(
            f"output_cache: limit_mib must be >= 0 (MiB), got {limit_mib!r}; pass 0 to turn "
            "the cache off."
        )
    lib = _library()
    if lib is None:
        return {"available": False} | dict.fromkeys(_FIELDS, 0)
    if limit_mib is not None or empty:
        limit = -1 if limit_mib is None else int(limit_mib * (1 << 20))
        lib.mpnb_output_cache_configure(limit, int(empty))
    raw = (ctypes.c_int64 * len(_FIELDS))()
    lib.mpnb_output_cache_stats(raw)
    mib = {"limit_mib", "held_mib", "in_use_mib", "min_mib"}
    return {"available": True} | {
        k: (v / (1 << 20) if k in mib else int(v)) for k, v in zip(_FIELDS, raw, strict=True)
    }
