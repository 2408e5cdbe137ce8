"""The pure-bf16 steps' rounding in Triton (the math: :mod:`mpnb.core.ops._rounding`).

The random bits of element ``i`` are ``fmix32(i * 0x9E3779B1 + key) >> 16`` with the tensor's
32-bit ``key`` computed on the host (:func:`mpnb.core.ops._rounding.tensor_key`) and passed
in the chunk table; all integer arithmetic is on uint32 words, wrapping as the C++ does.
"""

from __future__ import annotations

import triton
import triton.language as tl

from mpnb.core.ops._rounding import tensor_key
from mpnb.core.ops.triton._common import from_acc, to_acc

__all__ = ["element_bits", "keys_of", "store_rounded"]


def keys_of(n: int, seed: int, step: int, kahan: bool) -> list[int]:
    """The per-tensor keys of a call (zeros for Kahan, which draws no bits)."""
    return [0 if kahan else tensor_key(seed, step, t) for t in range(n)]


@triton.jit
def _mul(x, c: tl.constexpr):
    return x * tl.full((), c, tl.uint32)


@triton.jit
def element_bits(offs, key):
    """The 16 random bits (uint32) of the elements ``offs`` of a tensor with ``key``."""
    x = _mul(offs.to(tl.uint32), 0x9E3779B1) + key
    x = x ^ (x >> 16)
    x = _mul(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul(x, 0xC2B2AE35)
    x = x ^ (x >> 16)
    return x >> 16


@triton.jit
def store_rounded(p_ptr, c_ptr, offs, x, mask, key, KAHAN: tl.constexpr):
    """Round the new fp32 weights ``x`` into the bf16 params (and Kahan's compensations)."""
    if KAHAN:
        w = to_acc(tl.load(p_ptr + offs, mask=mask, other=0.0), tl.float32)
        y = (x - w) + to_acc(tl.load(c_ptr + offs, mask=mask, other=0.0), tl.float32)
        new = from_acc(w + y, tl.bfloat16)
        comp = from_acc(y - (to_acc(new, tl.float32) - w), tl.bfloat16)
        tl.store(c_ptr + offs, comp, mask=mask)
        tl.store(p_ptr + offs, new, mask=mask)
    else:
        bits = x.to(tl.uint32, bitcast=True)
        r = (bits + element_bits(offs, key)) >> 16
        r = tl.where(x != x, 0x7FC0, r)
        tl.store(p_ptr + offs, r.to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=mask)
