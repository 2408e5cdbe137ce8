"""The loss scaler's rule, and the one parse of everything a user may pass as ``loss_scale``.

A user's ``loss_scale`` (``"dynamic"``, a number, a dict of the rule's fields, a
:class:`LossScaleRule`) is parsed once, where it enters (``amp.initialize``,
``mpnb.lab.compare``, a widget, ``LossScaler(...)``), by :meth:`LossScaleRule.parse`, into a
rule; the rule then travels down unchanged to the :class:`~mpnb.core.amp.LossScaler` that
applies it. A rule is valid when it exists: its numbers are checked, and its scales lie in
float32's range with a finite inverse, when it is built.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from numbers import Real

import torch

from mpnb.core._numbers import positive_finite

__all__ = ["LossScaleRule", "parse_loss_scale"]

# A scale is stored as a float32 with its float32 inverse (the unscale factor): both must be
# finite, so it lies between float32's smallest normal number and its largest. Without a
# min_loss_scale the scale never backs off below the smallest normal, so it never reaches 0.
_TINY = float(torch.finfo(torch.float32).tiny)
_FLOAT32_MAX = float(torch.finfo(torch.float32).max)
_INT32_MAX = 2**31 - 1
_OWN = "LossScaleRule"
_CHOICES = (
    "pass 'dynamic', a positive finite number (a static scale), a LossScaleRule or a dict of "
    "its fields"
)


def _scale(name: str, value) -> float:
    """A positive finite scale that float32 holds with a finite inverse."""
    v = positive_finite(value, name, owner=_OWN)
    if not _TINY <= v <= _FLOAT32_MAX:
        why = (
            "cannot be stored in float32 (it overflows to inf)"
            if v > _FLOAT32_MAX
            else "has an infinite float32 inverse, so unscaling would turn every gradient into "
            "inf or NaN"
        )
        raise ValueError(
            f"{_OWN}: {name}={v:g} {why}; a loss scale must lie in [{_TINY:.3g}, "
            f"{_FLOAT32_MAX:.3g}]. Use loss_scale='dynamic' (the scale adapts), or a static power "
            "of two such as 128 or 2**16."
        )
    return v


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= _INT32_MAX:
        raise ValueError(
            f"{_OWN}: {name}={value!r} must be a positive int (at most 2**31-1); pass {name}= "
            "1 or more."
        )
    return value


@dataclass(frozen=True)
class LossScaleRule:
    """The loss scaler's rule: dynamic (``torch.amp.GradScaler``'s names, Apex's bounds) or static.

    Dynamic: the scale starts at ``init_scale``. On a step whose gradients hold inf/NaN the
    hysteresis counter drops by one; once it is exhausted the scale is multiplied by
    ``backoff_factor`` (the growth count restarts either way). After ``growth_interval``
    consecutive clean steps it is multiplied by ``growth_factor``; a clean step also refills the
    hysteresis counter. The scale is then clamped to ``[min_loss_scale, max_loss_scale]``
    (without a ``min_loss_scale``, to the smallest normal float32, so it never becomes 0).

    Static (``dynamic=False``, :meth:`static`): the scale is ``init_scale`` for ever and, as in
    Apex, an overflowing step is not skipped; the other fields are kept but not used.

    Every scale (a static one, ``min_loss_scale``, ``max_loss_scale``) must lie in float32's
    range with a finite inverse, ``[1.18e-38, 3.4e+38]``; a ValueError names the field and the
    fix otherwise, when the rule is built.

    Attributes:
        init_scale: the first scale (Apex and GradScaler: 2**16); the static scale.
        growth_factor: >= 1; 1 never grows.
        backoff_factor: in (0, 1]; GradScaler's 0.5 by default; 1 never backs off.
        growth_interval: clean steps between two growths (Apex: 2000).
        hysteresis: overflowing steps tolerated before a backoff (1: back off at once).
        min_loss_scale: lower clamp (None: none beyond float32's smallest normal).
        max_loss_scale: upper clamp (Apex: 2**24).
        max_skips_at_min: after this many consecutive skipped steps at a scale at or below
            ``min_loss_scale`` (1.0 without one) the scaler raises
            :class:`~mpnb.core.amp.LossScaleCollapseError`; None never raises.
        dynamic: False for a static scale.

    Example::

        >>> rule = LossScaleRule(init_scale=2.0**10, backoff_factor=0.25, growth_interval=100)
        >>> amp.initialize(model, opt, opt_level="O2", loss_scale=rule)
        >>> LossScaleRule.parse(128.0) == LossScaleRule.static(128.0)
        True
    """

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    hysteresis: int = 1
    min_loss_scale: float | None = None
    max_loss_scale: float = 2.0**24
    max_skips_at_min: int | None = 100
    dynamic: bool = True

    def __post_init__(self) -> None:
        fix = object.__setattr__
        if not isinstance(self.dynamic, bool):
            raise ValueError(
                f"{_OWN}: dynamic={self.dynamic!r} must be True or False; pass dynamic=False for "
                "a static scale (or use LossScaleRule.static(scale))."
            )
        if self.dynamic:  # clamped to [floor, max_loss_scale] when used
            fix(self, "init_scale", positive_finite(self.init_scale, "init_scale", owner=_OWN))
        else:
            fix(self, "init_scale", _scale("loss_scale", self.init_scale))
        growth = positive_finite(self.growth_factor, "growth_factor", owner=_OWN)
        if growth < 1:
            raise ValueError(
                f"{_OWN}: growth_factor={growth!r} must be >= 1 (1 never grows); pass "
                "growth_factor=2.0 (the usual) or 1.0."
            )
        fix(self, "growth_factor", growth)
        backoff = positive_finite(self.backoff_factor, "backoff_factor", owner=_OWN)
        if backoff > 1:
            raise ValueError(
                f"{_OWN}: backoff_factor={backoff!r} must be in (0, 1] (1 never backs off); "
                "pass backoff_factor=0.5 (the usual)."
            )
        fix(self, "backoff_factor", backoff)
        _positive_int("growth_interval", self.growth_interval)
        _positive_int("hysteresis", self.hysteresis)
        top = _scale("max_loss_scale", self.max_loss_scale)
        fix(self, "max_loss_scale", top)
        if self.min_loss_scale is not None:
            low = _scale("min_loss_scale", self.min_loss_scale)
            if low > top:
                raise ValueError(
                    f"{_OWN}: min_loss_scale={low!r} is above max_loss_scale={top!r}; pass "
                    "min_loss_scale <= max_loss_scale."
                )
            fix(self, "min_loss_scale", low)
        if self.max_skips_at_min is not None:
            _positive_int("max_skips_at_min", self.max_skips_at_min)

    def __repr__(self) -> str:
        if not self.dynamic:
            return f"{type(self).__name__}.static({self.init_scale!r})"
        names = (f.name for f in dataclasses.fields(self) if f.name != "dynamic")
        return f"{type(self).__name__}({', '.join(f'{n}={getattr(self, n)!r}' for n in names)})"

    # ---- building one ---------------------------------------------------------------------------

    @classmethod
    def static(cls, scale: float) -> LossScaleRule:
        """A static scale: ``scale`` for ever; overflowing steps are taken (Apex's rule).

        Example::

            >>> LossScaleRule.static(128).init_scale
            128.0
        """
        return cls(init_scale=scale, dynamic=False)

    @classmethod
    def parse(cls, value, *, owner: str = _OWN, name: str = "loss_scale") -> LossScaleRule | None:
        """The one parse of a ``loss_scale`` argument: anything a user may pass, as a rule.

        Called once, where the value enters (``amp.initialize``, ``mpnb.lab.compare``, the
        widgets, ``LossScaler(...)``); a rule passes through unchanged, so what travels down to
        the :class:`~mpnb.core.amp.LossScaler` is never parsed again.

        Args:
            value: None (the opt level's default: returned as None), ``"dynamic"`` (the default
                rule), a positive finite number (a static scale), a :class:`LossScaleRule`, or
                a dict of its fields (GradScaler-style settings such as
                ``dict(init_scale=2**24, backoff_factor=0.125)``).
            owner: who asks, for the error message (``"amp.initialize"``).
            name: the argument's name in the error message.

        Example::

            >>> LossScaleRule.parse(dict(init_scale=1024, growth_interval=100)).growth_interval
            100
        """
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            if value == "dynamic":
                return cls()
        elif isinstance(value, Mapping):
            unknown = sorted(set(value) - set(_RULE_KEYS))
            if unknown:
                raise ValueError(
                    f"{owner}: {name}={dict(value)!r}: unknown keys {unknown}; the keys are "
                    f"{', '.join(_RULE_KEYS)}."
                )
            try:
                return cls(**value)
            except ValueError as e:
                raise ValueError(f"{owner}: {name}={dict(value)!r}: {_reowned(e, '')}") from None
        elif isinstance(value, (Real, torch.Tensor)) and not isinstance(value, bool):
            scale = positive_finite(value, name, owner=owner, fix=_CHOICES)
            try:
                return cls.static(scale)
            except ValueError as e:
                raise ValueError(_reowned(e, owner).replace("loss_scale=", f"{name}=")) from None
        raise ValueError(f"{owner}: {name}={value!r} is invalid; {_CHOICES}.")

    @classmethod
    def field_errors(cls, **fields) -> dict[str, str]:
        """``{field: message}`` for each of ``fields`` the rule refuses; empty when
        ``LossScaleRule(**fields)`` is valid.

        For forms that show each error beside its control (the widgets): each field is
        checked on its own (the others at their defaults), then all together; an error that
        involves several fields goes to the first field it names. The messages are the rule's
        own, without its ``"LossScaleRule: "`` prefix.

        Example::

            >>> LossScaleRule.field_errors(growth_factor=0.5, backoff_factor=1.0)
            {'growth_factor': 'growth_factor=0.5 must be >= 1 (1 never grows); pass ...'}
        """
        errs = {}
        for key, value in fields.items():
            try:
                cls(**{key: value})
            except ValueError as e:
                errs[key] = _reowned(e, "")
        if not errs:
            try:
                cls(**fields)
            except ValueError as e:
                msg = _reowned(e, "")
                errs[next((k for k in fields if f"{k}=" in msg), next(iter(fields)))] = msg
        return errs

    def replace(self, **changes) -> LossScaleRule:
        """A copy with ``changes`` applied (and validated)."""
        return dataclasses.replace(self, **changes)

    def with_bounds(self, min_loss_scale=None, max_loss_scale=None) -> LossScaleRule:
        """This rule with Apex's ``amp.initialize(min_loss_scale=, max_loss_scale=)`` applied.

        A bound that is None keeps the rule's; one the rule already sets to another value is a
        ValueError (pass it in one place). A static rule is returned as it is: as in Apex, the
        bounds only clamp a dynamic scale (they are still checked).

        Example::

            >>> LossScaleRule().with_bounds(min_loss_scale=1.0).floor
            1.0
        """
        default, changes = LossScaleRule(), {}
        for key, value in (("min_loss_scale", min_loss_scale), ("max_loss_scale", max_loss_scale)):
            if value is None:
                continue
            fix = f"pass {key}= a positive finite number (or None for the default)"
            value = positive_finite(value, key, owner=_OWN, fix=fix)
            mine = getattr(self, key)
            if mine != getattr(default, key) and mine != value:
                raise ValueError(
                    f"{_OWN}: {key}={value!r} conflicts with the loss_scale rule's {key}="
                    f"{mine!r}; pass it in one place."
                )
            changes[key] = value
        return self.replace(**changes) if self.dynamic and changes else self

    # ---- reading it -----------------------------------------------------------------------------

    @property
    def apex_value(self) -> float | str:
        """Apex's spelling of this rule: ``"dynamic"`` or the static scale (what
        :attr:`~mpnb.core.amp.Properties.loss_scale` and Apex's ``opt_properties`` show)."""
        return "dynamic" if self.dynamic else self.init_scale

    @property
    def floor(self) -> float:
        """The lowest scale the rule reaches: ``min_loss_scale``, else float32's tiniest normal."""
        return _TINY if self.min_loss_scale is None else self.min_loss_scale

    @property
    def collapse_floor(self) -> float:
        """Skipped steps at or below this scale count towards the collapse error."""
        return 1.0 if self.min_loss_scale is None else self.min_loss_scale

    def clamp(self, scale: float) -> float:
        """``scale`` clamped to ``[floor, max_loss_scale]`` (a static scale: unchanged)."""
        if not self.dynamic:
            return scale
        return min(max(scale, self.floor), self.max_loss_scale)

    @property
    def first_scale(self) -> float:
        """The scale a new scaler starts from: ``init_scale``, clamped when dynamic."""
        return self.clamp(self.init_scale)


_RULE_KEYS = tuple(f.name for f in dataclasses.fields(LossScaleRule))


def _reowned(e: ValueError, owner: str) -> str:
    """``e``'s message with the rule's own prefix replaced by ``owner`` (or dropped)."""
    msg = str(e)
    prefix = f"{_OWN}: "
    if msg.startswith(prefix):
        msg = msg[len(prefix) :]
        return f"{owner}: {msg}" if owner else msg
    return msg


def parse_loss_scale(value, *, name: str = "loss_scale") -> float | LossScaleRule | None:
    """:meth:`LossScaleRule.parse` in its earlier shape: a static scale as a float.

    Kept for callers of the earlier API (amp and the lab use :meth:`LossScaleRule.parse`).

    Returns:
        None, a float (static) or a dynamic :class:`LossScaleRule`.

    Example::

        >>> parse_loss_scale(128)
        128.0
    """
    rule = LossScaleRule.parse(value, name=name)
    return rule if rule is None or rule.dynamic else rule.init_scale
