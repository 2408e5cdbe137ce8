"""The declared seam between amp and an optimizer that unscales inside its own ``step()``.

:class:`FusedOptimizer` is the contract: what a fused optimizer (``mpnb.optimizers``, or your
own) may offer amp. amp checks it once, when ``amp.initialize`` binds the optimizer
(:func:`bind`, before the model changes); a declared but incomplete optimizer gets a TypeError
naming what is missing. After that, amp calls the members directly: nothing else in amp asks
an optimizer what it has.

``torch.amp.GradScaler`` has its own door to the same place: it sets ``optimizer.grad_scale``
and ``optimizer.found_inf`` before ``step()`` on an optimizer whose
``_step_supports_amp_scaling`` is True, and deletes them after. :class:`GradScalerAttribute` is
that door on mpnb's optimizers, an adapter that turns the two attributes into the same
:class:`ScaleHandoff` that :meth:`FusedOptimizer._mpnb_set_scale` hands over.

Example::

    >>> from mpnb.optimizers import FusedAdam
    >>> bind(FusedAdam(model.parameters()), master_weights=True)
    Binding(fused_unscale=True, own_masters=True)
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Protocol

import torch

__all__ = [
    "FusedOptimizer",
    "Binding",
    "bind",
    "ScaleHandoff",
    "GradScalerAttribute",
    "inner_optimizer",
    "amp_stash",
]


class ScaleHandoff(NamedTuple):
    """What the next ``step()`` undoes and flags (one record, whichever door it came by).

    Attributes:
        inv_scale: one-element fp32 tensor, ``1 / loss_scale`` (None: the grads are unscaled).
        found_inf: one-element fp32 tensor; the step sets it to 1 when a grad holds inf/NaN,
            and takes a step whose flag is already nonzero as overflowed.
        skip: True: an overflowing step writes nothing. False (a static loss scale, Apex's
            rule): it is flagged but taken.
    """

    inv_scale: torch.Tensor | None
    found_inf: torch.Tensor | None
    skip: bool = True


class FusedOptimizer(Protocol):
    """What a fused optimizer may offer amp: a fused unscale, the scale it needs, its own masters.

    An optimizer opts in with ``_mpnb_accepts_scale = True``; amp then leaves a step's
    gradients scaled and hands the scale to the optimizer, whose ``step()`` unscales, checks
    and updates in one pass (:class:`~mpnb.core.amp._strategies.FusedSeam`).

    * **The fused unscale and the scale it needs** (required once declared):
      :meth:`_mpnb_set_scale`.
    * **Its own fp32 master weights** (optional: all three or none): under O2 an optimizer
      that has them keeps the masters in its state (its kernel updates the master and writes
      the rounded param in the same pass); one without them gets amp's masters in its
      ``param_groups``, as any ``torch.optim`` optimizer does. The master of a half ``param``
      lives in ``self.state[param]["master_param"]`` (Apex's layout, and what its checkpoints
      hold); amp reads it there to follow a model that changed before the first step.

    amp checks the members once, when it binds the optimizer (:func:`bind`); a missing one
    is a TypeError naming it, before anything changes.

    Example::

        >>> class MyFused(torch.optim.SGD):
        ...     _mpnb_accepts_scale = True
        ...     def _mpnb_set_scale(self, inv_scale, found_inf, skip=True):
        ...         self.handoff = ScaleHandoff(inv_scale, found_inf, skip)
    """

    _mpnb_accepts_scale: bool
    """True: this optimizer unscales inside its ``step()`` (the declaration amp looks for)."""

    def _mpnb_set_scale(
        self, inv_scale: torch.Tensor, found_inf: torch.Tensor, skip: bool = True
    ) -> None:
        """Hand the next ``step()`` a :class:`ScaleHandoff` (see its fields). amp calls it
        from the step pre-hook, once per step; the step reads no other host value."""

    def _mpnb_check_master_weights(self) -> None:
        """Raise (naming the fix) if this optimizer cannot keep fp32 masters; amp calls it when
        it binds the optimizer under O2, before the model is cast."""

    def _mpnb_use_master_weights(self) -> None:
        """Keep fp32 masters of the half params from now on (made from the params at the first
        step); amp calls it under O2 instead of placing its own masters."""

    def _mpnb_set_master(self, param: torch.Tensor, value: torch.Tensor) -> None:
        """Make ``value`` the fp32 master of the half ``param`` (checkpoints and a model that
        changed before the first step reach the masters through this)."""


_DECLARATION = "_mpnb_accepts_scale"
_UNSCALE = ("_mpnb_set_scale",)
_MASTERS = ("_mpnb_check_master_weights", "_mpnb_use_master_weights", "_mpnb_set_master")
MEMBERS = (_DECLARATION, *_UNSCALE, *_MASTERS)
"""Every member of :class:`FusedOptimizer` (the check below and its test read this)."""


@dataclasses.dataclass(frozen=True)
class Binding:
    """What :func:`bind` found: how amp serves this optimizer.

    Attributes:
        fused_unscale: the optimizer takes the scale (:meth:`FusedOptimizer._mpnb_set_scale`).
        own_masters: it keeps the O2 fp32 masters itself (and has agreed to).
    """

    fused_unscale: bool
    own_masters: bool


def bind(optimizer: torch.optim.Optimizer, master_weights: bool) -> Binding:
    """Check ``optimizer``'s side of the seam, once, and say how amp will serve it.

    Args:
        optimizer: the optimizer amp serves (the inner one of a wrapper such as LARC).
        master_weights: whether amp runs with fp32 master weights (O2).

    Raises:
        TypeError: the optimizer declares ``_mpnb_accepts_scale`` but lacks a member of
            :class:`FusedOptimizer` (or has part of the master-weights trio).
        RuntimeError (or what the optimizer raises): it cannot keep fp32 masters under O2
            (:meth:`FusedOptimizer._mpnb_check_master_weights`).

    Example::

        >>> bind(torch.optim.SGD(model.parameters(), lr=0.1), master_weights=True)
        Binding(fused_unscale=False, own_masters=False)
    """
    if not getattr(optimizer, _DECLARATION, False):
        return Binding(False, False)  # a torch.optim-style optimizer: amp unscales for it
    has = {m for m in MEMBERS[1:] if callable(getattr(optimizer, m, None))}
    missing = [m for m in _UNSCALE if m not in has]
    masters = [m for m in _MASTERS if m in has]
    if masters and len(masters) < len(_MASTERS):
        missing += [m for m in _MASTERS if m not in has]
    if missing:
        raise TypeError(
            f"amp.initialize: {type(optimizer).__name__} declares _mpnb_accepts_scale = True "
            f"but lacks {', '.join(missing)} of the seam (mpnb.core.amp.seam.FusedOptimizer: "
            "_mpnb_set_scale, and all or none of the three master-weight methods); define "
            "them, or drop _mpnb_accepts_scale to let amp unscale the grads for it."
        )
    own = bool(master_weights and masters)
    if own:
        optimizer._mpnb_check_master_weights()  # refuses before the model changes
    return Binding(True, own)


def inner_optimizer(obj):
    """The torch optimizer inside a wrapper such as :class:`~mpnb.parallel.LARC` (``.optim``),
    or None: amp binds that one, and the wrapper's ``step()`` runs it after its own work.

    Example::

        >>> inner_optimizer(LARC(sgd)) is sgd, inner_optimizer(sgd)
        (True, None)
    """
    inner = getattr(obj, "optim", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else None


MASTERS_KEY = "mpnb_amp_masters"
"""The checkpoint key of the O2 fp32 masters amp keeps for a ``torch.optim`` optimizer
(``{param index: tensor}``): amp writes it, and a fused optimizer loading that checkpoint
without amp reads it."""

STASH = "_amp_stash"
"""Where ``amp.initialize`` leaves its view of an optimizer's state (Apex's attribute name)."""


def amp_stash(optimizer):
    """The :class:`~mpnb.core.amp.AmpStash` amp left on ``optimizer``, or None (amp never
    bound it). The one way amp, and an optimizer loading a checkpoint, ask whether amp serves
    an optimizer.

    Example::

        >>> amp_stash(torch.optim.SGD(model.parameters(), lr=0.1)) is None
        True
    """
    return getattr(optimizer, STASH, None)


class GradScalerAttribute:
    """``torch.amp.GradScaler``'s ``grad_scale`` / ``found_inf``, as an adapter over the seam.

    GradScaler sets both attributes on an optimizer that says ``_step_supports_amp_scaling``,
    calls ``step()``, then deletes them. On a class with these descriptors the values are
    kept aside, reading one that is not set raises AttributeError (GradScaler's
    ``getattr(optimizer, "grad_scale", 1)`` then sees its default), and :meth:`handoff` turns
    them into the :class:`ScaleHandoff` the optimizer's step consumes, the record
    :meth:`FusedOptimizer._mpnb_set_scale` makes.

    Example::

        >>> class Opt(torch.optim.Optimizer):
        ...     grad_scale = GradScalerAttribute("grad_scale")
        ...     found_inf = GradScalerAttribute("found_inf")
    """

    _KEY = "_grad_scaler_attributes"

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        values = obj.__dict__.get(self._KEY, {})
        if self.name not in values:
            raise AttributeError(
                f"{type(obj).__name__}.{self.name} is set only by torch.amp.GradScaler.step, "
                "for the duration of optimizer.step()"
            )
        return values[self.name]

    def __set__(self, obj, value) -> None:
        obj.__dict__.setdefault(self._KEY, {})[self.name] = value

    def __delete__(self, obj) -> None:
        values = obj.__dict__.get(self._KEY, {})
        if self.name not in values:
            raise AttributeError(self.name)
        del values[self.name]

    @classmethod
    def handoff(cls, obj) -> ScaleHandoff | None:
        """GradScaler's attributes on ``obj`` as a :class:`ScaleHandoff` (None: not set).

        ``grad_scale`` is the scale (None once ``scaler.unscale_`` ran); its inverse is
        computed in float64, as GradScaler computes its own.
        """
        values = obj.__dict__.get(cls._KEY)
        if not values:
            return None
        scale = values.get("grad_scale")
        inv = None if scale is None else scale.double().reciprocal().float()
        return ScaleHandoff(inv, values.get("found_inf"), True)
