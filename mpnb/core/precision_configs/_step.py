"""A configuration's training step: one loop trains every configuration, each step owned by it.

A precision configuration builds a :class:`TrainStep` for a model and optimizer
(:meth:`~mpnb.core.precision_configs.PrecisionConfig.train_step`); a training loop that treats
every configuration alike calls only its hooks, in Lightning's precision-plugin style::

    step.zero_grad()
    with step.forward_context():
        loss = loss_fn(step.model(x), y)
    step.backward(loss)
    step.step()

The defaults are plain fp32 training (no context, ``loss.backward()``, ``optimizer.step()``).
:class:`AmpStep` is mpnb's: ``amp.scale_loss`` around the backward, then the optimizer's
step, exactly as a user of ``mpnb.amp`` writes it. Each step exposes, as device tensors that
nobody reads inside the step, the last step's overflow flag (:attr:`~TrainStep.found_inf`) and
the loss scale after it (:attr:`~TrainStep.scale`); :attr:`~TrainStep.skips` says whether a set
flag means the step was skipped. A caller that wants them on the host reads them when it
chooses (the lab: a batch of steps at a time).
"""

from __future__ import annotations

import contextlib

import torch

from mpnb.core import amp

__all__ = ["TrainStep", "AmpStep"]


class TrainStep:
    """The hooks of one training step; the defaults train in plain fp32.

    Args:
        model: the module a training forward calls (:attr:`model`).
        optimizer: the optimizer :meth:`step` steps.
        module: the model for evaluation and inspection (default: ``model``; a compiled
            step trains through a compiled wrapper of it).

    Attributes:
        model, optimizer, module: as given.
        compile_budget_s: None, or the seconds a caller allows for compiling :attr:`model`
            (warming it up until no call compiles) before it times a step.

    Example::

        >>> step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1))
        >>> step.zero_grad()
        >>> with step.forward_context():
        ...     loss = model(x).square().mean()
        >>> step.backward(loss)
        >>> step.step()
        >>> step.found_inf, step.skips
        (tensor([0.]), False)
    """

    compile_budget_s: float | None = None

    def __init__(self, model, optimizer, module=None):
        self.model, self.optimizer = model, optimizer
        self.module = model if module is None else module
        self._zero = None

    def run(self, x, y, compute_loss) -> torch.Tensor:
        """One whole step on batch ``(x, y)`` through the hooks; returns the loss (detached,
        on the device, unread). ``compute_loss(model, x, y)`` is the forward and the loss.
        A step that must own the whole sequence (a captured CUDA graph) overrides this."""
        self.zero_grad()
        with self.forward_context():
            loss = compute_loss(self.model, x, y)
        self.backward(loss)
        self.step()
        return loss.detach()

    def zero_grad(self) -> None:
        """Drop the gradients (``set_to_none``)."""
        self.optimizer.zero_grad(set_to_none=True)

    def forward_context(self) -> contextlib.AbstractContextManager:
        """The context the forward and the loss run in (none by default)."""
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate ``loss``."""
        loss.backward()

    def step(self) -> None:
        """Update the weights."""
        self.optimizer.step()

    def _device_zero(self) -> torch.Tensor:
        if self._zero is None:
            p = next((p for g in self.optimizer.param_groups for p in g["params"]), None)
            dev = p.device if p is not None else torch.device("cpu")
            self._zero = torch.zeros(1, dtype=torch.float32, device=dev)
        return self._zero

    @property
    def found_inf(self) -> torch.Tensor:
        """The last step's overflow flag (1 element, float32, on the device): none here."""
        return self._device_zero()

    @property
    def scale(self) -> torch.Tensor:
        """The loss scale after the last step (1 element, float32, on the device): 1 here."""
        return self._device_zero() + 1.0

    @property
    def skips(self) -> bool:
        """True when a set :attr:`found_inf` means the step was skipped (a dynamic scale)."""
        return False

    def close(self) -> None:
        """Release what the step holds beyond the model and optimizer (hooks); idempotent."""


class AmpStep(TrainStep):
    """mpnb's step: the backward inside ``amp.scale_loss``, then ``optimizer.step()``.

    Args:
        model, optimizer: the pair ``amp.initialize`` returned.
        handle: that call's :class:`~mpnb.core.amp.handle.AmpHandle` (its first scaler is the
            one read; :meth:`close` removes its hooks).

    The overflow flag and the scale are the scaler's own tensors (amp decides on the device;
    whether a steady-state step reads them on the host is amp's business, not this class's).
    """

    def __init__(self, model, optimizer, handle):
        super().__init__(model, optimizer)
        self.handle = handle
        self.scaler = handle.scalers[0]

    def backward(self, loss: torch.Tensor) -> None:
        """``with amp.scale_loss(loss, optimizer) as scaled: scaled.backward()``."""

        with amp.scale_loss(loss, self.optimizer) as scaled:
            scaled.backward()

    @property
    def found_inf(self) -> torch.Tensor:
        """The scaler's overflow flag of the last ``scale_loss`` block."""
        return self.scaler.found_inf

    @property
    def scale(self) -> torch.Tensor:
        """The scaler's scale tensor (updated in place: copy it to keep this step's)."""
        return self.scaler.scale

    @property
    def skips(self) -> bool:
        """True under a dynamic scale: amp skips a step whose gradients overflowed."""
        return self.scaler.dynamic

    def close(self) -> None:
        """Remove amp's hooks (this also closes an autocast region a Ctrl-C left open)."""
        if self.handle is not None:
            self.handle.remove_hooks()
            self.handle = None
