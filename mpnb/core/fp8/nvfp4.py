"""NVFP4: E2M1 elements in blocks of 16 with E4M3 block scales and a float32 tensor scale.

Two recipes, labelled apart because they round differently:

**TransformerEngine's** (:func:`quantize_nvfp4`, TE v2.14 by default), all in float32:

* global encode scale ``S_enc = min(448 * 6 / amax, FLT_MAX)``, or 1 when ``amax`` is 0 or
  the quotient is 0 (an inf amax) (:func:`global_encode_scale`);
* block decode scale ``S_dec_b = e4m3(min(block_amax * (S_enc * (1/6)), 448))``: rounded to
  E4M3 once, no lower clamp (a block far below the tensor's amax gets scale 0 and decodes
  to 0). TE v2.13's reference and quantize-transpose kernel computed ``(block_amax / 6) *
  S_enc`` instead (its rowwise-only kernel ``(block_amax * (1/6)) * S_enc``): the same value
  up to a float32 rounding, which moves the E4M3 result where it lands next to a tie
  (``formula="v2.13"`` is the reference's);
* elements ``e2m1_satfinite(x * min(1 / (S_dec_b * (1/S_enc)), FLT_MAX))``: round to nearest
  even, or stochastic rounding (gradients); the reciprocal of ``S_enc`` is taken first, as
  TE's kernels and reference do (the issue's ``S_dec_b / S_enc``, rounded TE's way);
* 2-D blocks (``tile_rows=16``, TE's weights): one amax per 16 x 16 tile, so ``W`` and
  ``W^T`` quantize to the same values; the RHT (``hadamard=``, TE's Wgrad operands) runs
  before everything, the amax is taken after it;
* decoding: ``q * S_dec_b * amax / (448 * 6)`` (``tensor_scale=amax``, ``tensor_divisor=2688``).

A NaN anywhere makes ``S_enc`` NaN and every block scale NaN; an inf saturates to ±6 in a
block of scale 448, and the tensor's amax (``tensor_scale``) keeps the inf for an overflow
check. TE's ``disable_rht`` / ``disable_stochastic_rounding`` / ``disable_2d_quantization``
map to ``hadamard=None`` / ``stochastic=False`` / ``tile_rows=1``.

**torchao's** (:func:`quantize_nvfp4_torchao`, torchao 0.18 ``nvfp4_quantize``): the block
scale ``amax / 6`` (over ``per_tensor_scale`` when one is given) is clamped *below* to the
smallest E4M3 normal ``2**-6`` before its cast, and the elements are multiplied by
``1 / scale`` (by ``(1 / per_tensor_scale) / scale`` with two levels).

Example::

    >>> op = quantize_nvfp4(x)                       # (M, K), K a multiple of 16
    >>> op.data.shape, op.block_scale.dtype          # ((M, K // 2), torch.float8_e4m3fn)
    >>> err = (op.dequantize() - x).norm() / x.norm()
"""

from __future__ import annotations

import torch

from mpnb.core.fp8.formats import E4M3, fp8_max
from mpnb.core.fp8.fp4 import (
    E2M1_MAX,
    check_blocked,
    check_float,
    make_generator,
    pack_e2m1,
    round_to_e2m1,
    stochastic_round_to_e2m1,
)
from mpnb.core.fp8.fp4_gemm import FP4Operand
from mpnb.core.fp8.hadamard import hadamard_transform

__all__ = [
    "NVFP4_BLOCK",
    "TE_FORMULAS",
    "global_encode_scale",
    "te_block_decode_scale",
    "quantize_nvfp4",
    "torchao_per_tensor_scale",
    "quantize_nvfp4_torchao",
]

NVFP4_BLOCK = 16
TE_FORMULAS = ("v2.14", "v2.13")  # the block-scale formula of that TE release; first: default
_E4M3_MAX = fp8_max(E4M3)  # 448
_TENSOR_DIVISOR = _E4M3_MAX * E2M1_MAX  # 2688: the largest block scale times the largest element
_FLT_MAX = torch.finfo(torch.float32).max


def _check_input(x: torch.Tensor, tile_rows: int) -> None:
    if tile_rows not in (1, NVFP4_BLOCK):
        raise ValueError(
            f"tile_rows={tile_rows!r} is invalid; use 1 (1x16 blocks) or 16 (16x16 blocks, "
            "TE's weights)."
        )
    check_blocked(x, "NVFP4", NVFP4_BLOCK, tile_rows)


def _block_amax(x32: torch.Tensor, tile_rows: int) -> torch.Tensor:
    """``(rows, K // 16)`` amax of each 1x16 block, or of each 16x16 tile repeated per row."""
    rows, k = x32.shape
    if tile_rows == 1:
        return x32.view(rows, -1, NVFP4_BLOCK).abs().amax(-1)
    tiles = x32.view(rows // tile_rows, tile_rows, -1, NVFP4_BLOCK).abs().amax(dim=(1, 3))
    return tiles.repeat_interleave(tile_rows, dim=0)


def global_encode_scale(amax: torch.Tensor) -> torch.Tensor:
    """TE's ``S_enc = min(448 * 6 / amax, FLT_MAX)`` in float32; 1 where ``amax`` or it is 0.

    Example::

        >>> global_encode_scale(torch.tensor(2688.0)), global_encode_scale(torch.tensor(0.0))
        (tensor(1.), tensor(1.))
    """
    amax = amax.float()
    s = torch.minimum(amax.new_tensor(_TENSOR_DIVISOR) / amax, amax.new_tensor(_FLT_MAX))
    return torch.where((amax == 0) | (s == 0), 1.0, s)


def _check_formula(formula: str) -> str:
    if formula not in TE_FORMULAS:
        raise ValueError(
            f"formula={formula!r} is invalid; use 'v2.14' (TE from v2.14: block_amax * "
            "(S_enc * (1/6))) or 'v2.13' (TE up to v2.13: (block_amax / 6) * S_enc)."
        )
    return formula


def te_block_decode_scale(block_amax, s_enc, formula: str = "v2.14") -> torch.Tensor:
    """TE's E4M3 block decode scales from float32 block amaxes and ``S_enc``.

    ``"v2.14"``: ``e4m3(min(block_amax * (S_enc * (1/6)), 448))``; ``"v2.13"``:
    ``e4m3(min((block_amax / 6) * S_enc, 448))``. ``1/6`` is its float32 rounding; the cast
    rounds to nearest even, a value below E4M3's smallest subnormal half becomes 0.
    """
    _check_formula(formula)
    six = block_amax.new_tensor(E2M1_MAX)
    if formula == "v2.14":
        d = block_amax * (s_enc * torch.reciprocal(six))
    else:
        d = (block_amax / six) * s_enc
    d = torch.minimum(d, d.new_tensor(_FLT_MAX)).clamp(-_E4M3_MAX, _E4M3_MAX)
    return d.to(E4M3)


def _round(v: torch.Tensor, stochastic: bool, gen) -> torch.Tensor:
    return stochastic_round_to_e2m1(v, gen) if stochastic else round_to_e2m1(v)


def quantize_nvfp4(
    x: torch.Tensor,
    *,
    tile_rows: int = 1,
    hadamard: torch.Tensor | None = None,
    stochastic: bool = False,
    generator=None,
    formula: str = "v2.14",
) -> FP4Operand:
    """TransformerEngine's NVFP4 quantization of the 2-D ``x`` along its last dim.

    Args:
        x: float32/bfloat16/float16 ``(rows, K)``, ``K`` a multiple of 16.
        tile_rows: 1 (1x16 blocks) or 16 (16x16 blocks; ``rows`` a multiple of 16).
        hadamard: an RHT matrix (:func:`mpnb.core.fp8.hadamard.te_rht_matrix`) applied along
            the last dim first, or None.
        stochastic: stochastic rounding of the elements (TE's gradients) instead of nearest.
        generator: int seed or ``torch.Generator`` for ``stochastic`` (required with it).
        formula: ``"v2.14"`` (default) or ``"v2.13"``: which TE release's block-scale rounding.
    """
    _check_input(x, tile_rows)
    _check_formula(formula)
    gen = make_generator(generator, x.device) if stochastic else None
    if hadamard is not None:
        x = hadamard_transform(x, hadamard)
    x32 = x.detach().float()
    amax = x32.abs().max()
    s_enc = global_encode_scale(amax)
    scale = te_block_decode_scale(_block_amax(x32, tile_rows), s_enc, formula)
    s_dec = torch.reciprocal(s_enc)
    encode = torch.minimum(torch.reciprocal(scale.float() * s_dec), s_enc.new_tensor(_FLT_MAX))
    rows, k = x32.shape
    v = (x32.view(rows, -1, NVFP4_BLOCK) * encode.unsqueeze(-1)).clamp(-E2M1_MAX, E2M1_MAX)
    codes = _round(v.view(rows, k), stochastic, gen)
    return FP4Operand(
        pack_e2m1(codes), scale, amax, _TENSOR_DIVISOR, NVFP4_BLOCK, f"nvfp4 (TE {formula})"
    )


def torchao_per_tensor_scale(x: torch.Tensor) -> torch.Tensor:
    """torchao's ``per_tensor_amax_to_scale``: ``amax(x) / (448 * 6)`` in float32."""
    return check_float(x).detach().float().abs().max() / (_E4M3_MAX * E2M1_MAX)


def quantize_nvfp4_torchao(x: torch.Tensor, per_tensor_scale: torch.Tensor | None = None):
    """torchao 0.18's NVFP4 (``nvfp4_quantize``): block scales clamped below at ``2**-6``.

    Args:
        x: float32/bfloat16/float16 ``(rows, K)``, ``K`` a multiple of 16.
        per_tensor_scale: None (one level: E4M3 block scales only) or a one-element float32
            tensor (two levels; :func:`torchao_per_tensor_scale` gives torchao's choice).

    Returns an :class:`FP4Operand` labelled ``"nvfp4 (torchao)"``.
    """
    _check_input(x, 1)
    rows, k = x.shape
    x32 = x.detach().float().view(rows, -1, NVFP4_BLOCK)
    block = x32.abs().amax(-1) / E2M1_MAX
    tiny = torch.finfo(E4M3).tiny
    if per_tensor_scale is None:
        scale = torch.clamp(block, min=tiny, max=_E4M3_MAX).to(E4M3)
        recip = 1.0 / scale.float()
        tensor_scale = x32.new_tensor(1.0)
    else:
        if not isinstance(per_tensor_scale, torch.Tensor) or per_tensor_scale.numel() != 1:
            raise ValueError(
                "per_tensor_scale must be a one-element float32 tensor, e.g. "
                "torchao_per_tensor_scale(x); pass None for single-level scaling."
            )
        pts = per_tensor_scale.float().reshape(())
        scale = torch.clamp(block.float() / pts, min=tiny, max=_E4M3_MAX).to(E4M3)
        recip = (1.0 / pts) / scale.float()
        tensor_scale = pts
    v = torch.clamp(x32 * recip.unsqueeze(-1), -E2M1_MAX, E2M1_MAX).view(rows, k)
    return FP4Operand(
        pack_e2m1(round_to_e2m1(v)), scale, tensor_scale, 1.0, NVFP4_BLOCK, "nvfp4 (torchao)"
    )
