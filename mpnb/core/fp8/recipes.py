"""FP8 training recipes: how each GEMM operand of a linear layer is scaled into float8.

A recipe is a small frozen object; its rule (how to quantize an operand, what state a layer
keeps) lives in it. A layer's three tensors have roles: ``"input"`` and ``"weight"`` (forward
dtype) and ``"grad_output"`` (gradient dtype: E5M2 in the ``"hybrid"`` format).

===================  ==============================================  ==========================
recipe               scale of each operand                           like
===================  ==============================================  ==========================
TensorwiseScaling    one per tensor, from its amax now               torchao ``tensorwise``
DelayedScaling       one per tensor, from an amax history (state)    TransformerEngine
RowwiseScaling       one per row of the GEMM operand, powers of two  torchao ``rowwise``
MXFP8BlockScaling    one E8M0 power of two per 32 values, rounded    TE ``MXFP8``, torchao
                     up (``"rceil"``) or down (``"floor"``, OCP MX)  ``RCEIL`` (default)
NVFP4BlockScaling    E2M1 in blocks of 16, E4M3 block scales and a   TE ``NVFP4BlockScaling``
                     float32 tensor scale; 16x16 weight blocks, RHT  (or torchao's NVFP4)
                     on Wgrad, stochastic rounding of gradients
MXFP4BlockScaling    E2M1 in blocks of 32, E8M0 scales; optional     torchao MXFP4, Tseng et
                     RHT and stochastic rounding on the backward     al. 2025
===================  ==============================================  ==========================

Example::

    >>> recipe("delayed", amax_history_len=16).amax_compute_algo
    'max'
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from mpnb.core.fp8._recipe import ROLES, Float8Recipe
from mpnb.core.fp8.formats import fp8_max
from mpnb.core.fp8.fp4_recipes import MXFP4BlockScaling, NVFP4BlockScaling
from mpnb.core.fp8.quantize import (
    check_mx_rounding,
    quantize_mx,
    quantize_rowwise,
    quantize_tensorwise,
    quantize_with_scale,
)

__all__ = [
    "Float8Recipe",
    "TensorwiseScaling",
    "DelayedScaling",
    "RowwiseScaling",
    "MXFP8BlockScaling",
    "NVFP4BlockScaling",
    "MXFP4BlockScaling",
    "RECIPES",
    "ROLES",
    "recipe",
]


@dataclass(frozen=True)
class TensorwiseScaling(Float8Recipe):
    """Current per-tensor scaling: each tensor is scaled by ``fp8_max / amax`` of itself.

    Args:
        fp8_format: ``"hybrid"`` (default) or ``"e4m3"``.
        power_of_2_scales: round each scale down to a power of two (exact rescaling).
    """

    power_of_2_scales: bool = False
    name: ClassVar[str] = "tensorwise"

    def quantize(self, layer, t, role, update, gemm=""):
        """Per-tensor quantization with a scale from ``t``'s own amax (no state)."""
        return quantize_tensorwise(t, self.dtype(role), self.power_of_2_scales)


@dataclass(frozen=True)
class DelayedScaling(Float8Recipe):
    """Per-tensor scaling from an amax history (TransformerEngine's ``DelayedScaling``).

    Step ``t`` quantizes each tensor with a scale computed after step ``t-1`` (1.0 at the
    start): ``fp8_max / amax / 2**margin``, where ``amax`` reduces the last
    ``amax_history_len`` amaxes (``"max"``, or ``"most_recent"``), clamped to the largest
    finite float32 (TransformerEngine's rule: below an amax of 448 / 3.4e38 = 1.3e-36 the
    E4M3 scale would be infinite). A reduced amax of 0 keeps the previous scale. Finite
    values beyond the scaled range saturate; inf and NaN inputs (and gradients) quantize to
    NaN, so the step's gradients are non-finite and a loss scaler skips it, as with every
    other recipe. Such a tensor's amax is not recorded: the history (and the scale) stay as
    they were, rather than holding the inf, and freezing the scale, for ``amax_history_len``
    steps.

    Each layer keeps ``fp8_amax_history`` (``(amax_history_len, 3)``, newest first, one column
    per role) and ``fp8_scale`` (``(3,)``) as buffers: in its ``state_dict``, restored on load.
    The history advances once per forward (input, weight) and backward (grad_output) of a
    layer in training mode; eval-mode forwards use the scales without recording.

    Args:
        fp8_format: ``"hybrid"`` (default, as TransformerEngine) or ``"e4m3"``.
        amax_history_len: history length (TransformerEngine's default 1024).
        amax_compute_algo: ``"max"`` (default) or ``"most_recent"``.
        margin: scale down by ``2**margin`` for headroom (default 0).
    """

    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    margin: int = 0
    name: ClassVar[str] = "delayed"
    state_names: ClassVar[tuple[str, ...]] = ("fp8_amax_history", "fp8_scale")

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.amax_history_len, int) or self.amax_history_len < 1:
            raise ValueError(
                f"amax_history_len={self.amax_history_len!r} is invalid; use an int >= 1 "
                "(TransformerEngine's default is 1024)."
            )
        if self.amax_compute_algo not in ("max", "most_recent"):
            raise ValueError(
                f"amax_compute_algo={self.amax_compute_algo!r} is invalid; use 'max' or "
                "'most_recent'."
            )
        if not isinstance(self.margin, int) or self.margin < 0:
            raise ValueError(f"margin={self.margin!r} is invalid; use an int >= 0.")

    def init_state(self, layer):
        """Register ``fp8_amax_history`` (zeros) and ``fp8_scale`` (ones) on the weight's device."""
        dev = layer.weight.device
        layer.register_buffer("fp8_amax_history", torch.zeros(self.amax_history_len, 3, device=dev))
        layer.register_buffer("fp8_scale", torch.ones(3, device=dev))

    def reset_state(self, layer):
        """Zero the history and set the scales back to 1."""
        with torch.no_grad():
            layer.fp8_amax_history.zero_()
            layer.fp8_scale.fill_(1.0)

    def quantize(self, layer, t, role, update, gemm=""):
        """Quantize with the stored scale, then record ``t``'s amax when ``update``."""
        i = ROLES.index(role)
        dtype = self.dtype(role)
        op = quantize_with_scale(t, layer.fp8_scale[i].clone(), dtype, "tensorwise")
        if update:
            self._record(layer, i, t.detach().abs().amax().float(), dtype)
        return op

    def _record(self, layer, i: int, amax: torch.Tensor, dtype: torch.dtype) -> None:
        with torch.no_grad():
            hist, scale = layer.fp8_amax_history, layer.fp8_scale
            # a non-finite amax (an overflowing step) is not recorded: no host sync, a select
            rolled = torch.roll(hist[:, i], 1)
            rolled[0] = amax.clamp(max=_largest(hist.dtype))
            hist[:, i] = torch.where(torch.isfinite(amax), rolled, hist[:, i])
            col = hist[:, i].float()  # float32 math even if the buffers were cast to half
            reduced = col.max() if self.amax_compute_algo == "max" else col[0]
            new = reduced.new_tensor(fp8_max(dtype)) / reduced / 2.0**self.margin
            new = new.clamp(max=_largest(scale.dtype))  # 448 / 1e-38 is inf in float32
            ok = (reduced > 0) & torch.isfinite(reduced)
            scale[i] = torch.where(ok, new, scale[i].float())


def _largest(buffer_dtype: torch.dtype) -> float:
    """The largest value the float32 amax/scale math may store in a buffer of ``buffer_dtype``:
    float32's max, or the buffer's own when smaller (buffers cast to half by ``model.half()``;
    a float64 buffer, after ``.to(torch.float64)``, still gets float32's)."""
    return min(torch.finfo(torch.float32).max, torch.finfo(buffer_dtype).max)


@dataclass(frozen=True)
class RowwiseScaling(Float8Recipe):
    """One scale per row of each GEMM operand (torchao's ``rowwise`` recipe).

    Each GEMM quantizes its operands along its own contraction dim, so the backward
    re-quantizes the input and the gradient along the batch dim and the weight along the
    output dim (from the high-precision tensors, as torchao does).

    Args:
        fp8_format: ``"e4m3"`` (default, as torchao) or ``"hybrid"``.
        power_of_2_scales: round scales down to powers of two (default True, as torchao).
    """

    fp8_format: str = "e4m3"
    power_of_2_scales: bool = True
    name: ClassVar[str] = "rowwise"
    granularity: ClassVar[str] = "rowwise"

    def quantize(self, layer, t, role, update, gemm=""):
        """Per-row quantization along the last dim (no state)."""
        return quantize_rowwise(t, self.dtype(role), self.power_of_2_scales)


@dataclass(frozen=True)
class MXFP8BlockScaling(Float8Recipe):
    """MXFP8: blocks of 32 values along the contraction dim share one E8M0 power of two.

    ``scale_rounding`` says how a block's ``amax / fp8_max`` becomes a power of two:

    * ``"rceil"`` (default): rounded up, ``2**ceil(log2(amax / fp8_max))``, so no value of
      the block clips. This is TransformerEngine's MXFP8 rule and torchao's ``RCEIL``.
    * ``"floor"``: the OCP MX spec v1.0 rule, ``2**(floor(log2(amax)) - emax)`` (emax 8 for
      E4M3): the top of a block whose amax has a mantissa above 1.75 saturates at 448, up to
      12.5% below its value (most blocks of a default ``nn.Linear(1024, n)`` weight clip:
      its values' bound, 1/32, is a power of two).

    The GEMM runs in torch's block-scaled ``torch._scaled_mm`` on a CUDA device of capability
    10.0+ (sm100) once a first-use check passed, else from the dequantized operands in float32
    (see :mod:`mpnb.core.fp8.gemm`); a layer says so once with a ``Float8FallbackWarning``.

    Args:
        fp8_format: ``"e4m3"`` (default, as TransformerEngine's MXFP8) or ``"hybrid"``.
        scale_rounding: ``"rceil"`` (default) or ``"floor"``.

    Example::

        >>> MXFP8BlockScaling(scale_rounding="floor").label
        'mxfp8 (floor scales)'
    """

    fp8_format: str = "e4m3"
    scale_rounding: str = "rceil"
    name: ClassVar[str] = "mxfp8"
    granularity: ClassVar[str] = "mx"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_mx_rounding(self.scale_rounding)

    @property
    def label(self) -> str:
        """``"mxfp8 (rceil scales)"`` or ``"mxfp8 (floor scales)"``."""
        return f"{self.name} ({self.scale_rounding} scales)"

    def quantize(self, layer, t, role, update, gemm=""):
        """32-element blocks along the last dim with E8M0 scales (no state)."""
        return quantize_mx(t, self.dtype(role), self.scale_rounding)


RECIPES = {
    cls.name: cls
    for cls in (
        TensorwiseScaling,
        DelayedScaling,
        RowwiseScaling,
        MXFP8BlockScaling,
        NVFP4BlockScaling,
        MXFP4BlockScaling,
    )
}


def recipe(spec: str | Float8Recipe = "tensorwise", **options) -> Float8Recipe:
    """A recipe from its name (``"tensorwise"``, ``"delayed"``, ``"rowwise"``, ``"mxfp8"``).

    Args:
        spec: a name, or a recipe object (returned as is when no options are given).
        **options: the recipe's fields (``fp8_format``, ``amax_history_len``, ...).

    Example::

        >>> recipe("delayed", amax_history_len=16, margin=1)
        DelayedScaling(fp8_format='hybrid', amax_history_len=16, amax_compute_algo='max', margin=1)
    """
    if isinstance(spec, Float8Recipe):
        if options:
            raise ValueError(
                "recipe(): pass options with a recipe name, not with a recipe object "
                "(use dataclasses.replace(recipe, ...) to change one)."
            )
        return spec
    if spec not in RECIPES:
        raise ValueError(f"unknown FP8 recipe {spec!r}; valid choices: {', '.join(RECIPES)}.")
    try:
        return RECIPES[spec](**options)
    except TypeError as e:
        raise ValueError(
            f"recipe {spec!r}: {e}; see help(mpnb.fp8.{RECIPES[spec].__name__})."
        ) from None
