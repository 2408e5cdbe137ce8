"""What a loss scaler says when steps keep overflowing: the collapse error and the static-scale
warning, shared by amp's :class:`~mpnb.core.amp.LossScaler` and ``FP16_Optimizer``."""

from __future__ import annotations

import warnings

import torch

__all__ = [
    "LossScaleCollapseError",
    "StaticScaleOverflowWarning",
    "CollapseCheck",
    "warn_static_overflow",
]


class LossScaleCollapseError(RuntimeError):
    """Raised when every step is skipped for overflow even at the minimum loss scale."""


class StaticScaleOverflowWarning(UserWarning):
    """A static loss scale met inf/NaN gradients: as in Apex, the step was not skipped."""


class CollapseCheck:
    """Counts consecutive skipped steps at the scale's floor; raises past a limit.

    Shared by :class:`LossScaler` and ``FP16_Optimizer``, so both raise the same error.

    Args:
        floor: skipped steps at a scale ``<= floor`` count.
        limit: how many in a row raise (None: never).
        half_dtype: the half dtype in use (None: unknown), for the advice.
        disable: how to switch the check off, in the caller's own API.
        floor_name: what the floor is, in words (for the message).
    """

    def __init__(
        self, floor: float, limit: int | None, half_dtype, disable: str, floor_name: str = ""
    ):
        self.floor, self.limit, self.half_dtype, self.disable = floor, limit, half_dtype, disable
        self.floor_name = floor_name
        self.count = 0

    def note(self, skipped: bool, scale: float) -> None:
        """Record one step: ``skipped`` and the scale it ran at (host values)."""
        if not skipped or scale > self.floor:
            self.count = 0
            return
        self.count += 1
        self.raise_if(self.count)

    def raise_if(self, count: int) -> None:
        """Raise :class:`LossScaleCollapseError` when ``count`` consecutive skipped steps at the
        floor reach the limit (a loss scaler counts them on the device and passes the count)."""
        if self.limit is None or count < self.limit:
            return
        advice = {
            torch.float16: "lower the learning rate, or use half_dtype=torch.bfloat16 "
            "(fp32's range)",
            torch.bfloat16: "lower the learning rate, or run the failing part in fp32",
        }.get(self.half_dtype, "lower the learning rate")
        head = (
            f"{count} consecutive optimizer steps were skipped for inf/NaN gradients "
            f"with the loss scale at or below {self.floor:g} ({self.floor_name})"
        )
        if self.floor > 1.0:  # the scale still multiplies: the floor may be the overflow
            raise LossScaleCollapseError(
                f"{head}: the scale cannot back off below this floor, and a scale above 1 "
                "still multiplies the gradients, so the floor itself may make them overflow "
                "(fp16's largest number is 65504). Lower min_loss_scale (or remove it: the "
                "scale then backs off as far as the gradients need); if steps still "
                f"overflow near a scale of 1, check the loss and the inputs for inf/NaN, "
                f"{advice}; {self.disable}."
            )
        raise LossScaleCollapseError(
            f"{head}: the gradients are non-finite even unscaled, so training would never "
            f"progress. Check the loss and the inputs for inf/NaN, {advice}; {self.disable}."
        )


def warn_static_overflow(scale: float, stacklevel: int = 4) -> None:
    """Say that a static scale met inf/NaN gradients and the step ran anyway (Apex's rule);
    ``stacklevel`` as :func:`warnings.warn`'s, counted from this function."""
    warnings.warn(
        f"amp: inf/NaN gradients with a static loss scale ({scale:g}): as in Apex, the step was "
        "not skipped, so the weights may now hold inf/NaN. Use loss_scale='dynamic' (steps "
        "with inf/NaN gradients are skipped), or find the overflow's source.",
        StaticScaleOverflowWarning,
        stacklevel=stacklevel,
    )
