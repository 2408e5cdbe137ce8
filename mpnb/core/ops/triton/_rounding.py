"""The pure-bf16 steps' rounding in Triton (the math: :mod:`mpnb.core.ops._rounding`).

The random bits of element ``i`` are ``fmix32(i * 0x9E3779B1 + key) >> 16``, with tensor
``t``'s 32-bit ``key = mix64(base ^ t)`` (:func:`mpnb.core.ops._rounding.tensor_key`) computed
on the device (:func:`key_of`) from the call's 64-bit ``base = mix64(mix64(seed) ^ rng_step)``,
which the host computes once per call (:func:`rng_words`) and passes as two int32 words that
Triton does not specialise on (:data:`RNG_WORDS`: one compile serves every step). So the chunk
table holds no key: it stays cached while the optimizer advances ``rng_step`` every step. All
integer arithmetic is on uint32 and uint64 words, wrapping as the C++ does.

An optimizer kernel serves its op and the op's pure-bf16 twin: its ``ROUNDING`` constexpr is
:data:`NEAREST` (the op without ``_bf16``: fp32 weights, a half param rounded to nearest),
:data:`STOCHASTIC` or :data:`KAHAN` (the twin's ``rounding``, :func:`rounding_code`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from mpnb.core.ops._rounding import mix64
from mpnb.core.ops.triton._common import from_acc, to_acc

__all__ = [
    "KAHAN",
    "NEAREST",
    "RNG_WORDS",
    "STOCHASTIC",
    "element_bits",
    "key_of",
    "mix64_bits",
    "rng_words",
    "rounding_code",
    "store_rounded",
]

#: ``ROUNDING`` of an optimizer kernel: no rounding of its own (the op without ``_bf16``)
NEAREST: tl.constexpr = tl.constexpr(0)
#: ``ROUNDING``: bf16 params rounded stochastically (``rounding="stochastic"``)
STOCHASTIC: tl.constexpr = tl.constexpr(1)
#: ``ROUNDING``: bf16 params with Kahan's compensations (``rounding="kahan"``)
KAHAN: tl.constexpr = tl.constexpr(2)
_CODES = {"stochastic": STOCHASTIC.value, "kahan": KAHAN.value}


def rounding_code(rounding: str) -> int:
    """The ``ROUNDING`` constexpr of a pure-bf16 op's ``rounding`` (checked by the op)."""
    return _CODES[rounding]


#: the kernel parameters that carry the call's random-bit base: ``do_not_specialize`` them
RNG_WORDS = ("rng_hi", "rng_lo")
_M32 = 0xFFFFFFFF


def _int32(word: int) -> int:
    return word - ((word >> 31) << 32)  # [0, 2^32) -> [-2^31, 2^31): Triton's i32, always


def rng_words(seed: int, step: int) -> dict[str, int]:
    """The launch keywords ``rng_hi`` and ``rng_lo`` of a call at ``(seed, step)``: the high and
    low 32 bits of its base ``mix64(mix64(seed) ^ step)`` (all mod 2^64) as signed int32 values,
    so that every step's words get Triton's one ``i32`` type (a value of 2^31 or more would be
    ``i64``); the kernels list them in ``do_not_specialize`` (:data:`RNG_WORDS`), so neither a
    word equal to 1 nor one divisible by 16 makes a new compile.

    Example::

        >>> launch(kernel, grid, ..., **rng_words(args.seed, args.rng_step))
    """
    base = mix64(mix64(seed & 0xFFFFFFFFFFFFFFFF) ^ (step & 0xFFFFFFFFFFFFFFFF))
    return dict(rng_hi=_int32(base >> 32), rng_lo=_int32(base & _M32))


@triton.jit
def _mul(x, c: tl.constexpr):
    return x * tl.full((), c, tl.uint32)


@triton.jit
def _mul64(x, c: tl.constexpr):
    return x * tl.full((), c, tl.uint64)


@triton.jit
def mix64_bits(z):
    """splitmix64's step on uint64 words, wrapping (:func:`mpnb.core.ops._rounding.mix64`)."""
    z = z + tl.full((), 0x9E3779B97F4A7C15, tl.uint64)
    z = _mul64(z ^ (z >> 30), 0xBF58476D1CE4E5B9)
    z = _mul64(z ^ (z >> 27), 0x94D049BB133111EB)
    return z ^ (z >> 31)


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
def key_of(t, rng_hi, rng_lo, ROUNDING: tl.constexpr):
    """Tensor ``t``'s random-bit key (uint32) from the call's :func:`rng_words`: with
    ``ROUNDING`` :data:`STOCHASTIC` ``mix64(base ^ t) mod 2^32``, bitwise
    :func:`mpnb.core.ops._rounding.tensor_key`; else 0 (no bits are drawn)."""
    if ROUNDING == STOCHASTIC:
        hi = rng_hi.to(tl.uint32, bitcast=True).to(tl.uint64)
        lo = rng_lo.to(tl.uint32, bitcast=True).to(tl.uint64)
        key = mix64_bits(((hi << 32) | lo) ^ t.to(tl.uint64)).to(tl.uint32)
    else:
        key = tl.full((), 0, tl.uint32)
    return key


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
