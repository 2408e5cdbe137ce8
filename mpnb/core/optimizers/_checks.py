"""What the fused optimizers check before they change anything: hyper-parameters, param
groups and loads."""

from __future__ import annotations

import itertools
import math
import os
import sys
import warnings
from collections.abc import Mapping

import torch
from torch.optim.optimizer import required

from mpnb.core._numbers import is_positive_finite, positive_finite

__all__ = [
    "check_hyperparams",
    "check_param_group",
    "group_tensors",
    "check_loadable",
    "number",
    "DuplicateParameterWarning",
    "ZeroEpsWarning",
]


class DuplicateParameterWarning(UserWarning):
    """A parameter is listed twice in one param group: every step updates it twice."""


class ZeroEpsWarning(UserWarning):
    """``eps=0``: a parameter whose gradient is zero gets a NaN update (``0 / 0``)."""


def number(value) -> float | None:
    """``value`` as a float if it is a real number (or a one-element tensor), else None."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def check_hyperparams(owner: str, *, betas=None, **values) -> None:
    """Refuse what ``torch.optim`` refuses, and NaN/inf too; each error names the argument.

    Args:
        owner: the optimizer's name, for the message.
        betas: a pair of numbers in ``[0, 1)`` (None: not an argument of ``owner``).
        **values: numbers that must be finite and ``>= 0`` (``lr``, ``eps``,
            ``weight_decay``, ``momentum``, ...); None or ``required`` are skipped.

    Example::

        >>> check_hyperparams("FusedAdam", lr=1e-3, eps=1e-8, betas=(0.9, 0.999))
    """
    for name, value in values.items():
        if value is None or value is required:
            continue
        what = "the learning rate" if name == "lr" else f"the {name} value"
        fix = f"pass {what} as {name}= a finite number >= 0 (as torch.optim requires)"
        positive_finite(value, name, owner=owner, fix=fix, allow_zero=True)
    if betas is None:
        return
    pair = isinstance(betas, (tuple, list)) and len(betas) == 2
    nums = [number(b) for b in betas] if pair else []
    if not pair or any(b is None or not 0.0 <= b < 1.0 for b in nums):
        raise ValueError(
            f"{owner}: Invalid betas: {betas!r} (must be a pair (beta1, beta2) of numbers in "
            "[0, 1), e.g. betas=(0.9, 0.999))."
        )


_PACKAGES = tuple(
    os.path.dirname(m.__file__) + os.sep for m in (torch, sys.modules["mpnb"]) if m.__file__
)


def _user_stacklevel() -> int:
    """The ``stacklevel`` of the first caller outside torch and mpnb (the user's line, so the
    default warning filter shows a warning once per line of theirs, and names that line)."""
    level, f = 1, sys._getframe(1)
    while f is not None and f.f_code.co_filename.startswith(_PACKAGES):
        level, f = level + 1, f.f_back
    return level


def group_tensors(params: list) -> list:
    """The tensors of a group's ``params`` list (torch also takes ``(name, tensor)`` pairs)."""
    return [p[1] if isinstance(p, tuple) and len(p) == 2 else p for p in params]


def check_param_group(optimizer: torch.optim.Optimizer, param_group: dict) -> None:
    """Check one group before ``optimizer.add_param_group`` adds it (the constructor's groups
    pass here too): refuse what would train wrongly, warn where torch stays silent.

    * its numbers (``lr``, ``eps``, ``weight_decay``, ``betas``...) as
      :func:`check_hyperparams` checks the constructor's;
    * a parameter already in another group: ``ValueError`` naming both groups (torch's own
      message names neither, nor the fix);
    * a parameter listed twice in this group: a :class:`DuplicateParameterWarning` (it would
      be updated twice per step, as torch and Apex do);
    * ``eps`` of 0 in an optimizer that divides by ``sqrt(v) + eps``: a
      :class:`ZeroEpsWarning` (a zero gradient makes its update ``0 / 0 = NaN``).

    ``param_group["params"]`` is made a list first (as torch does), so a generator is read once.
    """
    owner = type(optimizer).__name__
    params = param_group.get("params")
    if params is not None and not isinstance(params, (torch.Tensor, set)):
        param_group["params"] = params = list(params)
    if not isinstance(params, list):  # a Tensor, a set, none: torch's own checks answer
        return
    given = {k: param_group[k] for k in _GROUP_NUMBERS if k in param_group}
    check_hyperparams(owner, betas=param_group.get("betas"), **given)
    ids = {id(p): i for i, g in enumerate(optimizer.param_groups) for p in g["params"]}
    new = len(optimizer.param_groups)
    params = group_tensors(params)
    for j, p in enumerate(params):
        if id(p) in ids:
            raise ValueError(
                f"{owner}: param group {new} holds parameter {j}, which is already in param "
                f"group {ids[id(p)]}; a parameter can belong to one group only (torch.optim's "
                "rule). Leave it out of one of them (e.g. build the groups from disjoint "
                "lists of model.named_parameters())."
            )
    seen: dict[int, int] = {}
    for j, p in enumerate(params):
        first = seen.setdefault(id(p), j)
        if first == j:
            continue
        warnings.warn(
            f"{owner}: param group {new} lists a parameter twice (positions {first} and "
            f"{j}): each step will update it twice, with twice the learning rate and its "
            "state advanced two steps (torch and Apex do the same). List each parameter once: "
            "model.parameters() does; dedupe a hand-built list with list(dict.fromkeys(params)).",
            DuplicateParameterWarning,
            stacklevel=_user_stacklevel(),
        )
        break
    eps = number(param_group.get("eps", optimizer.defaults.get("eps")))
    if eps == 0:
        warnings.warn(
            f"{owner}: eps=0 makes the update of a parameter whose gradient is zero (an unused "
            "layer, a padding row, a frozen branch) 0 / 0 = NaN, which then spreads through "
            "the model. Pass eps= a small positive number (the default, or e.g. 1e-12).",
            ZeroEpsWarning,
            stacklevel=_user_stacklevel(),
        )


# Saved group entries that must be finite and >= 0 (those the constructors check), and state
# entries that must be >= 0 (second moments, Adagrad's sum of squares).
_GROUP_NUMBERS = ("lr", "eps", "weight_decay", "momentum", "dampening")
_NON_NEGATIVE_STATE = ("exp_avg_sq", "sum")


def _corrupt(name: str, what: str) -> ValueError:
    return ValueError(
        f"{name}.load_state_dict: {what}; the checkpoint is corrupt (a training step that went "
        "non-finite, or an edited file). Load an earlier checkpoint. Nothing was loaded."
    )


def _check_group(name: str, i: int, group) -> None:
    for k in _GROUP_NUMBERS:
        if not is_positive_finite(group.get(k, 0.0), allow_zero=True):
            raise _corrupt(
                name, f"param_groups[{i}][{k!r}]={group[k]!r} is not a finite number >= 0"
            )
    betas = group.get("betas")
    if betas is not None:
        nums = [number(b) for b in betas] if isinstance(betas, (tuple, list)) else []
        if len(nums) != 2 or any(b is None or not 0.0 <= b < 1.0 for b in nums):
            raise _corrupt(name, f"param_groups[{i}]['betas']={betas!r} is not a pair in [0, 1)")
    if "max_grad_norm" in group:
        v = number(group["max_grad_norm"])
        if v is None or not math.isfinite(v):
            raise _corrupt(
                name, f"param_groups[{i}]['max_grad_norm']={group['max_grad_norm']!r} is not finite"
            )


def _check_entry(name: str, pid, k: str, v) -> None:
    """One saved state entry: a step count >= 0, finite tensors, second moments >= 0."""
    where = f"state[{pid}][{k!r}]"
    if k == "step":
        n = number(v)
        if n is None:
            raise ValueError(
                f"{name}.load_state_dict: {where}={v!r} is not a number; nothing was loaded."
            )
        if not math.isfinite(n) or n < 0 or n != int(n):
            raise _corrupt(name, f"{where}={n!r} is not a step count (an integer >= 0)")
        return
    if not isinstance(v, torch.Tensor) or not v.is_floating_point():
        return
    t = v.detach()
    if not torch.isfinite(t).all():
        raise _corrupt(name, f"{where} holds {int((~torch.isfinite(t)).sum())} inf/NaN values")
    if k in _NON_NEGATIVE_STATE and (t < 0).any():
        raise _corrupt(
            name,
            f"{where} holds {int((t < 0).sum())} negative values (a sum of squares is >= 0; "
            f"the smallest is {t.min().item()!r})",
        )


def check_loadable(optimizer, state_dict) -> None:
    """Everything ``optimizer.load_state_dict(state_dict)`` needs, checked before anything
    changes: the dict's shape, group sizes and hyper-parameters (finite ``lr``, ``eps``,
    ... >= 0, ``betas`` in [0, 1)), each state tensor's size and values (finite, second
    moments >= 0), step counts (integers >= 0). Each error names the entry."""
    name = type(optimizer).__name__
    groups = state_dict.get("param_groups") if isinstance(state_dict, Mapping) else None
    saved = state_dict.get("state") if isinstance(state_dict, Mapping) else None
    if not isinstance(groups, list) or not isinstance(saved, Mapping):
        raise ValueError(
            f"{name}.load_state_dict: expected a dict with 'state' and 'param_groups' (an "
            "optimizer.state_dict()); nothing was loaded."
        )
    sizes = [len(g.get("params", ())) if isinstance(g, Mapping) else -1 for g in groups]
    for i, g in enumerate(groups):
        if isinstance(g, Mapping):
            _check_group(name, i, g)
    if sizes != [len(g["params"]) for g in optimizer.param_groups]:
        raise ValueError(
            f"{name}.load_state_dict: the checkpoint's param groups hold {sizes} params but "
            f"this optimizer's hold {[len(g['params']) for g in optimizer.param_groups]}; load a "
            "checkpoint of the same model and param groups. Nothing was loaded."
        )
    ids = itertools.chain.from_iterable(g["params"] for g in groups)
    params = dict(
        zip(
            ids,
            itertools.chain.from_iterable(g["params"] for g in optimizer.param_groups),
            strict=True,
        )
    )
    for pid, entries in saved.items():
        p = params.get(pid)
        if p is None:
            continue
        if not isinstance(entries, Mapping):
            raise ValueError(
                f"{name}.load_state_dict: the state of param {pid} is a "
                f"{type(entries).__name__}, not a dict; nothing was loaded."
            )
        for k, v in entries.items():
            if isinstance(v, torch.Tensor) and v.dim() != 0 and v.numel() != p.numel():
                raise ValueError(
                    f"{name}.load_state_dict: state[{pid}][{k!r}] has {v.numel()} "
                    f"elements but param {pid} has {p.numel()}; load a checkpoint of "
                    "the same model. Nothing was loaded."
                )
            _check_entry(name, pid, k, v)
