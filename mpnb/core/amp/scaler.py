"""The loss scaler: one object per loss, its scale kept on the device.

Host syncs: none here except :meth:`LossScaler.state_dict`, :meth:`LossScaler.loss_scale` and
:meth:`LossScaler.read`, which the optimizer's step pre-hook calls as its single per-step sync
(:meth:`LossScaler.note_step` only takes numbers already fetched there; see
:mod:`mpnb.core.amp.handle`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mpnb.core.ops import multi_tensor_scale, update_loss_scale_

__all__ = ["LossScaler", "LossScaleCollapseError"]


class LossScaleCollapseError(RuntimeError):
    """Raised when every step is skipped for overflow even at the minimum loss scale."""


class LossScaler:
    """Dynamic or static loss scaling with Apex's numbers.

    Dynamic: starts at ``init_scale`` (2**16), doubles after ``scale_window`` (2000)
    consecutive clean unscales, halves on any inf/NaN gradient, and is clamped to
    ``[min_loss_scale, max_loss_scale]``. Static (``loss_scale`` a number): the scale never
    changes and, as in Apex, overflowing steps are not skipped.

    The scale, its inverse, the growth tracker and the overflow flag are one-element tensors on
    ``device``; :meth:`unscale` and :meth:`update` never sync with the host.

    Args:
        loss_scale: ``"dynamic"`` or a positive number.
        init_scale: the first dynamic scale.
        scale_factor: growth factor (backoff is its inverse).
        scale_window: clean steps between two growths.
        min_loss_scale, max_loss_scale: clamp bounds (None: no lower bound).
        max_skips_at_min: after this many consecutive skipped steps with the scale at its floor
            (``min_loss_scale``, or 1.0 without one) raise :class:`LossScaleCollapseError`;
            None disables the check.
        device: where the state lives.

    Example::

        >>> s = LossScaler("dynamic", scale_window=3)
        >>> g = [torch.ones(4) * 65536]
        >>> s.unscale(g, g)            # g == ones, s.found_inf == 0
        >>> s.update()
    """

    def __init__(
        self,
        loss_scale="dynamic",
        init_scale: float = 2.0**16,
        scale_factor: float = 2.0,
        scale_window: int = 2000,
        min_loss_scale: float | None = None,
        max_loss_scale: float = 2.0**24,
        max_skips_at_min: int | None = 100,
        device="cpu",
    ):
        if scale_window <= 0:
            raise ValueError(f"LossScaler: scale_window must be positive, got {scale_window}.")
        self.dynamic = loss_scale == "dynamic"
        first = init_scale if self.dynamic else float(loss_scale)
        if self.dynamic:
            first = min(max_loss_scale, first)
            if min_loss_scale is not None:
                first = max(min_loss_scale, first)
        self.scale_factor, self.scale_window = float(scale_factor), int(scale_window)
        self.min_loss_scale, self.max_loss_scale = min_loss_scale, max_loss_scale
        self.max_skips_at_min = max_skips_at_min
        dev = self._device = torch.device(device)
        # scale, inv_scale and found_inf are views of one buffer: a step reads them in one go.
        self._packed = torch.zeros(3, dtype=torch.float32, device=dev)
        self.scale, self.inv_scale, self.found_inf = self._packed.split(1)
        self.scale.fill_(first)
        torch.reciprocal(self.scale, out=self.inv_scale)
        self._borrowers: list = []  # optimizer states whose step flag is found_inf, see below
        self.growth_tracker = torch.zeros(1, dtype=torch.int32, device=dev)
        self.hysteresis_tracker = torch.ones(1, dtype=torch.int32, device=dev)
        self.skips_at_min = 0

    @property
    def floor(self) -> float:
        """The scale at which skipped steps count towards :class:`LossScaleCollapseError`."""
        return 1.0 if self.min_loss_scale is None else float(self.min_loss_scale)

    def loss_scale(self) -> float:
        """The current scale as a Python float (host sync: for logging only)."""
        return float(self.scale.item())

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss.float() * scale`` on the device (no sync)."""
        if loss.dtype is torch.float32 and loss.device == self._device:
            return loss * self.scale
        return loss.float() * self.scale.to(loss.device)

    def clear_overflow(self) -> None:
        """Reset the overflow flag before a new backward.

        An optimizer whose only unscale this step was by this scaler uses ``found_inf`` as its
        step flag instead of copying it (one kernel less per step); it gets a copy here first.
        """
        if self._borrowers:
            self._release_flag()
        self.found_inf.zero_()

    def lend_flag(self, borrower) -> torch.Tensor:
        """``found_inf``, as ``borrower``'s step flag until the next :meth:`clear_overflow`."""
        self._borrowers.append(borrower)
        return self.found_inf

    def _release_flag(self) -> None:
        for b in self._borrowers:
            b.own_flag()
        self._borrowers.clear()

    def read(self) -> tuple[float, float]:
        """``(found_inf, scale)`` as Python floats: a host sync (once per step, see handle)."""
        scale, _, found = self._packed.tolist()
        return found, scale

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
            accumulate: optional tensors (or None) added to ``out`` afterwards (grads stashed
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

    def update(self, found_inf: torch.Tensor | None = None) -> None:
        """Apex's dynamic update from ``found_inf`` (default: this scaler's), on the device.

        One call of :func:`mpnb.core.ops.update_loss_scale_`: the hysteresis rule, the clamp
        to ``[min_loss_scale, max_loss_scale]`` and ``inv_scale = 1 / scale``.
        """
        args = self.update_args()
        if args is None:
            return
        scale, growth, hyst, *rule = args
        flag = self.found_inf if found_inf is None else found_inf
        update_loss_scale_(scale, self.inv_scale, growth, hyst, flag, *rule)

    def update_args(self) -> tuple | None:
        """What :meth:`update` passes to ``update_loss_scale_`` besides ``inv_scale`` and the
        flag, in :func:`mpnb.core.ops._registry.unscale_grads`'s order; None when static."""
        if not self.dynamic:
            return None
        lo = 0.0 if self.min_loss_scale is None else float(self.min_loss_scale)
        return (
            self.scale,
            self.growth_tracker,
            self.hysteresis_tracker,
            self.scale_factor,
            1.0 / self.scale_factor,
            self.scale_window,
            1,
            lo,
            float(self.max_loss_scale),
        )

    def note_step(self, skipped: bool, scale: float) -> None:
        """Count skipped steps at the floor; raise once there are ``max_skips_at_min`` in a row.

        ``skipped`` and ``scale`` are host values the caller read in its one sync of the step.
        """
        if not skipped or not self.dynamic or scale > self.floor:
            self.skips_at_min = 0
            return
        self.skips_at_min += 1
        if self.max_skips_at_min is not None and self.skips_at_min >= self.max_skips_at_min:
            raise LossScaleCollapseError(
                f"amp: {self.skips_at_min} consecutive optimizer steps were skipped for inf/NaN "
                f"gradients with the loss scale at its floor ({scale:g}): the gradients are "
                "non-finite even unscaled, so training would never progress. Check the loss and "
                "the inputs for inf/NaN, lower the learning rate, or use bf16 (half_dtype="
                "torch.bfloat16, fp32's range); pass min_loss_scale or max_skips_at_min=None to "
                "change this check."
            )

    def state_dict(self) -> dict:
        """Apex-compatible state (``loss_scale``, ``unskipped``) plus ours (host sync)."""
        return {
            "loss_scale": float(self.scale.item()),
            "unskipped": int(self.growth_tracker.item()),
            "dynamic": self.dynamic,
            "hysteresis_tracker": int(self.hysteresis_tracker.item()),
            "skips_at_min": self.skips_at_min,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` output (or an Apex ``loss_scalerN`` entry)."""
        missing = {"loss_scale", "unskipped"} - set(state)
        if missing:
            raise ValueError(
                f"LossScaler.load_state_dict: missing keys {sorted(missing)}; pass "
                "an entry of amp.state_dict()."
            )
        self.scale.fill_(float(state["loss_scale"]))
        torch.reciprocal(self.scale, out=self.inv_scale)
        self.growth_tracker.fill_(int(state["unskipped"]))
        self.hysteresis_tracker.fill_(int(state.get("hysteresis_tracker", 1)))
        self.skips_at_min = int(state.get("skips_at_min", 0))
        self.clear_overflow()
