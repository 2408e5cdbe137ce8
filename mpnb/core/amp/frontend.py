"""Apex's module-level amp API: ``scale_loss``, ``master_params``, ``state_dict``...

Apex's API has no handle argument (``amp.state_dict()``), so one :class:`AmpRegistry` object
maps each initialized optimizer (weakly) to its state and remembers the latest handle. All
training state lives in the handle, its scalers and the per-optimizer objects.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator

import torch

from mpnb.core.amp._optimizer import OptimizerAmp
from mpnb.core.amp.handle import AmpHandle

__all__ = [
    "AmpRegistry",
    "registry",
    "scale_loss",
    "master_params",
    "state_dict",
    "load_state_dict",
    "current_handle",
]


class AmpRegistry:
    """Which optimizers and models amp manages, and the handle of the latest initialize."""

    def __init__(self) -> None:
        self.optimizers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.handles: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> handle
        self.models: weakref.WeakSet = weakref.WeakSet()
        self.latest: AmpHandle | None = None

    def lookup(self, optimizer) -> tuple[AmpHandle, OptimizerAmp]:
        """The handle and state of ``optimizer``, or a ValueError saying to initialize first."""
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"amp: expected a torch.optim.Optimizer, got {type(optimizer).__name__}."
            )
        if optimizer not in self.optimizers:
            raise ValueError(
                "amp: this optimizer was not passed to amp.initialize; call "
                "`model, optimizer = amp.initialize(model, optimizer, opt_level=...)` before "
                "amp.scale_loss / amp.master_params, and use the optimizer it returns."
            )
        return self.handles[optimizer], self.optimizers[optimizer]


registry = AmpRegistry()


def current_handle() -> AmpHandle:
    """The handle of the latest ``amp.initialize`` (ValueError before any)."""
    if registry.latest is None:
        raise ValueError(
            "amp: amp.initialize has not been called yet; call "
            "`model, optimizer = amp.initialize(model, optimizer)` first."
        )
    return registry.latest


def scale_loss(
    loss: torch.Tensor,
    optimizers,
    loss_id: int = 0,
    model=None,
    delay_unscale: bool = False,
    delay_overflow_check: bool = False,
) -> contextlib.AbstractContextManager[torch.Tensor]:
    """Context manager yielding the scaled loss; on exit the grads are unscaled.

    Args:
        loss: the loss tensor.
        optimizers: the optimizer (or list) whose params this backward reaches.
        loss_id: which loss scaler to use (``0 .. num_losses-1``).
        model: accepted for Apex compatibility; unused.
        delay_unscale: keep the grads scaled to accumulate more backwards before unscaling.
        delay_overflow_check: accepted for Apex compatibility; the check is always on the
            device and read once per step.

    Example::

        >>> with amp.scale_loss(loss, optimizer) as scaled_loss:
        ...     scaled_loss.backward()
        >>> optimizer.step()          # skipped (bitwise) if the grads overflowed
    """
    if registry.latest is None:
        raise ValueError(
            "amp.scale_loss called before amp.initialize; call `model, optimizer "
            "= amp.initialize(model, optimizer, opt_level=...)` first."
        )
    if not isinstance(optimizers, (list, tuple)):  # the common case: one optimizer
        handle, st = registry.lookup(optimizers)
        return handle.scale_loss(loss, [st], loss_id, delay_unscale)
    found = [registry.lookup(o) for o in optimizers]
    handle = found[0][0]
    if any(h is not handle for h, _ in found):
        raise ValueError(
            "amp.scale_loss: the optimizers come from different amp.initialize "
            "calls; pass optimizers of one initialize per scale_loss block."
        )
    return handle.scale_loss(loss, [s for _, s in found], loss_id, delay_unscale)


def master_params(optimizer) -> Iterator[torch.nn.Parameter]:
    """The params ``optimizer`` updates: fp32 masters under O2, the model's params otherwise.

    Their ``.grad`` is unscaled after ``scale_loss`` exits, so clipping them clips real grads.

    Example::

        >>> torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), 1.0)
    """
    for group in optimizer.param_groups:
        yield from group["params"]


def state_dict(destination: dict | None = None) -> dict:
    """Every loss scaler of the latest ``amp.initialize`` (Apex's ``loss_scalerN`` keys)."""
    out = {} if destination is None else destination
    out.update(current_handle().state_dict())
    return out


def load_state_dict(state: dict) -> None:
    """Restore :func:`state_dict` output into the latest ``amp.initialize``'s scalers."""
    current_handle().load_state_dict(state)
