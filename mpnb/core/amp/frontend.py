"""Apex's handle-less amp API: ``scale_loss``, ``master_params``, ``state_dict``...

Apex's functions take no handle. ``amp.scale_loss(loss, optimizer)`` finds the optimizer's
state through ``optimizer._amp_stash`` (a read-only view, see
:class:`~mpnb.core.amp._state.AmpStash`), and ``amp.state_dict()``/``amp.load_state_dict()``
act on the handle of the latest ``amp.initialize``, of which this module keeps one weak
reference: Apex's compatibility surface. All training state lives in the handles, their
scalers and the per-optimizer states.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator

import torch

from mpnb.core.amp.handle import AmpHandle, _ScaleLossBlock
from mpnb.core.amp.seam import amp_stash, inner_optimizer

__all__ = [
    "scale_loss",
    "master_params",
    "state_dict",
    "load_state_dict",
    "current_handle",
    "set_current_handle",
    "preserve_current_handle",
]

_latest: weakref.ref | None = None  # Apex compatibility: the latest amp.initialize's handle


def set_current_handle(handle: AmpHandle) -> None:
    """Make ``handle`` the one Apex's handle-less functions act on (``amp.initialize`` does)."""
    global _latest
    _latest = weakref.ref(handle)


@contextlib.contextmanager
def preserve_current_handle() -> Iterator[None]:
    """Keep the current handle across ``amp.initialize`` calls made inside the block.

    For tools that run amp on copies of a user's model (the lab's comparisons, profiles and
    traces): their ``amp.initialize`` calls must not change what the user's handle-less
    ``amp.state_dict()`` / ``amp.load_state_dict()`` act on. Restored also when the block
    raises.

    Example::

        >>> with preserve_current_handle():
        ...     amp.initialize(copy.deepcopy(model), opt_level="O2", verbosity=0)
    """
    global _latest
    saved = _latest
    try:
        yield
    finally:
        _latest = saved


def current_handle() -> AmpHandle:
    """The handle of the latest ``amp.initialize`` (ValueError before any, or once the
    models and optimizers it managed are gone).

    Example::

        >>> amp.current_handle().scalers[0].loss_scale()
        65536.0
    """
    handle = None if _latest is None else _latest()
    if handle is None:
        raise ValueError(
            "amp: no amp.initialize is in effect; call "
            "`model, optimizer = amp.initialize(model, optimizer)` first."
        )
    return handle


def _stash_of(optimizer):
    wrapper = inner_optimizer(optimizer) is not None  # LARC
    if not (isinstance(optimizer, torch.optim.Optimizer) or wrapper):
        raise TypeError(f"amp: expected a torch.optim.Optimizer, got {type(optimizer).__name__}.")
    stash = amp_stash(optimizer)
    if not isinstance(getattr(stash, "handle", None), AmpHandle):
        raise ValueError(
            "amp: this optimizer was not passed to amp.initialize; call "
            "`model, optimizer = amp.initialize(model, optimizer, opt_level=...)` before "
            "amp.scale_loss, and use the optimizer it returns."
        )
    return stash


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
        optimizers: the optimizer (or list) whose params this backward reaches; all from one
            ``amp.initialize``.
        loss_id: which loss scaler to use (``0 .. num_losses-1``).
        model: accepted for Apex compatibility; unused.
        delay_unscale: keep the grads scaled to accumulate more backwards before unscaling.
        delay_overflow_check: accepted for Apex compatibility; the check is always on the
            device and read once per step.

    Misuse raises an error naming the fix: ``optimizer.step()`` inside the block, a block
    nested in another on the same optimizer, two ``step()`` calls after one backward, a step
    after ``delay_unscale=True`` blocks only.

    Example::

        >>> with amp.scale_loss(loss, optimizer) as scaled_loss:
        ...     scaled_loss.backward()
        >>> optimizer.step()          # skipped (bitwise) if the grads overflowed
    """
    if not isinstance(optimizers, (list, tuple)):  # the common case: one optimizer
        stash = _stash_of(optimizers)
        return _ScaleLossBlock(stash.handle, loss, [stash.amp_state], loss_id, delay_unscale)
    stashes = [_stash_of(o) for o in optimizers]
    if not stashes or any(s.handle is not stashes[0].handle for s in stashes):
        raise ValueError(
            "amp.scale_loss: pass one optimizer or a non-empty list of optimizers from one "
            "amp.initialize call per scale_loss block."
        )
    states = [s.amp_state for s in stashes]
    return _ScaleLossBlock(stashes[0].handle, loss, states, loss_id, delay_unscale)


def master_params(optimizer) -> Iterator[torch.nn.Parameter]:
    """The params ``optimizer`` updates: fp32 masters under O2, the model's params otherwise.

    Their ``.grad`` is unscaled after ``scale_loss`` exits, so clipping them clips real grads.
    An ``mpnb.optimizers`` fused optimizer would unscale a step's single block inside its
    ``step()``; asking for its master params unscales those grads now instead (the step then
    only checks the overflow flag), so clipping works the same with every optimizer.

    Example::

        >>> torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), 1.0)
    """
    state = getattr(amp_stash(optimizer), "amp_state", None)
    if state is not None:
        state.unscale_deferred()
    return (p for group in optimizer.param_groups for p in group["params"])


def state_dict(destination: dict | None = None) -> dict:
    """Every loss scaler of the latest ``amp.initialize`` (Apex's ``loss_scalerN`` keys)."""
    out = {} if destination is None else destination
    out.update(current_handle().state_dict())
    return out


def load_state_dict(state: dict) -> None:
    """Restore :func:`state_dict` output into the latest ``amp.initialize``'s scalers (all of
    it, or nothing when an entry is invalid)."""
    current_handle().load_state_dict(state)
