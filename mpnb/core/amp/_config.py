"""One definition of each amp concept the lab and users name: half dtypes and loss scales.

:data:`HALF_DTYPES` and :func:`parse_half_dtype` are the half-dtype names every entry point
accepts; :class:`LossScaleRule` is the dynamic loss scaler's rule and :func:`parse_loss_scale`
turns anything a user may pass as ``loss_scale`` into a static number or a rule. The opt levels
live beside the properties they set (:data:`mpnb.core.amp.OPT_LEVELS`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from numbers import Real

import torch

# the half-dtype names live with the other dtype names; amp re-exports them
from mpnb.core.dtype_names import HALF_DTYPES, half_dtype_name, parse_half_dtype

__all__ = [
    "HALF_DTYPES",
    "LossScaleRule",
    "half_dtype_name",
    "parse_half_dtype",
    "parse_loss_scale",
]


# The smallest normal float32: without a min_loss_scale the scale never backs off below it, so
# it never reaches 0 (and its inverse never reaches inf).
_TINY = float(torch.finfo(torch.float32).tiny)
_INT32_MAX = 2**31 - 1


def _positive_finite(owner: str, name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value):
        raise ValueError(f"{owner}: {name}={value!r} must be a positive finite number.")
    if value <= 0:
        raise ValueError(f"{owner}: {name}={value!r} must be a positive finite number.")
    return float(value)


def _positive_int(owner: str, name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= _INT32_MAX:
        raise ValueError(f"{owner}: {name}={value!r} must be a positive int (at most 2**31-1).")
    return value


@dataclass(frozen=True)
class LossScaleRule:
    """The dynamic loss scaler's rule (``torch.amp.GradScaler``'s names, Apex's bounds).

    The scale starts at ``init_scale``. On a step whose gradients hold inf/NaN the hysteresis
    counter drops by one; once it is exhausted the scale is multiplied by ``backoff_factor``
    (the growth count restarts either way). After ``growth_interval`` consecutive clean steps
    it is multiplied by ``growth_factor``; a clean step also refills the hysteresis counter.
    The scale is then clamped to ``[min_loss_scale, max_loss_scale]`` (without a
    ``min_loss_scale``, to the smallest normal float32, so it never becomes 0).

    Attributes:
        init_scale: the first scale (Apex and GradScaler: 2**16).
        growth_factor: >= 1; 1 never grows.
        backoff_factor: in (0, 1]; GradScaler's 0.5 by default.
        growth_interval: clean steps between two growths (Apex: 2000).
        hysteresis: overflowing steps tolerated before a backoff (1: back off at once).
        min_loss_scale: lower clamp (None: none beyond float32's smallest normal).
        max_loss_scale: upper clamp (Apex: 2**24).
        max_skips_at_min: after this many consecutive skipped steps at a scale at or below
            ``min_loss_scale`` (1.0 without one) the scaler raises
            :class:`~mpnb.core.amp.LossScaleCollapseError`; None never raises.

    Example::

        >>> rule = LossScaleRule(init_scale=2.0**10, backoff_factor=0.25, growth_interval=100)
        >>> amp.initialize(model, opt, opt_level="O2", loss_scale=rule)
    """

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    hysteresis: int = 1
    min_loss_scale: float | None = None
    max_loss_scale: float = 2.0**24
    max_skips_at_min: int | None = 100

    def __post_init__(self) -> None:
        own = "LossScaleRule"
        fix = object.__setattr__
        fix(self, "init_scale", _positive_finite(own, "init_scale", self.init_scale))
        growth = _positive_finite(own, "growth_factor", self.growth_factor)
        if growth < 1:
            raise ValueError(f"{own}: growth_factor={growth!r} must be >= 1 (1 never grows).")
        fix(self, "growth_factor", growth)
        backoff = _positive_finite(own, "backoff_factor", self.backoff_factor)
        if backoff > 1:
            raise ValueError(f"{own}: backoff_factor={backoff!r} must be in (0, 1].")
        fix(self, "backoff_factor", backoff)
        _positive_int(own, "growth_interval", self.growth_interval)
        _positive_int(own, "hysteresis", self.hysteresis)
        top = _positive_finite(own, "max_loss_scale", self.max_loss_scale)
        fix(self, "max_loss_scale", top)
        if self.min_loss_scale is not None:
            low = _positive_finite(own, "min_loss_scale", self.min_loss_scale)
            if low > top:
                raise ValueError(
                    f"{own}: min_loss_scale={low!r} is above max_loss_scale={top!r}; pass "
                    "min_loss_scale <= max_loss_scale."
                )
            fix(self, "min_loss_scale", low)
        if self.max_skips_at_min is not None:
            _positive_int(own, "max_skips_at_min", self.max_skips_at_min)

    @property
    def floor(self) -> float:
        """The lowest scale the rule reaches: ``min_loss_scale``, else float32's tiniest normal."""
        return _TINY if self.min_loss_scale is None else self.min_loss_scale

    @property
    def collapse_floor(self) -> float:
        """Skipped steps at or below this scale count towards the collapse error."""
        return 1.0 if self.min_loss_scale is None else self.min_loss_scale

    def clamp(self, scale: float) -> float:
        """``scale`` clamped to ``[floor, max_loss_scale]``."""
        return min(max(scale, self.floor), self.max_loss_scale)

    def replace(self, **changes) -> LossScaleRule:
        """A copy with ``changes`` applied (and validated)."""
        return dataclasses.replace(self, **changes)


_RULE_KEYS = tuple(f.name for f in dataclasses.fields(LossScaleRule))


def parse_loss_scale(value, *, name: str = "loss_scale") -> float | LossScaleRule | None:
    """Anything a user may pass as ``loss_scale``, as a static number or a dynamic rule.

    Args:
        value: None (the opt level's default), ``"dynamic"`` (the default
            :class:`LossScaleRule`), a positive finite number (a static scale), a
            :class:`LossScaleRule`, or a dict of its fields (GradScaler-style settings such as
            ``dict(init_scale=2**24, backoff_factor=0.125)``).
        name: the argument's name in the error message.

    Returns:
        None, a float (static) or a :class:`LossScaleRule` (dynamic).

    Example::

        >>> parse_loss_scale(dict(init_scale=1024, growth_interval=100)).growth_interval
        100
    """
    if value is None or isinstance(value, LossScaleRule):
        return value
    if isinstance(value, str):
        if value == "dynamic":
            return LossScaleRule()
        raise ValueError(
            f"{name}={value!r} is invalid; valid choices: 'dynamic', a positive finite number "
            "(a static scale), a LossScaleRule or a dict of its fields."
        )
    if isinstance(value, Mapping):
        unknown = sorted(set(value) - set(_RULE_KEYS))
        if unknown:
            raise ValueError(
                f"{name}={dict(value)!r}: unknown keys {unknown}; the keys are "
                f"{', '.join(_RULE_KEYS)}."
            )
        try:
            return LossScaleRule(**value)
        except ValueError as e:
            raise ValueError(f"{name}={dict(value)!r}: {e}") from None
    if isinstance(value, Real) and not isinstance(value, bool):
        if math.isfinite(value) and value > 0:
            return float(value)
    raise ValueError(
        f"{name}={value!r} is invalid; valid choices: 'dynamic', a positive finite number "
        "(a static scale), a LossScaleRule or a dict of its fields."
    )
