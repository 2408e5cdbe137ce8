"""MXFP4 (OCP MX v1.0): E2M1 elements in blocks of 32 along ``K``, one E8M0 scale per block.

The block scale ``X = 2**e`` is chosen from the block's amax exactly as MXFP8's
(:func:`mpnb.core.fp8.quantize.quantize_mx`), with E2M1's ``emax = 2`` and max 6:

* ``"rceil"`` (default): ``e = ceil(log2(amax / 6))``, read off amax's float32 bits (exact,
  also a few ulps above ``6 * 2**k``): nothing in the block clips;
* ``"floor"`` (the OCP rule, torchao's default): ``e = floor(log2(amax)) - 2``: the top of a
  block whose amax mantissa is above 1.5 saturates at 6 (up to 25% below its value).

``e`` is clamped to E8M0's [-127, 127]; a block whose amax is inf or NaN gets the NaN scale
(0xFF). The elements are ``e2m1_satfinite(x / X)``, round to nearest even, packed two per byte.

Compared with torchao 0.18's ``to_mx``: the same bytes for every finite block with amax at
least ``2**-124`` (FLOOR) or above ``6 * 2**-127`` (RCEIL); an inf block has the NaN scale
here, 253 (FLOOR) or 254 (RCEIL) there; a block of float32 subnormals is divided by its scale
``2**-127`` here (so it decodes to its values), by ``2**-126`` (FLOOR) or 1 (RCEIL) there; and
torchao's eager RCEIL (``ceil(log2(...))`` in float32) can pick a scale one lower within a few
ulps above ``6 * 2**k``, where its block top then clips.

**Backward options** (Tseng et al. 2025, "Training LLMs with MXFP4", arXiv 2502.20586): a
randomized Hadamard transform along ``K`` (``hadamard=``, e.g.
``hadamard_matrix(32, random_signs(32, seed))``, applied to both operands of a backward
GEMM) bounds the variance of stochastic rounding (``stochastic=True``), which makes the
gradient unbiased. SR must never clip (a clipped value is biased), so with FLOOR scales the
block is multiplied by 3/4 before rounding, as the paper does, and the operand records the
3/4 in ``tensor_divisor`` (its values decode as ``q * X / (3/4)``; the GEMM folds
``1 / (3/4)**2`` into its output); RCEIL scales never clip and need no prescale.

Example::

    >>> op = quantize_mxfp4(x)                              # (M, K), K a multiple of 32
    >>> g = quantize_mxfp4(dy_t, "floor", stochastic=True, generator=0)
"""

from __future__ import annotations

import torch

from mpnb.core.fp8.formats import E8M0, E8M0_BIAS
from mpnb.core.fp8.fp4 import (
    E2M1_EMAX,
    E2M1_MAX,
    check_blocked,
    make_generator,
    pack_e2m1,
    round_to_e2m1,
    stochastic_round_to_e2m1,
)
from mpnb.core.fp8.fp4_gemm import FP4Operand
from mpnb.core.fp8.hadamard import hadamard_transform
from mpnb.core.fp8.quantize import _MANTISSA_BITS, MX_BLOCK, _f32_bits, check_mx_rounding

__all__ = ["MXFP4_BLOCK", "SR_PRESCALE", "mxfp4_scale", "quantize_mxfp4"]

MXFP4_BLOCK = MX_BLOCK  # 32
SR_PRESCALE = 0.75  # Tseng et al.: a FLOOR block's top (< 8) times 3/4 stays within 6


def mxfp4_scale(amax: torch.Tensor, rounding: str = "rceil") -> torch.Tensor:
    """E8M0 scales (``float8_e8m0fnu``) of float32 block amaxes, for E2M1 elements.

    Example::

        >>> mxfp4_scale(torch.tensor([6.0, 7.0, 0.0])).float()      # rceil
        tensor([1.0000e+00, 2.0000e+00, 5.8775e-39])
    """
    check_mx_rounding(rounding)
    if E8M0 is None:
        raise RuntimeError("MXFP4 needs torch.float8_e8m0fnu (torch >= 2.7); upgrade torch.")
    amax = amax.float()
    bits = amax.view(torch.int32)
    shared = ((bits >> 23) & 0xFF) - E8M0_BIAS - E2M1_EMAX
    if rounding == "rceil":
        top = _f32_bits(E2M1_MAX) & _MANTISSA_BITS
        shared = shared + ((bits & _MANTISSA_BITS) > top).int()
    shared = shared.clamp(-E8M0_BIAS, E8M0_BIAS)
    biased = torch.where(torch.isfinite(amax), shared + E8M0_BIAS, 255).to(torch.uint8)
    return biased.view(E8M0)


def quantize_mxfp4(
    x: torch.Tensor,
    rounding: str = "rceil",
    *,
    hadamard: torch.Tensor | None = None,
    stochastic: bool = False,
    generator=None,
) -> FP4Operand:
    """MXFP4 quantization of the 2-D ``x`` along its last dim (see the module doc).

    Args:
        x: float32/bfloat16/float16 ``(rows, K)``, ``K`` a multiple of 32.
        rounding: the E8M0 scale's rounding, ``"rceil"`` (default) or ``"floor"``.
        hadamard: an RHT matrix applied along the last dim first (backward GEMMs), or None.
        stochastic: stochastic rounding of the elements (with the 3/4 prescale under FLOOR).
        generator: int seed or ``torch.Generator`` for ``stochastic`` (required with it).

    Returns an :class:`FP4Operand` labelled ``"mxfp4 (<rounding>)"``.
    """
    check_blocked(x, "MXFP4", MXFP4_BLOCK)
    check_mx_rounding(rounding)
    gen = make_generator(generator, x.device) if stochastic else None
    if hadamard is not None:
        x = hadamard_transform(x, hadamard)
    rows, k = x.shape
    blocks = x.detach().float().view(rows, -1, MXFP4_BLOCK)
    scale = mxfp4_scale(blocks.abs().amax(-1), rounding)
    # a NaN scale makes its whole block NaN here; the codes then say nothing (E2M1 has no NaN)
    v = blocks / scale.float().unsqueeze(-1)
    prescale = SR_PRESCALE if stochastic and rounding == "floor" else 1.0
    if prescale != 1.0:
        v = v * prescale
    v = v.clamp(-E2M1_MAX, E2M1_MAX).view(rows, k)
    codes = stochastic_round_to_e2m1(v, gen) if stochastic else round_to_e2m1(v)
    one = blocks.new_tensor(1.0)
    return FP4Operand(pack_e2m1(codes), scale, one, prescale, MXFP4_BLOCK, f"mxfp4 ({rounding})")
