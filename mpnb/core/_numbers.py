"""The one definition of "a positive finite number" (and of "a finite number >= 0").

Loss scales and their bounds, learning rates and other hyper-parameters, a checkpoint's saved
scale, the benchmark's size multiplier: every entry point that takes such a number checks it
here, so ``True``, ``nan``, ``inf``, ``0`` and ``-1`` are refused the same way everywhere, and
each message names the owner, the argument, the value and the fix.

Example::

    >>> positive_finite(2.0**16, "init_scale", owner="LossScaleRule")
    65536.0
    >>> positive_finite(float("nan"), "lr", owner="FusedAdam", allow_zero=True)
    Traceback (most recent call last):
    ValueError: FusedAdam: lr=nan must be a finite number >= 0; pass lr= a finite number >= 0.
"""

from __future__ import annotations

import math
from numbers import Real

import torch

__all__ = ["is_positive_finite", "positive_finite"]


def _real(value) -> float | None:
    """``value`` as a float if it is a real number (or a one-element tensor), else None."""
    if isinstance(value, torch.Tensor):
        return float(value) if value.numel() == 1 and not value.is_complex() else None
    if isinstance(value, bool) or not isinstance(value, Real):
        return None  # True is an int to Python, never a scale or a rate to us
    return float(value)


def is_positive_finite(value, *, allow_zero: bool = False) -> bool:
    """True when ``value`` is a real number (not a bool), finite and ``> 0`` (``>= 0`` with
    ``allow_zero``). A one-element tensor counts as its number.

    Example::

        >>> is_positive_finite(0.0), is_positive_finite(0.0, allow_zero=True)
        (False, True)
    """
    v = _real(value)
    return v is not None and math.isfinite(v) and (v >= 0 if allow_zero else v > 0)


def positive_finite(
    value, name: str, *, owner: str, fix: str | None = None, allow_zero: bool = False
) -> float:
    """``value`` as a float, or a ValueError naming ``owner``, ``name``, the value and the fix.

    Args:
        value: the number to check (a one-element tensor counts as its number).
        name: the argument's name as the caller spells it (``"min_loss_scale"``,
            ``"state['loss_scale']"``).
        owner: who refuses it (``"amp.initialize"``, ``"FusedAdam"``).
        fix: what to do instead (default: ``"pass NAME= a positive finite number"``).
        allow_zero: accept 0 (learning rates, weight decay): "a finite number >= 0".

    Example::

        >>> positive_finite(-1, "max_loss_scale", owner="amp.initialize")
        Traceback (most recent call last):
        ValueError: amp.initialize: max_loss_scale=-1 must be a positive finite number; pass
        max_loss_scale= a positive finite number.
    """
    if is_positive_finite(value, allow_zero=allow_zero):
        return _real(value)
    what = "a finite number >= 0" if allow_zero else "a positive finite number"
    raise ValueError(f"{owner}: {name}={value!r} must be {what}; {fix or f'pass {name}= {what}'}.")
