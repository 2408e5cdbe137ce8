"""Pure half precision as a configuration: every weight, grad and activation in one half
dtype, no fp32 masters (amp's O3 with that dtype); variants round the optimizer's update."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mpnb.core import amp
from mpnb.core.dtype_names import short_name
from mpnb.core.precision_configs._base import PrecisionConfig, StoredRole, require_option
from mpnb.core.precision_configs._optimizers import make_optimizer, optimizer_code, substitute_note
from mpnb.core.precision_configs._snippets import amp_loop

__all__ = ["PureHalfConfig", "KAHAN_BUFFERS"]


def _kahan_buffers(model, optimizer) -> list:
    if optimizer is None:
        return []
    return [
        v
        for state in optimizer.state.values()
        for k, v in state.items()
        if isinstance(v, torch.Tensor) and ("compensation" in str(k) or "kahan" in str(k))
    ]


KAHAN_BUFFERS = StoredRole(
    "kahan_buffers",
    "the Kahan compensation buffers of a fused optimizer built with kahan_summation=True (its "
    "state entries named *compensation* / *kahan*)",
    _kahan_buffers,
)


@dataclass(frozen=True)
class PureHalfConfig(PrecisionConfig):
    """Pure half training (O3 with ``half`` fixed); variants need an optimizer option.

    Attributes:
        half: the torch name of its half dtype (``"bfloat16"``).
        optimizer_option: the constructor option its optimizer needs (``stochastic_rounding``
            / ``kahan_summation`` of mpnb's fused optimizers); :meth:`make_optimizer` builds
            the fused optimizer of the asked one's rule with it.
    """

    half: str = "bfloat16"
    optimizer_option: str | None = None

    @property
    def dtype(self) -> torch.dtype:
        """Its half dtype as a torch dtype."""
        return getattr(torch, self.half)

    def apply(self, model, optimizer=None, half_dtype=None):
        """Check the optimizer option, then ``amp.initialize(..., "O3", half)``."""
        if self.optimizer_option is not None:
            plain = self.name.split("+")[0]  # the configuration without the option
            require_option(self, self.optimizer_option, optimizer, plain)

        out = amp.initialize(model, optimizer, opt_level="O3", half_dtype=self.dtype, verbosity=0)
        return out if optimizer is not None else (out, None)

    def make_optimizer(self, name: str, params, lr: float):
        """``name``'s optimizer, or mpnb's fused one of its rule with :attr:`optimizer_option`."""
        return make_optimizer(name, params, lr, self.optimizer_option)

    def optimizer_note(self, name: str) -> str:
        """Which fused optimizer stands in for ``name`` (``""`` without an option)."""
        if self.optimizer_option is None:
            return ""
        return substitute_note(self.name, name, self.optimizer_option)

    def snippet(self, half: str, device: str = "cpu", optimizer: str = "adam", lr=1e-3) -> str:
        """``amp.initialize`` at O3 in its half dtype, with the optimizer its option needs."""

        code = optimizer_code(optimizer, lr, self.optimizer_option)
        return amp_loop("O3", short_name(self.half), code, device)

    def halves(self, asked: Sequence[str]) -> tuple[str, ...]:
        """Once, in its own half dtype."""
        return (short_name(self.half),)

    def half_dtype(self, asked=None, device="cpu") -> torch.dtype | None:
        """Its own half dtype, whatever was asked for."""
        return self.dtype
