"""The four-bit ``nn.Linear`` recipes: NVFP4 (TransformerEngine's, or torchao's) and MXFP4.

Each GEMM of a :class:`~mpnb.core.fp8.linear.Float8Linear` gets its operands quantized along
its contraction dim, as for the FP8 recipes, and runs as the emulated block-scaled GEMM of
:func:`mpnb.core.fp8.fp4_gemm.fp4_mm`, or natively in torch's FP4 ``scaled_mm`` on a CUDA
device of capability 10.0+ (sm100) once a first-use check against the emulated GEMM passed
(:func:`mpnb.core.fp8.gemm.scaled_mm_blocker`). The ingredients, each switchable as
TransformerEngine's ``NVFP4BlockScaling`` switches them:

* **2-D weight blocks** (``two_d``): the weight, in its forward and its ``dx`` GEMM, takes
  16x16 blocks, so ``W`` and ``W^T`` quantize to the same values (TE ``disable_2d_quantization``);
* **the random Hadamard transform** (``rht``): TE's 16-point matrix applied along the token
  dim to both Wgrad operands (``dy^T`` and ``x^T``), the amax taken after it; the transform is
  orthonormal, so the product is unchanged in exact arithmetic and outliers are spread across
  blocks (TE ``disable_rht``);
* **stochastic rounding of the gradients** (``stochastic_rounding``): ``dy`` in both backward
  GEMMs, from a seeded counter per layer (reproducible; TE
  ``disable_stochastic_rounding``).

A dimension that is not a multiple of the block (or of 16 rows, for 2-D blocks) is padded with
zeros, which change neither an amax nor a product; the GEMM's result is cut back to its shape.

Example::

    >>> NVFP4BlockScaling(rht=False).label
    'nvfp4 (TE v2.14, 2d, sr)'
"""

from __future__ import annotations

import abc
import functools
from dataclasses import dataclass
from typing import ClassVar

import torch

from mpnb.core.fp8._recipe import Float8Recipe
from mpnb.core.fp8.fp4_gemm import FP4Operand
from mpnb.core.fp8.hadamard import hadamard_transform, te_rht_matrix
from mpnb.core.fp8.mxfp4 import quantize_mxfp4
from mpnb.core.fp8.nvfp4 import (
    TE_FORMULAS,
    quantize_nvfp4,
    quantize_nvfp4_torchao,
    torchao_per_tensor_scale,
)
from mpnb.core.fp8.quantize import check_mx_rounding

__all__ = ["FP4Recipe", "NVFP4BlockScaling", "MXFP4BlockScaling", "padded"]

_SEED_MASK = (1 << 62) - 1
_TILE = 16  # rows of a 2-D weight block


@functools.lru_cache(maxsize=8)
def _rht_on(device: torch.device) -> torch.Tensor:
    """TE's RHT matrix on ``device``, built once per device: a step neither rebuilds it (its
    sign check reads the host) nor copies it to the GPU."""
    return te_rht_matrix().to(device)


def padded(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """``t`` (2-D) with zero rows and columns appended up to multiples of ``rows``/``cols``."""
    r, c = (-t.shape[0]) % rows, (-t.shape[1]) % cols
    return t if not (r or c) else torch.nn.functional.pad(t, (0, c, 0, r))


@dataclass(frozen=True)
class FP4Recipe(Float8Recipe):
    """What the four-bit recipes share: padding to the blocks, the RHT on the Wgrad operands,
    stochastic rounding of the gradients from a per-layer counter.

    Args:
        rht: TE's 16-point random Hadamard transform on both Wgrad operands.
        stochastic_rounding: round the gradient's elements stochastically.
        seed: the stochastic rounding's seed (mixed with the layer's call counter).
    """

    rht: bool = True
    stochastic_rounding: bool = True
    seed: int = 0
    granularity: ClassVar[str] = "fp4"
    block: ClassVar[int] = 16
    #: the stochastic rounding's draw counter, saved with the layer (a resumed run rounds on
    #: with the bits an uninterrupted one would use)
    state_names: ClassVar[tuple[str, ...]] = ("fp4_sr_draws",)

    def init_state(self, layer) -> None:
        """Register the draw counter (an int64 buffer; the host keeps its own copy, so a step
        never reads it)."""
        if "fp4_sr_draws" not in layer._buffers:
            dev = layer.weight.device if layer.weight.device.type != "meta" else None
            layer.register_buffer("fp4_sr_draws", torch.zeros((), dtype=torch.int64, device=dev))
        layer._fp4_draws = 0

    def reset_state(self, layer) -> None:
        """The draw counter back to 0."""
        layer.fp4_sr_draws.zero_()
        layer._fp4_draws = 0

    def after_load(self, layer) -> None:
        """The host's copy of the loaded draw counter (read once, at the load)."""
        layer._fp4_draws = int(layer.fp4_sr_draws)

    def tile_rows(self, role: str) -> int:
        """The rows of one block of ``role``'s operand (1: blocks along the last dim only)."""
        return 1

    def hadamard_for(self, gemm: str, device) -> torch.Tensor | None:
        """TE's RHT matrix on ``device`` where ``gemm`` transforms its operands (the Wgrad
        GEMM, with ``rht``), else None."""
        return _rht_on(device) if self.rht and gemm == "grad_weight" else None

    def source(self, t: torch.Tensor, role: str, gemm: str = "") -> torch.Tensor:
        """The tensor :meth:`quantize` quantizes for ``t``: padded to whole blocks and, where
        :meth:`hadamard_for` gives a matrix, transformed (what statistics compare with)."""
        t = padded(t, self.tile_rows(role), self.block)
        hadamard = self.hadamard_for(gemm, t.device)
        return t if hadamard is None else hadamard_transform(t, hadamard)

    def quantize(self, layer, t, role, update, gemm=""):
        """``t`` padded to the blocks, transformed (Wgrad operands, with ``rht``), quantized
        with stochastic rounding for ``"grad_output"`` (with ``stochastic_rounding``)."""
        rows = self.tile_rows(role)
        t = padded(t, rows, self.block)
        hadamard = self.hadamard_for(gemm, t.device)
        sr = self.stochastic_rounding and role == "grad_output"
        gen = _next_seed(layer, self.seed) if sr else None
        return self._quantize(t, rows, hadamard, sr, gen)

    @abc.abstractmethod
    def _quantize(self, t, rows, hadamard, sr, gen) -> FP4Operand:
        """Quantize the padded ``t`` in blocks of ``rows`` x :attr:`block` (``hadamard``: the
        matrix to transform it by first, or None; ``sr``: round stochastically from ``gen``)."""

    def _switches(self) -> list[str]:
        return [s for s, on in (("rht", self.rht), ("sr", self.stochastic_rounding)) if on]


def _next_seed(layer, seed: int) -> int:
    """A fresh seed for one stochastically rounded operand of ``layer`` (a counter per layer,
    so a run with the same seed rounds the same bits)."""
    n = getattr(layer, "_fp4_draws", 0)
    layer._fp4_draws = n + 1
    counter = getattr(layer, "fp4_sr_draws", None)
    if counter is not None:
        counter.fill_(n + 1)  # written from the host's count: no read of the device
    return (seed * 1_000_003 + n * 7_919 + 1) & _SEED_MASK


@dataclass(frozen=True)
class NVFP4BlockScaling(FP4Recipe):
    """NVFP4 as TransformerEngine's ``NVFP4BlockScaling``: E2M1 elements in blocks of 16,
    E4M3 block scales, a float32 tensor scale (:func:`mpnb.core.fp8.nvfp4.quantize_nvfp4`).

    Args:
        two_d: 16x16 blocks for the weight (default True, as TE).
        formula: TE's block-scale rounding, ``"v2.14"`` (default) or ``"v2.13"``.
        torchao: torchao's NVFP4 instead (block scales clamped below at E4M3's smallest
            normal, elements divided by the scale): a different recipe, labelled so; it has
            no 2-D blocks (``two_d`` is ignored).
        rht, stochastic_rounding, seed: as :class:`FP4Recipe`.
    """

    two_d: bool = True
    formula: str = "v2.14"
    torchao: bool = False
    name: ClassVar[str] = "nvfp4"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.formula not in TE_FORMULAS:
            raise ValueError(
                f"NVFP4BlockScaling: formula={self.formula!r}; use one of {TE_FORMULAS} (the "
                "TransformerEngine release whose block-scale rounding to follow)."
            )

    @property
    def label(self) -> str:
        """``"nvfp4 (TE v2.14, 2d, rht, sr)"``, ``"nvfp4 (torchao, sr)"``: what it computes."""
        if self.torchao:
            return f"nvfp4 ({', '.join(['torchao', *self._switches()])})"
        two_d = ["2d"] if self.two_d else []
        return f"nvfp4 ({', '.join([f'TE {self.formula}', *two_d, *self._switches()])})"

    def tile_rows(self, role: str) -> int:
        """16 for the weight with ``two_d`` (TE's 16x16 blocks), else 1."""
        return _TILE if self.two_d and not self.torchao and role == "weight" else 1

    def _quantize(self, t, rows, hadamard, sr, gen) -> FP4Operand:
        if self.torchao:
            if hadamard is not None:
                t = hadamard_transform(t, hadamard)
            if sr:
                raise ValueError(
                    "NVFP4BlockScaling(torchao=True): torchao's NVFP4 rounds to nearest; pass "
                    "stochastic_rounding=False with it."
                )
            return quantize_nvfp4_torchao(t, torchao_per_tensor_scale(t))
        return quantize_nvfp4(
            t, tile_rows=rows, hadamard=hadamard, stochastic=sr, generator=gen,
            formula=self.formula,
        )  # fmt: skip


@dataclass(frozen=True)
class MXFP4BlockScaling(FP4Recipe):
    """MXFP4: E2M1 elements in blocks of 32 with E8M0 scales
    (:func:`mpnb.core.fp8.mxfp4.quantize_mxfp4`); the RHT and stochastic rounding on the
    backward are off by default (Tseng et al. 2025 turn both on: ``"mxfp4+sr+rht"``).

    Args:
        scale_rounding: ``"rceil"`` (default) or ``"floor"`` (OCP MX).
        rht, stochastic_rounding, seed: as :class:`FP4Recipe` (default off).
    """

    rht: bool = False
    stochastic_rounding: bool = False
    scale_rounding: str = "rceil"
    name: ClassVar[str] = "mxfp4"
    block: ClassVar[int] = 32

    def __post_init__(self) -> None:
        super().__post_init__()
        check_mx_rounding(self.scale_rounding)

    @property
    def label(self) -> str:
        """``"mxfp4 (rceil scales)"``, ``"mxfp4 (rceil scales, rht, sr)"``."""
        return f"mxfp4 ({', '.join([f'{self.scale_rounding} scales', *self._switches()])})"

    def _quantize(self, t, rows, hadamard, sr, gen) -> FP4Operand:
        return quantize_mxfp4(
            t, self.scale_rounding, hadamard=hadamard, stochastic=sr, generator=gen
        )
