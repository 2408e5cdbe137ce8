"""FP8 number formats: the float8 dtypes, their ranges, and the E8M0 block-scale format.

* E4M3 (``torch.float8_e4m3fn``): 4 exponent bits, 3 mantissa bits, max 448, no infinities.
  More precision, less range: used for weights and activations.
* E5M2 (``torch.float8_e5m2``): 5 exponent bits, 2 mantissa bits, max 57344, IEEE-like.
  More range: used for gradients in the ``"hybrid"`` format.
* E8M0 (``torch.float8_e8m0fnu``): an unsigned power of two ``2**(bits - 127)`` for
  ``bits`` in 0..254 (255 is NaN): the shared scale of one MX block (OCP MX spec v1.0).
"""

from __future__ import annotations

import torch

__all__ = [
    "E4M3",
    "E5M2",
    "E8M0",
    "E8M0_BIAS",
    "FP8_FORMATS",
    "MX_ELEMENT_EMAX",
    "AMAX_EPS",
    "fp8_max",
    "format_dtypes",
]

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
E8M0 = getattr(torch, "float8_e8m0fnu", None)  # torch >= 2.7
E8M0_BIAS = 127

# Format name -> (dtype of the forward operands (input, weight), dtype of the gradient).
FP8_FORMATS = {"hybrid": (E4M3, E5M2), "e4m3": (E4M3, E4M3)}

# emax of an MX element format: the exponent of its largest power of two (OCP MX spec 5.3).
MX_ELEMENT_EMAX = {E4M3: 8, E5M2: 15}

# The smallest amax a scale is computed from: an all-zero tensor gets a finite scale.
AMAX_EPS = 1e-12


def fp8_max(dtype: torch.dtype) -> float:
    """The largest finite value of a float8 ``dtype`` (448 for E4M3, 57344 for E5M2)."""
    return float(torch.finfo(dtype).max)


def format_dtypes(fp8_format: str) -> tuple[torch.dtype, torch.dtype]:
    """``(forward dtype, gradient dtype)`` of ``"hybrid"`` or ``"e4m3"``.

    Example::

        >>> format_dtypes("hybrid")
        (torch.float8_e4m3fn, torch.float8_e5m2)
    """
    if fp8_format not in FP8_FORMATS:
        raise ValueError(
            f"fp8_format={fp8_format!r} is invalid; use 'hybrid' (E4M3 forward, E5M2 "
            "gradients) or 'e4m3' (E4M3 everywhere)."
        )
    return FP8_FORMATS[fp8_format]
