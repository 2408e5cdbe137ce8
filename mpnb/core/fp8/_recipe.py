"""The base of the low-precision ``nn.Linear`` recipes (:mod:`mpnb.core.fp8.recipes`): the
operand roles and :class:`Float8Recipe`, which every recipe (FP8, MX, four-bit) derives from."""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import ClassVar

import torch

from mpnb.core.fp8.formats import format_dtypes

__all__ = ["Float8Recipe", "ROLES"]

ROLES = ("input", "weight", "grad_output")


@dataclass(frozen=True)
class Float8Recipe(abc.ABC):
    """Base of the recipes: the FP8 format and the per-operand quantization rule.

    Args:
        fp8_format: ``"hybrid"`` (E4M3 input and weight, E5M2 gradients) or ``"e4m3"``.
    """

    fp8_format: str = "hybrid"
    name: ClassVar[str] = ""
    granularity: ClassVar[str] = "tensorwise"
    #: the buffers :meth:`init_state` registers on a layer (its entries in a state dict)
    state_names: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self) -> None:
        format_dtypes(self.fp8_format)

    def dtype(self, role: str) -> torch.dtype:
        """The float8 dtype of ``role`` (``"input"``, ``"weight"`` or ``"grad_output"``)."""
        fwd, bwd = format_dtypes(self.fp8_format)
        return bwd if role == "grad_output" else fwd

    @property
    def label(self) -> str:
        """How rows and messages name the recipe (the name, plus any rule it depends on)."""
        return self.name

    @property
    def per_tensor(self) -> bool:
        """True when one scale covers a whole tensor (its quantization survives a transpose)."""
        return self.granularity == "tensorwise"

    def init_state(self, layer: torch.nn.Module) -> None:
        """Register the layer's recipe state (buffers); stateless recipes register nothing."""
        return None

    def reset_state(self, layer: torch.nn.Module) -> None:
        """Put the layer's recipe state back to its initial values (no-op without state)."""
        return None

    def after_load(self, layer: torch.nn.Module) -> None:
        """Take up what a checkpoint load put in the layer's buffers (no-op by default)."""
        return None

    @abc.abstractmethod
    def quantize(self, layer, t: torch.Tensor, role: str, update: bool, gemm: str = ""):
        """Quantize the 2-D ``t`` along its last dim; ``update`` records state (training).

        ``gemm`` names the GEMM the operand is for (``"forward"``, ``"grad_input"``,
        ``"grad_weight"``): the four-bit recipes transform the Wgrad operands only."""
