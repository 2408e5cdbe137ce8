"""Apex's opt levels as precision configurations: each applied by ``amp.initialize``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mpnb.core import amp
from mpnb.core.amp import resolve_properties
from mpnb.core.dtype_names import parse_half_dtype
from mpnb.core.precision_configs._base import PrecisionConfig
from mpnb.core.precision_configs._snippets import amp_loop

__all__ = ["AmpConfig"]


@dataclass(frozen=True)
class AmpConfig(PrecisionConfig):
    """An Apex opt level, applied by :func:`mpnb.amp.initialize` (quietly: ``verbosity=0``).

    It runs in whichever half dtype the run asks for (O0 in float32 only), and a run's loss
    scale applies to O1-O3.
    """

    @property
    def opt_level(self) -> str:
        """The opt level ``amp.initialize`` runs (the configuration's name)."""
        return self.name

    @property
    def loss_scaling(self) -> bool:
        """True for O1-O3 (O0 trains in fp32: nothing to scale)."""
        return self.low_precision

    @property
    def autocast(self) -> bool:
        """True where amp runs the forward under ``torch.autocast`` (O1), as amp's defaults
        for the level say."""

        return resolve_properties(self.opt_level).patch_torch_functions

    def apply(self, model, optimizer=None, half_dtype=None):
        """``amp.initialize(model, optimizer, opt_level=name, half_dtype=...)``."""
        return self._initialize(model, optimizer, half_dtype, None)

    def setup(self, model, optimizer, half_dtype=None, loss_scale=None):
        """:meth:`apply` with the run's ``loss_scale`` (O1-O3; O0 ignores it)."""
        return self._initialize(
            model, optimizer, half_dtype, loss_scale if self.loss_scaling else None
        )

    def _initialize(self, model, optimizer, half_dtype, loss_scale):
        out = amp.initialize(
            model,
            optimizer,
            opt_level=self.opt_level,
            half_dtype=half_dtype,
            loss_scale=loss_scale,
            verbosity=0,
        )
        return out if optimizer is not None else (out, None)

    def halves(self, asked: Sequence[str]) -> tuple[str, ...]:
        """Once per half dtype ``asked`` for; O0 once, in ``"fp32"``."""
        return tuple(asked) if self.low_precision else ("fp32",)

    def half_dtype(self, asked=None, device="cpu") -> torch.dtype | None:
        """The half dtype asked for (None: the device's default); None for O0."""
        return parse_half_dtype(asked, device) if self.low_precision else None

    def label(self, half: str) -> str:
        """``"O2 bf16"``: the level and its half dtype (``"O0 fp32"``)."""
        return f"{self.name} {half}"

    def runs_by_default(self, device_type: str) -> bool:
        """True: Apex's four levels are what a comparison runs when none is named."""
        return True

    def snippet(self, half: str, device: str = "cpu", optimizer: str = "adam", lr=1e-3) -> str:
        """``amp.initialize`` at this level (in ``half``), the backward in ``amp.scale_loss``."""

        half_kw = half if self.low_precision else None
        return amp_loop(self.name, half_kw, self._optimizer_code(optimizer, lr), device)
