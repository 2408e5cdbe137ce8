"""Quantize a 2-D tensor along its last dim into a :class:`Float8Operand` (the fast path).

Every GEMM here is ``a @ b.T`` with both operands ``(rows, K)`` and quantized along ``K``,
the contraction dim, so that a per-row or per-block scale never straddles a sum. The math
(``reference.py`` writes the same math a second, plain way and the tests compare the bytes):

* per tensor:  ``s = fp8_max / max(amax, eps)`` (float32), ``q = sat(round(x * s))``,
  dequantized as ``q * (1 / s)``;
* per row: the same with one ``amax`` per row;
* MX: blocks of 32 along ``K``, shared scale ``X = 2**(floor(log2(amax_block)) - emax)``
  (OCP MX spec v1.0, 6.3) stored as E8M0, ``q = sat(round(x / X))``, dequantized as ``q * X``.

``sat`` clamps to the format's finite range before the cast (the cast alone would give NaN
or inf on some devices).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mpnb.core.fp8.formats import AMAX_EPS, E8M0, E8M0_BIAS, MX_ELEMENT_EMAX, fp8_max

__all__ = [
    "Float8Operand",
    "amax_to_scale",
    "quantize_with_scale",
    "quantize_tensorwise",
    "quantize_rowwise",
    "quantize_mx",
    "MX_BLOCK",
]

MX_BLOCK = 32


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

    Example::

        >>> amax_to_scale(torch.tensor(2.0), torch.float8_e4m3fn)
        tensor(224.)
    """
    amax = torch.clamp(amax.float(), min=AMAX_EPS)
    # tensor / tensor: one correctly rounded division (python_scalar / tensor would be
    # reciprocal-then-multiply, two roundings)
    scale = amax.new_tensor(fp8_max(dtype)) / amax
    if power_of_2:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    return scale


def quantize_with_scale(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, gran: str):
    """``sat(round(x * scale))`` as ``dtype``; ``scale`` broadcasts (0-d or ``(rows, 1)``)."""
    m = fp8_max(dtype)
    scale = scale.float()  # a module cast to half (model.to(bf16)) casts its buffers too
    data = (x.float() * scale).clamp(-m, m).to(dtype).contiguous()
    return Float8Operand(data, scale.reciprocal(), gran)


def quantize_tensorwise(x: torch.Tensor, dtype: torch.dtype, power_of_2: bool = False):
    """Current per-tensor scaling of ``x``: the scale comes from this tensor's own amax."""
    scale = amax_to_scale(x.detach().abs().amax(), dtype, power_of_2)
    return quantize_with_scale(x, scale, dtype, "tensorwise")


def quantize_rowwise(x: torch.Tensor, dtype: torch.dtype, power_of_2: bool = True):
    """One scale per row of the 2-D ``x`` (amax along the last dim)."""
    amax = x.detach().abs().amax(dim=-1, keepdim=True)
    return quantize_with_scale(x, amax_to_scale(amax, dtype, power_of_2), dtype, "rowwise")


def quantize_mx(x: torch.Tensor, dtype: torch.dtype) -> Float8Operand:
    """MXFP8: blocks of 32 along the last dim, E8M0 shared scales, elements in ``dtype``.

    The shared exponent is ``floor(log2(amax))`` read off the float32 exponent bits, minus
    the element format's emax, clamped to E8M0's range [-127, 127]; a block whose amax is
    not finite gets the NaN scale (0xFF). A last block shorter than 32 is padded with zeros
    (they change no amax and no product).
    """
    if E8M0 is None:
        raise RuntimeError("MXFP8 needs torch.float8_e8m0fnu (torch >= 2.7); upgrade torch.")
    rows, k = x.shape
    pad = (-k) % MX_BLOCK
    blocks = torch.nn.functional.pad(x.detach().float(), (0, pad)).view(rows, -1, MX_BLOCK)
    amax = blocks.abs().amax(dim=-1)
    floor_log2 = ((amax.view(torch.int32) >> 23) & 0xFF) - 127
    shared = (floor_log2 - MX_ELEMENT_EMAX[dtype]).clamp(-E8M0_BIAS, E8M0_BIAS)
    biased = torch.where(torch.isfinite(amax), shared + E8M0_BIAS, 255).to(torch.uint8)
    scale = biased.view(E8M0)
    m = fp8_max(dtype)
    values = torch.nn.functional.pad(x.float(), (0, pad)) if pad else x.float().contiguous()
    q = (values.view(rows, -1, MX_BLOCK) / scale.float().unsqueeze(-1)).clamp(-m, m)
    return Float8Operand(q.to(dtype).view(rows, -1)[:, :k].contiguous(), scale, "mx")
