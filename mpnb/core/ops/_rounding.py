"""Pure-bf16 optimizer steps: stochastic rounding and Kahan summation, the exact math.

The ``fused_<opt>_bf16_`` ops (``adam``, ``sgd``, ``lamb``) update bf16 params without fp32
master weights. Each computes the new weight in fp32 from the param (upcast, exact) and the
fp32 optimizer state, then rounds it back to bf16 in one of two ways (``rounding``):

``"stochastic"``
    With ``x`` the new fp32 weight and ``bits`` its 32-bit pattern, the stored bf16 is the
    upper half of ``bits + r``, ``r`` 16 random bits (uniform on ``[0, 2^16)``): it rounds
    up (away from zero) with probability equal to the fraction of the bf16 ulp that ``x``
    lies past its lower neighbour, so the rounding is unbiased: ``E[bf16(x)] = x``. The
    magnitude bits never carry into the sign bit, so negative values, subnormals and the
    exponent boundaries need no special case; a finite value past bf16's largest finite
    value rounds to it or to inf with the same rule (inf is the next pattern), inf stays inf
    and NaN becomes the canonical quiet NaN ``0x7FC0`` (its low bits could carry).

``"kahan"``
    A bf16 compensation buffer ``c`` per param (optimizer state, 2 bytes per param) holds the
    part of past updates that bf16 could not represent. With ``p`` the param, ``x`` the new
    fp32 weight computed from ``p``, and all arithmetic in fp32::

        y     = (x - p) + c          # this step's update plus what earlier steps lost
        p_new = rne(p + y)           # round to nearest even
        c_new = rne(y - (p_new - p)) # what this step lost (p_new - p is exact in fp32)

The random bits are counter based: element ``i`` of tensor ``t`` (its index in the op's
lists) at step ``s`` under seed ``seed`` gets

    key = mix64(mix64(mix64(seed) ^ s) ^ t) mod 2^32         (splitmix64's finalizer)
    r   = fmix32((i * 0x9E3779B1 + key) mod 2^32) >> 16      (murmur3's finalizer)

a pure function of ``(seed, step, t, i)``: the result does not depend on threads, chunking
or vector width, and a run resumes bitwise from a checkpoint that holds the seed and step.
``mix64`` and ``fmix32`` are the finalizers of splitmix64 and murmur3; ``i -> i * odd + key``
and ``fmix32`` are bijections on 32-bit words, so the elements of one tensor never share
their bits. The C++ kernels (``csrc/cpu/rounding.h``) and the Triton kernels compute the same
bits; the references here compute them with int64 tensor ops whose products never overflow.

Why no fp32 master weights with these: masters already hold the exact weight, which is what
both methods approximate at 2 bytes per param (against 4 for a master).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = [
    "ROUNDINGS",
    "check_rounding",
    "element_bits",
    "mix64",
    "round_nearest",
    "round_stochastic",
    "sqrt_rn",
    "store_rounded",
    "tensor_key",
]

#: The rounding modes of the ``fused_<opt>_bf16_`` ops.
ROUNDINGS = ("stochastic", "kahan")

_M64 = (1 << 64) - 1
_M32 = (1 << 32) - 1
_MAX_NUMEL = 1 << 32  # element indices are 32-bit words


def mix64(z: int) -> int:
    """splitmix64's step on a 64-bit word (Steele, Lea, Flood 2014): add, then finalize."""
    z = (z + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def tensor_key(seed: int, step: int, t: int) -> int:
    """The 32-bit key of tensor ``t`` at step ``step`` under ``seed`` (all taken mod 2^64)."""
    return mix64(mix64(mix64(seed & _M64) ^ (step & _M64)) ^ (t & _M64)) & _M32


def sqrt_rn(x: torch.Tensor) -> torch.Tensor:
    """The correctly rounded fp32 square root (the kernels' ``sqrtps``; torch's fp32 CPU
    ``sqrt`` is off by one ulp on about a fifth of inputs). fp64's root of an fp32 value,
    rounded to fp32, is correctly rounded (53 >= 2 * 24 + 2 bits)."""
    return x.double().sqrt().float()


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    # x * c mod 2^32 for int64 x in [0, 2^32) and a 32-bit constant, without int64 overflow:
    # the high half of x contributes only the low 16 bits of its product, shifted up.
    lo, hi = x & 0xFFFF, x >> 16
    return (lo * c + (((hi * c) & 0xFFFF) << 16)) & _M32


def element_bits(n: int, key: int, device=None) -> torch.Tensor:
    """The 16 random bits (int64 in ``[0, 2^16)``) of elements ``0..n-1`` of a tensor."""
    x = (_mul32(torch.arange(n, dtype=torch.int64, device=device), 0x9E3779B1) + key) & _M32
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    x = x ^ (x >> 16)
    return x >> 16


def _to_bf16(upper: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    # int32 upper halves (sign-extended) -> bf16; NaN -> the canonical 0x7FC0
    upper = torch.where(torch.isnan(x), torch.full_like(upper, 0x7FC0), upper)
    return upper.to(torch.int16).view(torch.bfloat16)


def round_nearest(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16, round to nearest even (NaN -> ``0x7FC0``), written out on the bits."""
    bits = torch.where(torch.isnan(x), torch.zeros_like(x), x).view(torch.int32)
    lsb = (bits >> 16) & 1
    return _to_bf16((bits + (0x7FFF + lsb)) >> 16, x)


def round_stochastic(x: torch.Tensor, bits16: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16 rounded stochastically with the given 16 random bits per element."""
    bits = torch.where(torch.isnan(x), torch.zeros_like(x), x).view(torch.int32)
    return _to_bf16((bits + bits16.to(torch.int32).view(x.shape)) >> 16, x)


def check_rounding(args: Any, per_tensor: bool) -> None:
    """The rounding's part of a ``fused_<opt>_bf16_`` op's check: bf16 params below 2^32
    elements, a known mode, compensations as the mode needs them (``args`` holds ``params``,
    ``compensations`` and ``rounding``)."""
    op, params, comps, rounding = args.op_name, args.params, args.compensations, args.rounding
    if rounding not in ROUNDINGS:
        raise ValueError(
            f"{op}: rounding must be one of {ROUNDINGS}, got {rounding!r}; for round to "
            "nearest call the op without _bf16 (fused_adam_, fused_sgd_, fused_lamb_)."
        )
    if params and params[0].dtype != torch.bfloat16:
        raise TypeError(
            f"{op}: params are {params[0].dtype}; stochastic rounding and Kahan summation are "
            "for bfloat16 params (fp32 params need neither; fp16 params: use fp32 master "
            "weights)."
        )
    if rounding == "stochastic" and comps:
        raise ValueError(
            f"{op}: stochastic rounding takes no compensation buffers, got "
            f"{len(comps)}; pass an empty list (or rounding='kahan')."
        )
    if rounding == "kahan" and len(comps) != len(params):
        raise ValueError(
            f"{op}: Kahan summation needs one bf16 compensation buffer per param, got "
            f"{len(comps)} for {len(params)}; pass torch.zeros_like(p) per param."
        )
    if per_tensor:
        _check_rounding_tensors(op, params, comps)


def _check_rounding_tensors(op: str, params: Sequence[torch.Tensor], comps) -> None:
    for i, p in enumerate(params):
        if p.numel() >= _MAX_NUMEL:
            raise ValueError(
                f"{op}: param {i} has {p.numel()} elements; the rounding's element index is a "
                "32-bit word: split the tensor into parts below 2^32 elements."
            )
    for i, (p, c) in enumerate(zip(params, comps, strict=False)):
        if c.dtype != torch.bfloat16 or c.numel() != p.numel() or not c.is_contiguous():
            raise TypeError(
                f"{op}: compensation {i} is {c.dtype} with {c.numel()} elements; it must "
                f"be a contiguous bfloat16 tensor of its param's {p.numel()} elements "
                "(torch.zeros_like(p))."
            )


def store_rounded(
    param: torch.Tensor,
    comp: torch.Tensor | None,
    x: torch.Tensor,
    rounding: str,
    seed: int,
    step: int,
    t: int,
    keep: torch.Tensor | None = None,
) -> None:
    """Round the new fp32 weight ``x`` of param ``t`` into ``param`` (and its compensation);
    nothing changes where ``keep`` (a 0-dim bool tensor, :func:`~mpnb.core.ops._optim.
    keep_of`) is False: a skipped step, decided on the device."""
    x = x.reshape(param.shape)
    if rounding == "stochastic":
        r = element_bits(x.numel(), tensor_key(seed, step, t), x.device)
        _write(param, round_stochastic(x, r), keep)
        return
    p = param.float()
    y = (x - p) + comp.float()
    new = round_nearest(p + y)
    _write(comp, round_nearest(y - (new.float() - p)), keep)
    _write(param, new, keep)


def _write(target: torch.Tensor, new: torch.Tensor, keep: torch.Tensor | None) -> None:
    target.copy_(new if keep is None else torch.where(keep, new, target))
