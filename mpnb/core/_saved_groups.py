"""What a checkpoint's param groups say before they replace the optimizer's: who saved them.

``torch.optim.Optimizer.load_state_dict`` replaces every param group's hyperparameters with
the saved ones: a resume continues with the checkpoint's ``lr``, ``betas``... by design. Two
things it does not say, which :class:`SavedGroups` does (amp's load hook runs it for every
optimizer amp set up; mpnb's fused optimizers run it in their own load; here, below both, so
that neither imports the other):

* **Another optimizer class saved them.** A group that lacks a numeric hyperparameter of this
  optimizer (SGD's ``momentum``) and holds one this optimizer does not know (Adam's
  ``betas``) comes from another kind of optimizer: its state (``exp_avg``...) does not fit
  this one's update, and torch.optim would fail later, deep in ``step()`` (``KeyError:
  'momentum'``). Refused at the load, before anything changes.
* **Other hyperparameters replace the constructed ones.** Kept, as torch.optim keeps them (a
  resume), with one :class:`CheckpointHyperparamsWarning` per load naming what was
  replaced. A learning rate under an LR scheduler is compared through the scheduler's
  ``initial_lr`` (the scheduled ``lr`` differs on every resume), momenta a cyclic scheduler
  drives are not compared.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping

import torch

__all__ = ["CheckpointHyperparamsWarning", "SavedGroups"]

# Keys an LR scheduler adds to a group (OneCycleLR, CyclicLR): bookkeeping, not the
# optimizer's hyperparameters.
_SCHEDULER_KEYS = ("initial_lr", "max_lr", "min_lr", "base_lr", "base_momentum", "max_momentum")
# How a step is computed, not what it computes; and the rounding options, which the fused
# optimizers keep from their constructor (:mod:`mpnb.core.optimizers._load`).
_NOT_COMPARED = ("params", "foreach", "fused", "capturable", "differentiable")
_NOT_COMPARED += ("stochastic_rounding", "kahan_summation", *_SCHEDULER_KEYS)


class CheckpointHyperparamsWarning(UserWarning):
    """A checkpoint's param groups replaced hyperparameters the optimizer was built with."""


def _numeric(v) -> bool:
    if isinstance(v, bool) or v is None:
        return False
    if isinstance(v, (int, float)) or (isinstance(v, torch.Tensor) and v.numel() == 1):
        return True
    return isinstance(v, (tuple, list)) and bool(v) and all(_numeric(x) for x in v)


def _value(v):
    if isinstance(v, torch.Tensor):
        return float(v)
    if isinstance(v, (tuple, list)):
        return tuple(_value(x) for x in v)
    return v


def _differs(a, b) -> bool:
    a, b = _value(a), _value(b)
    if isinstance(a, float) and isinstance(b, (int, float)) and not isinstance(b, bool):
        return not math.isclose(a, b, rel_tol=1e-12, abs_tol=0.0)
    return a != b


class SavedGroups:
    """A checkpoint's param groups against ``optimizer``'s, read before the load.

    Args:
        optimizer: the optimizer about to load.
        state_dict: what it loads (``optimizer.state_dict()`` of the saved run).

    Example::

        >>> saved = SavedGroups(optimizer, state_dict)
        >>> saved.check()      # ValueError, nothing changed, if another class saved it
        >>> optimizer.load_state_dict(state_dict)
        >>> saved.warn()       # one warning naming the replaced hyperparameters, if any
    """

    def __init__(self, optimizer, state_dict) -> None:
        self.owner = type(optimizer).__name__
        groups = state_dict.get("param_groups") if isinstance(state_dict, Mapping) else None
        self.saved = [g for g in groups if isinstance(g, Mapping)] if groups else []
        self.own = [dict(g) for g in optimizer.param_groups]
        self.state_keys = sorted(
            {k for v in state_dict.get("state", {}).values() if isinstance(v, Mapping) for k in v}
            if isinstance(state_dict, Mapping) and isinstance(state_dict.get("state"), Mapping)
            else set()
        )

    def check(self) -> None:
        """Raise ValueError, before anything changes, when another optimizer class saved the
        groups: a numeric hyperparameter of this optimizer is missing and one it does not
        know is there."""
        for i, (saved, own) in enumerate(zip(self.saved, self.own, strict=False)):
            hyper = [k for k, v in own.items() if _numeric(v) and k not in _NOT_COMPARED]
            missing = [k for k in hyper if k not in saved]
            foreign = [
                k
                for k, v in saved.items()
                if _numeric(v) and k not in own and k not in _NOT_COMPARED
            ]
            if missing and foreign:
                state = f" and state {self.state_keys}" if self.state_keys else ""
                raise ValueError(
                    f"{self.owner}.load_state_dict: the checkpoint's param group {i} has no "
                    f"{missing} (this optimizer's hyperparameters) but has {foreign}{state}: it "
                    f"was saved by another optimizer class, whose state does not fit "
                    f"{self.owner}'s update (its step() would fail on the missing keys). Load "
                    "it into the optimizer class that saved it, or leave this optimizer's "
                    "state fresh (skip optimizer.load_state_dict). Nothing was loaded."
                )

    def replaced(self) -> list[str]:
        """``"group 0 lr 0.5 -> 0.001"`` for each constructed hyperparameter the saved group
        replaces (a scheduled lr through its ``initial_lr``; driven momenta not compared)."""
        out = []
        for i, (saved, own) in enumerate(zip(self.saved, self.own, strict=False)):
            cyclic = "base_momentum" in saved or "base_momentum" in own
            for k, new in saved.items():
                if k in _NOT_COMPARED or k not in own or (cyclic and k in ("momentum", "betas")):
                    continue
                old = own[k]
                if k == "lr" and ("initial_lr" in saved or "initial_lr" in own):
                    old, new = own.get("initial_lr", old), saved.get("initial_lr", new)
                    k = "initial lr"
                if _differs(old, new):
                    out.append(f"group {i} {k} {_value(old)!r} -> {_value(new)!r}")
        return out

    def warn(self) -> None:
        """One :class:`CheckpointHyperparamsWarning` naming every replaced hyperparameter."""
        changes = self.replaced()
        if not changes:
            return
        shown = "; ".join(changes[:6]) + (f"; and {len(changes) - 6} more" if changes[6:] else "")
        warnings.warn(
            f"{self.owner}.load_state_dict: the checkpoint's hyperparameters replaced the ones "
            f"this optimizer was built with ({shown}), as torch.optim does on a resume; "
            "training continues with the checkpoint's values. To train with the constructed "
            "ones, set them after loading (for g in optimizer.param_groups: g['lr'] = ...).",
            CheckpointHyperparamsWarning,
            stacklevel=4,
        )
