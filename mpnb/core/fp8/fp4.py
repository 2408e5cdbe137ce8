"""E2M1, the four-bit element of NVFP4 and MXFP4: its grid, its two roundings, its packing.

An E2M1 code is 4 bits: a sign, 2 exponent bits (bias 1) and 1 mantissa bit. Codes 0..7 are
the magnitudes ``0, 0.5, 1, 1.5, 2, 3, 4, 6`` (0.5 is the one subnormal), codes 8..15 the same
with the sign bit set (code 8 is -0.0). There is no inf and no NaN: the largest value is 6.

* :func:`round_to_e2m1`: round to nearest, ties to the even code, saturating (``satfinite``):
  a finite value beyond 6 and an inf become ±6; NaN becomes code 0 (E2M1 cannot hold it: a
  quantizer marks a NaN block in its scale instead). The tie points are the midpoints
  ``0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5`` and go to ``0, 1, 1, 2, 2, 4, 4``.
* :func:`stochastic_round_to_e2m1`: clamp to ±6, then round up to the next grid point with
  probability ``(|x| - lo) / (hi - lo)``, so that ``E[q] = x`` (unbiased). The draws come from
  an explicit ``torch.Generator`` (or an int seed): the same seed gives the same codes.
* :func:`pack_e2m1` / :func:`unpack_e2m1`: two codes per byte, the even element (index 0, 2,
  ...) in the low nibble, as TransformerEngine and torchao store ``float4_e2m1fn_x2``.

Example::

    >>> codes = round_to_e2m1(torch.tensor([0.3, -1.25, 7.0, 2.5]))
    >>> codes.tolist(), e2m1_to_float(codes).tolist()
    ([1, 10, 7, 4], [0.5, -1.0, 6.0, 2.0])
    >>> pack_e2m1(codes.view(1, 4)).tolist()
    [[161, 71]]
"""

from __future__ import annotations

import math

import torch

# the element set is a row fact of the number-format table; this module quantizes to it
from mpnb.core.number_formats import E2M1_GRID, E2M1_MAX

__all__ = [
    "E2M1_MAX",
    "E2M1_EMAX",
    "E2M1_GRID",
    "e2m1_to_float",
    "round_to_e2m1",
    "round_toward_zero_e2m1",
    "stochastic_round_to_e2m1",
    "make_generator",
    "pack_e2m1",
    "unpack_e2m1",
    "check_float",
    "check_blocked",
]

E2M1_EMAX = 2  # exponent of E2M1's largest power of two (4 = 2**2), OCP MX spec 5.3.3
_SIGN = 8
# Round to nearest even: the magnitude code is the number of tie points passed, a tie point
# itself counting only when the code above it is even (``>=``) and not when it is odd (``>``).
_TIES_UP = (0.75, 1.75, 3.5)  # the code above is even: the tie rounds up
_TIES_DOWN = (0.25, 1.25, 2.5, 5.0)  # the code above is odd: the tie rounds down


def check_float(x: torch.Tensor, what: str = "x") -> torch.Tensor:
    """``x`` if it is a floating-point tensor, else a TypeError naming the fix."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(
            f"{what} must be a floating-point tensor (float32, bfloat16 or float16), got {got}; "
            "convert it with .float() first."
        )
    return x


def check_blocked(x: torch.Tensor, fmt: str, block: int, tile_rows: int = 1) -> None:
    """Check that ``x`` is a 2-D float tensor of ``tile_rows x block`` blocks (errors name
    the fix: flatten, or pad with zeros, which change no amax and no product)."""
    check_float(x)
    if x.ndim != 2:
        raise ValueError(
            f"{fmt} quantizes a 2-D tensor along its last dim, got shape {tuple(x.shape)}; "
            "flatten the leading dims first (x.reshape(-1, x.shape[-1]))."
        )
    if x.shape[1] % block or x.shape[0] % tile_rows:
        rows = f" and the rows a multiple of {tile_rows}" if tile_rows > 1 else ""
        raise ValueError(
            f"{fmt} blocks are {tile_rows}x{block}: the last dim must be a multiple of {block}"
            f"{rows}, got shape {tuple(x.shape)}; pad with zeros (they change no amax)."
        )


def e2m1_to_float(codes: torch.Tensor) -> torch.Tensor:
    """The float32 value of each E2M1 code (a uint8 tensor of codes 0..15, one per element)."""
    _check_codes(codes)
    grid = torch.tensor(E2M1_GRID, dtype=torch.float32, device=codes.device)
    table = torch.cat([grid, -grid])  # -0.0 for code 8
    return table[codes.long()]


def _magnitude_code(a: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest-even magnitude code (0..7) of ``a >= 0`` (already clamped to 6)."""
    code = torch.zeros(a.shape, dtype=torch.uint8, device=a.device)
    for t in _TIES_UP:
        code += a >= t
    for t in _TIES_DOWN:
        code += a > t
    return code


def _signed(code: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``code`` with the sign bit of ``x`` (so -0.0 keeps its sign), 0 where ``x`` is NaN."""
    code = code | (torch.signbit(x).to(torch.uint8) * _SIGN)
    return torch.where(torch.isnan(x), 0, code).to(torch.uint8)


def round_to_e2m1(x: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8, one per element) of ``x``: nearest, ties to even, saturating at ±6.

    ``x`` is rounded from its float32 value (a bfloat16/float16 input converts exactly).
    """
    a = check_float(x).float().abs().clamp(max=E2M1_MAX)
    return _signed(_magnitude_code(a), x)


def _floor_magnitude(a: torch.Tensor) -> torch.Tensor:
    """The largest grid magnitude code not above ``a`` (``a`` in [0, 6])."""
    code = torch.zeros(a.shape, dtype=torch.uint8, device=a.device)
    for g in E2M1_GRID[1:]:
        code += a >= g
    return code


def round_toward_zero_e2m1(x: torch.Tensor) -> torch.Tensor:
    """E2M1 codes of ``x`` truncated toward zero (the lower neighbour stochastic rounding
    starts from), saturating at ±6."""
    a = check_float(x).float().abs().clamp(max=E2M1_MAX)
    return _signed(_floor_magnitude(a), x)


def make_generator(generator, device: torch.device) -> torch.Generator:
    """A ``torch.Generator`` on ``device`` from a generator or a non-negative int seed.

    Stochastic rounding never draws from torch's global generator: a run is reproducible only
    when its caller names the seed.
    """
    if isinstance(generator, torch.Generator):
        if generator.device.type != torch.device(device).type:
            raise ValueError(
                f"the generator is on {generator.device} but the tensor is on {device}; create "
                f"it with torch.Generator(device={str(device)!r}) or pass an int seed."
            )
        return generator
    if generator is None:
        raise TypeError(
            "stochastic rounding needs an explicit generator: pass generator=<int seed> or a "
            "torch.Generator, so that the draws can be reproduced."
        )
    ok = isinstance(generator, int) and not isinstance(generator, bool)
    if isinstance(generator, float) and math.isfinite(generator) and generator.is_integer():
        generator, ok = int(generator), True
    if not ok or not 0 <= generator < 2**64:
        raise ValueError(
            f"seed={generator!r} is invalid; use a finite integer seed in [0, 2**64) or a "
            "torch.Generator."
        )
    return torch.Generator(device=device).manual_seed(generator)


def stochastic_round_to_e2m1(x: torch.Tensor, generator) -> torch.Tensor:
    """E2M1 codes of ``x`` rounded stochastically: unbiased, ``E[value(q)] = clamp(x, -6, 6)``.

    With ``lo <= |x| < hi`` the two grid neighbours, ``q`` is ``hi`` with probability
    ``p = (|x| - lo) / (hi - lo)`` (computed exactly: the spacing is a power of two and the
    difference is exact), decided by ``u < p`` for one uniform ``u`` in [0, 1) per element
    (float32, steps of 2**-24). A value on the grid is never moved.

    Args:
        x: floating-point tensor (values beyond ±6 saturate first, as ``satfinite``).
        generator: an int seed or a ``torch.Generator`` on ``x``'s device.

    Example::

        >>> q = stochastic_round_to_e2m1(torch.full((100000,), 2.25), generator=0)
        >>> e2m1_to_float(q).mean()   # about 2.25: 3 with probability 0.25, else 2
    """
    check_float(x)
    gen = make_generator(generator, x.device)
    a = x.float().abs().clamp(max=E2M1_MAX)
    lo_code = _floor_magnitude(a)
    grid = torch.tensor(E2M1_GRID + (E2M1_MAX,), dtype=torch.float32, device=x.device)
    lo, hi = grid[lo_code.long()], grid[lo_code.long() + 1]
    step = torch.where(hi > lo, hi - lo, 1.0)
    p = (a - lo) / step
    u = torch.rand(a.shape, generator=gen, device=x.device, dtype=torch.float32)
    return _signed(lo_code + (u < p).to(torch.uint8), x)


def _check_codes(codes: torch.Tensor) -> None:
    if not isinstance(codes, torch.Tensor) or codes.dtype != torch.uint8:
        got = codes.dtype if isinstance(codes, torch.Tensor) else type(codes).__name__
        raise TypeError(
            f"E2M1 codes must be a uint8 tensor (one code 0..15 per element), got {got}; "
            "produce them with round_to_e2m1 or unpack_e2m1."
        )


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Two codes per byte along the last dim: element ``2i`` low nibble, ``2i + 1`` high."""
    _check_codes(codes)
    if codes.shape[-1] % 2:
        raise ValueError(
            f"packing E2M1 needs an even last dim, got shape {tuple(codes.shape)}; pad the "
            "tensor to an even number of columns first."
        )
    pairs = codes.reshape(*codes.shape[:-1], -1, 2)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).contiguous()


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """The codes of :func:`pack_e2m1`'s bytes, the last dim doubled (low nibble first)."""
    _check_codes(packed)
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(*packed.shape[:-1], -1)
