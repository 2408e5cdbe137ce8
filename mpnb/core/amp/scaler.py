"""The loss scaler: one object per loss, its rule in the object and its scale on the device.

:class:`LossScaler` holds a :class:`~mpnb.core.amp.LossScaleRule` and applies it in one place,
:meth:`LossScaler.update`, through one op (:func:`mpnb.core.ops.update_loss_scale_`). Every
path of amp (O0-O3, masters or not, the fused-optimizer seam, kernel or reference) calls that
method, so every path follows the same rule.

Host syncs: none in a step. The scale, its inverse, the growth and hysteresis trackers and the
step counters (skipped steps, consecutive skips at the floor, overflowing steps a static scale
took: :class:`~mpnb.core.amp._counters.StepCounters`) live on the device; each optimizer step
counts itself there (:meth:`LossScaler.note_step`) and the host looks at the counts without
waiting (:meth:`LossScaler.watch`: at once on a CPU, a step or so late on a GPU) to warn and to
raise the collapse error. Only :meth:`LossScaler.loss_scale`, :meth:`LossScaler.state_dict` and
the properties ``skips_at_min`` and ``skipped_steps`` read device values, and wait for them
(for logging and checkpoints).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from mpnb.core._numbers import positive_finite
from mpnb.core.amp._collapse import (
    CollapseCheck,
    LossScaleCollapseError,
    StaticScaleOverflowWarning,
    warn_static_overflow,
)
from mpnb.core.amp._counters import StepCounters
from mpnb.core.amp._rule import LossScaleRule
from mpnb.core.ops import multi_tensor_scale, update_loss_scale_

__all__ = [
    "LossScaler",
    "LossScaleCollapseError",
    "CollapseCheck",
    "StaticScaleOverflowWarning",
    "warn_static_overflow",
]

_INT32_MAX = 2**31 - 1
_UNSET = object()
_DISABLE = (
    "pass amp.initialize(..., min_loss_scale=...) to set the floor, or "
    "loss_scale=LossScaleRule(max_skips_at_min=None) to turn this check off"
)


def _rule_field(name: str, doc: str) -> property:
    def get(self):
        return getattr(self.rule, name)

    def set_(self, value):
        self.rule = self.rule.replace(**{name: value})

    return property(get, set_, doc=doc)


class LossScaler:
    """Dynamic or static loss scaling; the scale, its inverse and counters on the device.

    Dynamic: the :class:`~mpnb.core.amp.LossScaleRule` (GradScaler's names, Apex's numbers:
    start at 2**16, double after 2000 clean steps, back off by 0.5 on inf/NaN, clamp to
    ``[min_loss_scale, 2**24]``). Static (``loss_scale`` a number): the scale never changes and,
    as in Apex, an overflowing step is not skipped (amp warns with
    :class:`StaticScaleOverflowWarning`).

    Args:
        loss_scale: a :class:`~mpnb.core.amp.LossScaleRule` (what ``amp.initialize`` passes:
            used as it is), or anything :meth:`~mpnb.core.amp.LossScaleRule.parse` takes
            (``"dynamic"``, a positive finite number for a static scale, a dict of the rule's
            fields), parsed here.
        init_scale, growth_factor, backoff_factor, growth_interval, hysteresis,
        min_loss_scale, max_loss_scale, max_skips_at_min: override the rule's fields.
        scale_factor, scale_window: Apex's names, accepted as aliases: ``scale_factor`` is the
            growth factor and (unless ``backoff_factor`` is given) its inverse the backoff;
            ``scale_window`` is ``growth_interval``.
        device: where the state lives.
        half_dtype: the half dtype in use (for the collapse error's advice only).

    Attributes:
        rule: the :class:`~mpnb.core.amp.LossScaleRule` (the rule's fields are also readable
            and assignable as attributes: ``scaler.growth_interval = 100``).
        dynamic: False for a static scale (read-only: the rule's kind).
        scale, inv_scale: one-element fp32 tensors.
        found_inf: the current ``scale_loss`` block's overflow flag (a new tensor per block).

    Example::

        >>> s = LossScaler("dynamic", growth_interval=3, backoff_factor=0.25)
        >>> s.clear_overflow()
        >>> g = [torch.ones(4) * 65536]
        >>> s.unscale(g, g)            # g == ones, s.found_inf == 0
        >>> s.update()
    """

    growth_factor = _rule_field("growth_factor", "Multiply the scale by this when it grows.")
    backoff_factor = _rule_field("backoff_factor", "Multiply the scale by this on overflow.")
    growth_interval = _rule_field("growth_interval", "Clean steps between two growths.")
    hysteresis = _rule_field("hysteresis", "Overflowing steps tolerated before a backoff.")
    min_loss_scale = _rule_field("min_loss_scale", "Lower clamp of the scale (or None).")
    max_loss_scale = _rule_field("max_loss_scale", "Upper clamp of the scale.")
    max_skips_at_min = _rule_field("max_skips_at_min", "Skips at the floor before the error.")
    scale_window = _rule_field("growth_interval", "Apex's name of ``growth_interval``.")

    def __init__(
        self,
        loss_scale="dynamic",
        *,
        init_scale=None,
        growth_factor=None,
        backoff_factor=None,
        growth_interval=None,
        hysteresis=None,
        min_loss_scale=None,
        max_loss_scale=None,
        max_skips_at_min=_UNSET,
        scale_factor=None,
        scale_window=None,
        device="cpu",
        half_dtype=None,
    ):
        base = LossScaleRule.parse(loss_scale, owner="LossScaler") or LossScaleRule()
        given = dict(
            init_scale=init_scale,
            growth_factor=_alias(growth_factor, scale_factor, "growth_factor", "scale_factor"),
            backoff_factor=backoff_factor,
            growth_interval=_alias(
                growth_interval, scale_window, "growth_interval", "scale_window"
            ),
            hysteresis=hysteresis,
            min_loss_scale=min_loss_scale,
            max_loss_scale=max_loss_scale,
        )
        if scale_factor is not None and backoff_factor is None:
            given["backoff_factor"] = 1.0 / float(scale_factor)  # Apex: one factor both ways
        changes = {k: v for k, v in given.items() if v is not None}
        if max_skips_at_min is not _UNSET:
            changes["max_skips_at_min"] = max_skips_at_min
        self.half_dtype = half_dtype
        self._collapse = CollapseCheck(1.0, None, half_dtype, _DISABLE)
        self._rule = None
        try:
            self.rule = base.replace(**changes) if changes else base
        except ValueError as e:
            raise ValueError(str(e).replace("LossScaleRule", "LossScaler")) from None
        dev = self._device = torch.device(device)
        first = self.rule.first_scale
        self.scale = torch.full((1,), first, dtype=torch.float32, device=dev)
        self.inv_scale = torch.reciprocal(self.scale)
        self.growth_tracker = torch.zeros(1, dtype=torch.int32, device=dev)
        self.hysteresis_tracker = torch.full(
            (1,), self.rule.hysteresis, dtype=torch.int32, device=dev
        )
        self.found_inf = torch.zeros(1, dtype=torch.float32, device=dev)
        self.counters = StepCounters(dev)
        self._static_scale = first  # a static scale's value, for its warning (host)
        self._warned = 0  # overflowing steps taken (static scale) that were warned about
        self.updates = 0  # how many times update() applied the rule (for profilers and tests)

    @property
    def rule(self) -> LossScaleRule:
        """The :class:`~mpnb.core.amp.LossScaleRule` :meth:`update` applies."""
        return self._rule

    @rule.setter
    def rule(self, value: LossScaleRule) -> None:
        if not isinstance(value, LossScaleRule):
            raise TypeError(
                f"LossScaler.rule must be a LossScaleRule, got {type(value).__name__}; build "
                "one with LossScaleRule(...) or LossScaleRule.parse(...)."
            )
        if self._rule is not None and value.dynamic != self._rule.dynamic:
            kind = "dynamic" if self._rule.dynamic else "static"
            raise ValueError(
                f"LossScaler.rule: this scaler is {kind} and stays so (its state was made for "
                "it); build a new LossScaler (or amp.initialize(..., loss_scale=...)) to change "
                "between a dynamic and a static scale."
            )
        self._rule = value
        check = self._collapse
        check.floor, check.limit = value.collapse_floor, value.max_skips_at_min
        check.floor_name = (
            "no min_loss_scale is set, and a scale <= 1 amplifies nothing"
            if value.min_loss_scale is None
            else "min_loss_scale, the floor of the scale"
        )

    @property
    def dynamic(self) -> bool:
        """False for a static scale (the rule's kind, fixed for the scaler's life)."""
        return self._rule.dynamic

    @property
    def scale_factor(self) -> float:
        """Apex's name of ``growth_factor``; assigning it also sets ``backoff_factor = 1/v``."""
        return self.rule.growth_factor

    @scale_factor.setter
    def scale_factor(self, value: float) -> None:
        self.rule = self.rule.replace(growth_factor=value, backoff_factor=1.0 / float(value))

    @property
    def floor(self) -> float:
        """The scale at or below which skipped steps count towards the collapse error."""
        return self.rule.collapse_floor

    @property
    def skips_at_min(self) -> int:
        """Consecutive skipped steps at the floor so far (reads the device: a host sync)."""
        return self.counters.read()[StepCounters.FLOOR_RUN]

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped for inf/NaN gradients so far (reads the device: a host sync;
        counted on the device by every step, restored from checkpoints)."""
        return self.counters.read()[StepCounters.SKIPPED]

    def loss_scale(self) -> float:
        """The current scale as a Python float (host sync: for logging only)."""
        return float(self.scale.item())

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss.float() * scale`` on the device (no sync)."""
        if loss.dtype is torch.float32 and loss.device == self._device:
            return loss * self.scale
        return loss.float() * self.scale.to(loss.device)

    def clear_overflow(self) -> None:
        """Start a new ``scale_loss`` block: ``found_inf`` becomes a new zero flag.

        The previous block's flag tensor is left as it was: an optimizer that has not stepped
        yet still reads it.
        """
        self.found_inf = torch.zeros(1, dtype=torch.float32, device=self._device)

    def unscale(
        self,
        model_grads: Sequence[torch.Tensor],
        out: Sequence[torch.Tensor],
        accumulate: Sequence[torch.Tensor | None] | None = None,
    ) -> None:
        """``out = model_grads / scale`` in one multi-tensor pass; flags inf/NaN in found_inf.

        Args:
            model_grads: the scaled gradients (any float dtype, one dtype per call).
            out: where the unscaled values go (may be ``model_grads``; fp32 master grads).
            accumulate: optional tensors (or None) added to ``out`` afterwards (grads kept
                from an earlier, already unscaled backward).
        """
        if not model_grads:
            return
        if not isinstance(model_grads, list):
            model_grads = list(model_grads)
        if not isinstance(out, list):
            out = list(out)
        multi_tensor_scale(self.found_inf, model_grads, out, 1.0, scale_tensor=self.inv_scale)
        if accumulate is not None:
            pairs = [(o, a) for o, a in zip(out, accumulate, strict=False) if a is not None]
            if pairs:
                torch._foreach_add_([o for o, _ in pairs], [a.to(o.dtype) for o, a in pairs])

    def update(self) -> None:
        """Apply the rule to this block's ``found_inf``, on the device (no-op when static).

        The one call of :func:`mpnb.core.ops.update_loss_scale_` in amp: the hysteresis rule,
        the clamp to ``[floor, max_loss_scale]`` and ``inv_scale = 1 / scale``.
        """
        if not self.dynamic:
            return
        r = self.rule
        update_loss_scale_(
            self.scale,
            self.inv_scale,
            self.growth_tracker,
            self.hysteresis_tracker,
            self.found_inf,
            r.growth_factor,
            r.backoff_factor,
            r.growth_interval,
            r.hysteresis,
            r.floor,
            r.max_loss_scale,
        )
        self.updates += 1

    def note_step(self, found_inf: torch.Tensor, skip: bool, first: bool = True) -> None:
        """Count one optimizer step in :attr:`counters`, on the device (no host read).

        Args:
            found_inf: the step's overflow flag (all its ``scale_loss`` blocks together).
            skip: the step skips on overflow (some scaler of the step is dynamic).
            first: this is the step's first scaler (an overflowing step a static scale took
                is counted, and later warned about, once).
        """
        dynamic = self._rule.dynamic
        self.counters.note(
            found_inf, self.scale, self._rule.collapse_floor, skip and dynamic, first and not skip
        )

    def watch(self) -> None:
        """Look at :attr:`counters` without waiting (see :class:`~mpnb.core.amp._counters.
        HostView`): warn once per overflowing step a static scale took
        (:class:`StaticScaleOverflowWarning`), and raise :class:`LossScaleCollapseError` once
        ``max_skips_at_min`` steps in a row were skipped at the floor. On a CPU this sees the
        step just counted; on a GPU a step or so later."""
        counts = self.counters.view.latest()
        if counts is None:
            return
        _, run, taken = counts
        while self._warned < taken:
            self._warned += 1
            warn_static_overflow(self._static_scale, stacklevel=5)
        if run:
            self._collapse.raise_if(run)

    def state_dict(self) -> dict:
        """Apex-compatible state (``loss_scale``, ``unskipped``) plus ours (host sync)."""
        skipped, run, _ = self.counters.read()
        return {
            "loss_scale": float(self.scale.item()),
            "unskipped": int(self.growth_tracker.item()),
            "dynamic": self.dynamic,
            "hysteresis_tracker": int(self.hysteresis_tracker.item()),
            "skips_at_min": run,
            "skipped_steps": skipped,
        }

    def check_state_dict(self, state, key: str = "state") -> tuple:
        """Validate :meth:`state_dict` output (or an Apex ``loss_scalerN`` entry) without
        changing anything; returns what :meth:`load_state_dict` applies.

        Raises ValueError naming the bad key: a scale that is not a positive finite number, a
        count that is not an int in int32's range, a missing key.
        """
        if not isinstance(state, Mapping):
            raise ValueError(
                f"amp.load_state_dict: {key} must be a dict with 'loss_scale' and 'unskipped' "
                f"(an entry of amp.state_dict()), got {type(state).__name__}."
            )
        missing = {"loss_scale", "unskipped"} - set(state)
        if missing:
            raise ValueError(
                f"amp.load_state_dict: {key} lacks {sorted(missing)}; pass an entry of "
                "amp.state_dict()."
            )
        scale = positive_finite(
            state["loss_scale"],
            f"{key}['loss_scale']",
            owner="amp.load_state_dict",
            fix="the checkpoint is corrupt or not an amp.state_dict()",
        )
        counts = [_count(state, key, "unskipped", 0)]
        counts.append(_count(state, key, "hysteresis_tracker", self.rule.hysteresis, low=None))
        counts.append(_count(state, key, "skips_at_min", 0))
        counts.append(_count(state, key, "skipped_steps", 0))
        unskipped, hyst, skips, skipped = counts
        scale = self.rule.clamp(scale)
        # A count past the window (an Apex static scaler counts without bound) grows next time.
        unskipped = min(unskipped, self.rule.growth_interval - 1)
        return scale, unskipped, hyst, skips, skipped

    def load_state_dict(self, state) -> None:
        """Restore :meth:`state_dict` output (or an Apex ``loss_scalerN`` entry); validated
        first (:meth:`check_state_dict`), so a bad entry changes nothing."""
        self.apply_state(self.check_state_dict(state))

    def apply_state(self, checked: tuple) -> None:
        """Set the state from :meth:`check_state_dict`'s result."""
        scale, unskipped, hyst, skips, skipped = checked
        self.scale.fill_(scale)
        torch.reciprocal(self.scale, out=self.inv_scale)
        self.growth_tracker.fill_(unskipped)
        self.hysteresis_tracker.fill_(hyst)
        self.counters.set(skipped, skips)
        self._static_scale = float(scale)
        self.clear_overflow()


def _alias(value, alias, name: str, alias_name: str):
    if alias is None:
        return value
    if value is not None and value != alias:
        raise ValueError(
            f"LossScaler: {name}={value!r} and its Apex alias {alias_name}={alias!r} disagree; "
            "pass only one of them."
        )
    return alias


def _count(state, key: str, name: str, default: int, low: int | None = 0) -> int:
    value = state.get(name, default)
    ok = isinstance(value, int) and not isinstance(value, bool)
    if not ok or (low is not None and value < low) or abs(value) > _INT32_MAX:
        raise ValueError(
            f"amp.load_state_dict: {key}[{name!r}]={value!r} must be an int in "
            f"[{0 if low is not None else -_INT32_MAX}, 2**31-1]; the checkpoint is corrupt or "
            "not an amp.state_dict()."
        )
    return value
