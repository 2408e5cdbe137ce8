"""``AmpHandle``: the state of one ``amp.initialize`` call, and ``scale_loss``.

Host syncs: one per optimizer step, in the optimizer's step pre-hook, where the overflow flag
and the scales are read together (:class:`mpnb.core.amp._optimizer.OptimizerAmp`). Entering
and leaving ``scale_loss`` never syncs: the loss is multiplied by the scale on the device and
the unscale (``multi_tensor_scale`` with the device ``inv_scale``) writes the overflow flag on
the device.

Fused optimizers (next issue) plug in through ``optimizer._mpnb_accepts_scale``; see
:class:`~mpnb.core.amp._optimizer.OptimizerAmp`.
"""

from __future__ import annotations

import torch

from mpnb.core.amp._optimizer import OptimizerAmp
from mpnb.core.amp._properties import Properties
from mpnb.core.amp.scaler import LossScaler

__all__ = ["AmpHandle"]


class _ScaleLossBlock:
    """One ``scale_loss`` block (a class, not a generator: this runs every step)."""

    __slots__ = ("handle", "loss", "states", "loss_id", "delay", "scaler")

    def __init__(self, handle, loss, states, loss_id, delay):
        self.handle, self.loss, self.states = handle, loss, states
        self.loss_id, self.delay, self.scaler = loss_id, delay, None

    def __enter__(self) -> torch.Tensor:
        h = self.handle
        if not h.properties.enabled:
            return self.loss
        n = len(h.scalers)
        if not 0 <= self.loss_id < n:
            raise ValueError(
                f"amp.scale_loss: loss_id={self.loss_id} but amp.initialize(num_losses="
                f"{n}) made loss ids 0..{n - 1}; pass a valid loss_id or raise num_losses."
            )
        self.scaler = scaler = h.scalers[self.loss_id]
        for st in self.states:
            st.prepare_backward()
        scaler.clear_overflow()
        return scaler.scale_loss(self.loss)

    def __exit__(self, exc_type, exc, tb) -> bool:
        scaler = self.scaler
        if exc_type is not None or scaler is None:
            return False  # the exception propagates; nothing is unscaled
        alone = len(self.states) == 1
        if alone and not self.delay and self.states[0].unscale_and_update(scaler):
            return False  # the common case: unscale and scale update in one call
        for st in self.states:
            st.after_backward(scaler, self.delay, alone)
        if not self.delay and any(not st.fused for st in self.states):
            scaler.update()
        return False


class AmpHandle:
    """Everything one ``amp.initialize`` set up: properties, scalers, optimizer states, hooks.

    Args:
        properties: the resolved :class:`Properties`.
        scalers: one :class:`LossScaler` per ``loss_id``.
        opt_states: one :class:`OptimizerAmp` per optimizer.
        hooks: removable handles of the model hooks.

    Example::

        >>> model, opt = amp.initialize(model, opt, opt_level="O2")
        >>> with amp.scale_loss(loss, opt) as scaled:
        ...     scaled.backward()
        >>> opt.step()
    """

    def __init__(
        self,
        properties: Properties,
        scalers: list[LossScaler],
        opt_states: list[OptimizerAmp],
        hooks: list,
    ):
        self.properties = properties
        self.scalers = scalers
        self.opt_states = opt_states
        self.hooks = hooks

    def scale_loss(
        self,
        loss: torch.Tensor,
        opt_states: list[OptimizerAmp],
        loss_id: int = 0,
        delay_unscale: bool = False,
    ) -> _ScaleLossBlock:
        """A context manager yielding ``loss * scale``; on exit it unscales the grads.

        The grads of ``opt_states``' params are unscaled when the block exits without an
        exception. With ``delay_unscale=True`` the grads stay scaled and accumulate until a
        later block without it. On overflow the following ``optimizer.step()`` is skipped.
        """
        return _ScaleLossBlock(self, loss, opt_states, loss_id, delay_unscale)

    def state_dict(self) -> dict:
        """``{"loss_scaler0": {...}, ...}`` (Apex's keys; one host sync per scaler)."""
        return {f"loss_scaler{i}": s.state_dict() for i, s in enumerate(self.scalers)}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` output into the scalers."""
        keys = sorted(k for k in state if k.startswith("loss_scaler"))
        if len(keys) != len(self.scalers):
            raise ValueError(
                f"amp.load_state_dict: the state has {len(keys)} loss scalers but "
                f"amp.initialize(num_losses={len(self.scalers)}) made {len(self.scalers)}; "
                "initialize with the num_losses the checkpoint was saved with."
            )
        for i, s in enumerate(self.scalers):
            s.load_state_dict(state[f"loss_scaler{i}"])

    def remove_hooks(self) -> None:
        """Detach every model and optimizer hook this handle registered."""
        for h in self.hooks:
            h.remove()
        for st in self.opt_states:
            for h in st.hooks:
                h.remove()
        self.hooks = []
