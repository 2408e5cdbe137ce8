"""Quantize a 2-D tensor along its last dim into a :class:`Float8Operand` (the fast path).

Every GEMM here is ``a @ b.T`` with both operands ``(rows, K)`` and quantized along ``K``,
the contraction dim, so that a per-row or per-block scale never straddles a sum. The math
(``reference.py`` writes the same math a second, plain way and the tests compare the bytes):

* per tensor:  ``s = fp8_max / max(amax, eps)`` (float32), ``q = sat(round(x * s))``,
  dequantized as ``q * (1 / s)``; with power-of-two scales, ``s`` rounded down to ``2**k``
  exactly (its float32 exponent bits: ``log2`` in float32 rounds a quotient a few ulps
  below ``2**k`` up to ``k``, and the block's top value would then clip);
* per row: the same with one ``amax`` per row;
* MX: blocks of 32 along ``K``, one E8M0 power of two ``X`` per block, ``q = sat(round(x / X))``,
  dequantized as ``q * X``. ``X`` rounds ``amax / fp8_max`` to a power of two, up by default:

  - ``"rceil"`` (default, as TransformerEngine's MXFP8 and torchao's ``RCEIL``):
    ``X = 2**ceil(log2(amax / fp8_max))``, the smallest power of two with
    ``amax / X <= fp8_max``: nothing in the block clips;
  - ``"floor"`` (OCP MX spec v1.0, 6.3): ``X = 2**(floor(log2(amax)) - emax)``: the top of a
    block whose mantissa is above the format's max (``1.75`` for E4M3) saturates at
    ``fp8_max``, up to 12.5% below its value.

``sat`` clamps finite values to the format's finite range before the cast (the cast alone
would give inf, or saturate, depending on the device); an inf or NaN input becomes NaN, so
a non-finite value reaches the loss scaler's check however the scale was chosen (E4M3 has
no inf, and torch's cast would saturate one to 448).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import torch

from mpnb.core.fp8.formats import AMAX_EPS, E8M0, E8M0_BIAS, MX_ELEMENT_EMAX, fp8_max

__all__ = [
    "MX_ROUNDINGS",
    "Float8Operand",
    "amax_to_scale",
    "quantize_with_scale",
    "quantize_tensorwise",
    "quantize_rowwise",
    "quantize_mx",
    "MX_BLOCK",
]

MX_BLOCK = 32
_EXPONENT_BITS = -0x800000  # 0xFF800000 as an int32: sign and exponent of a float32
_MANTISSA_BITS = 0x7FFFFF
MX_ROUNDINGS = ("rceil", "floor")  # how an MX block's E8M0 scale is rounded; the first: default


@dataclass(frozen=True)
class Float8Operand:
    """One GEMM operand: ``data`` (rows, K) float8, row-major, and its dequantization scale.

    ``data * dequant_scale`` (broadcast per granularity) approximates the high-precision
    tensor. ``dequant_scale`` is what ``torch._scaled_mm`` takes:

    * ``"tensorwise"``: a 0-d float32 tensor;
    * ``"rowwise"``: ``(rows, 1)`` float32;
    * ``"mx"``: ``(rows, ceil(K / 32))`` ``float8_e8m0fnu`` (one power of two per block).
    """

    data: torch.Tensor
    dequant_scale: torch.Tensor
    granularity: str

    def dequantize(self) -> torch.Tensor:
        """The float32 values this operand stands for (exact: no rounding happens here)."""
        q = self.data.float()
        if self.granularity != "mx":
            return q * self.dequant_scale
        rows, k = q.shape
        pad = (-k) % MX_BLOCK
        blocks = torch.nn.functional.pad(q, (0, pad)).view(rows, -1, MX_BLOCK)
        return (blocks * self.dequant_scale.float().unsqueeze(-1)).view(rows, -1)[:, :k]

    def t(self) -> Float8Operand:
        """The transposed operand (per-tensor scaling only: its scale does not depend on axes)."""
        if self.granularity != "tensorwise":
            raise ValueError(
                f"a {self.granularity} operand is quantized along its rows and cannot be "
                "transposed; quantize the transposed high-precision tensor instead."
            )
        return Float8Operand(self.data.t().contiguous(), self.dequant_scale, self.granularity)


def amax_to_scale(amax: torch.Tensor, dtype: torch.dtype, power_of_2: bool = False):
    """``fp8_max(dtype) / max(amax, 1e-12)`` in float32, optionally rounded down to 2**k.

    The power of two is the float32 scale with its mantissa bits cleared (exact; a NaN scale,
    from a NaN amax, stays NaN).

    Example::

        >>> amax_to_scale(torch.tensor(2.0), torch.float8_e4m3fn)
        tensor(224.)
    """
    amax = torch.clamp(amax.float(), min=AMAX_EPS)
    # tensor / tensor: one correctly rounded division (python_scalar / tensor would be
    # reciprocal-then-multiply, two roundings)
    scale = amax.new_tensor(fp8_max(dtype)) / amax
    if power_of_2:
        pow2 = (scale.view(torch.int32) & _EXPONENT_BITS).view(torch.float32)
        scale = torch.where(torch.isnan(scale), scale, pow2)
    return scale


def _saturate(v: torch.Tensor, x: torch.Tensor, m: float) -> torch.Tensor:
    """``v`` (``x`` scaled) clamped to ``[-m, m]``, NaN where ``x`` is inf: a finite value
    that overflows saturates, a non-finite input stays non-finite."""
    return torch.where(torch.isinf(x), float("nan"), v.clamp(-m, m))


def quantize_with_scale(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, gran: str):
    """``sat(round(x * scale))`` as ``dtype``; ``scale`` broadcasts (0-d or ``(rows, 1)``).

    Finite values beyond the format's range saturate at ``fp8_max``; inf and NaN become NaN
    (delayed scaling's stored scale would otherwise hide an inf input as ``fp8_max``).
    """
    m = fp8_max(dtype)
    scale = scale.float()  # a module cast to half (model.to(bf16)) casts its buffers too
    data = _saturate(x.float() * scale, x, m).to(dtype).contiguous()
    return Float8Operand(data, scale.reciprocal(), gran)


def quantize_tensorwise(x: torch.Tensor, dtype: torch.dtype, power_of_2: bool = False):
    """Current per-tensor scaling of ``x``: the scale comes from this tensor's own amax."""
    scale = amax_to_scale(x.detach().abs().amax(), dtype, power_of_2)
    return quantize_with_scale(x, scale, dtype, "tensorwise")


def quantize_rowwise(x: torch.Tensor, dtype: torch.dtype, power_of_2: bool = True):
    """One scale per row of the 2-D ``x`` (amax along the last dim)."""
    amax = x.detach().abs().amax(dim=-1, keepdim=True)
    return quantize_with_scale(x, amax_to_scale(amax, dtype, power_of_2), dtype, "rowwise")


def check_mx_rounding(rounding: str) -> str:
    """``rounding`` if it is one of :data:`MX_ROUNDINGS`, else a ValueError naming them."""
    if rounding not in MX_ROUNDINGS:
        raise ValueError(
            f"MX scale rounding {rounding!r} is invalid; use 'rceil' (round amax / fp8_max up "
            "to a power of two: nothing clips, as TransformerEngine and torchao) or 'floor' "
            "(the OCP MX v1.0 rule: a block's top may saturate)."
        )
    return rounding


def _f32_bits(x: float) -> int:
    """The float32 bit pattern of ``x`` as an int (host arithmetic, no tensor)."""
    return struct.unpack("<i", struct.pack("<f", x))[0]


def quantize_mx(x: torch.Tensor, dtype: torch.dtype, rounding: str = "rceil") -> Float8Operand:
    """MXFP8: blocks of 32 along the last dim, E8M0 shared scales, elements in ``dtype``.

    The shared exponent is read off the float32 bits of the block's amax: ``floor(log2)``
    minus the element format's emax (``"floor"``), plus one when the amax's mantissa is above
    ``fp8_max``'s (``"rceil"``: exactly ``ceil(log2(amax / fp8_max))``), clamped to E8M0's
    range [-127, 127]; a block whose amax is not finite gets the NaN scale (0xFF). A last
    block shorter than 32 is padded with zeros (they change no amax and no product).

    Args:
        x: 2-D tensor, quantized along its last dim.
        dtype: the element format (``torch.float8_e4m3fn`` or ``torch.float8_e5m2``).
        rounding: ``"rceil"`` (default) or ``"floor"`` (see :mod:`mpnb.core.fp8.quantize`).
    """
    if E8M0 is None:
        raise RuntimeError("MXFP8 needs torch.float8_e8m0fnu (torch >= 2.7); upgrade torch.")
    check_mx_rounding(rounding)
    rows, k = x.shape
    pad = (-k) % MX_BLOCK
    blocks = torch.nn.functional.pad(x.detach().float(), (0, pad)).view(rows, -1, MX_BLOCK)
    amax = blocks.abs().amax(dim=-1)
    bits = amax.view(torch.int32)
    shared = ((bits >> 23) & 0xFF) - 127 - MX_ELEMENT_EMAX[dtype]
    if rounding == "rceil":
        top = _f32_bits(fp8_max(dtype))
        shared = shared + ((bits & _MANTISSA_BITS) > (top & _MANTISSA_BITS)).int()
    shared = shared.clamp(-E8M0_BIAS, E8M0_BIAS)
    biased = torch.where(torch.isfinite(amax), shared + E8M0_BIAS, 255).to(torch.uint8)
    scale = biased.view(E8M0)
    m = fp8_max(dtype)
    values = torch.nn.functional.pad(x.float(), (0, pad)) if pad else x.float().contiguous()
    # a block holding inf or NaN has the NaN scale: all its values are NaN already
    q = (values.view(rows, -1, MX_BLOCK) / scale.float().unsqueeze(-1)).clamp(-m, m)
    return Float8Operand(q.to(dtype).view(rows, -1)[:, :k].contiguous(), scale, "mx")
