"""A skipped step (inf/NaN grads): the optimizer's ``step()`` runs but changes nothing.

``drop_grads`` serves ``torch.optim`` optimizers (they skip params whose grad is None);
``snapshot`` copies params, state and group settings of any other optimizer and restores them.
Each returns ``(restore, saved)``; the step post-hook calls ``restore(saved)``.
"""

from __future__ import annotations

import copy

import torch

__all__ = ["drop_grads", "is_torch_optim", "snapshot"]


def is_torch_optim(optimizer) -> bool:
    """True for ``torch.optim``'s own optimizers (they skip params whose grad is None)."""
    return type(optimizer).__module__.startswith("torch.optim")


def drop_grads(optimizer):
    """Skip a ``torch.optim`` step by hiding every grad; returns ``(restore, saved)``."""
    # torch.optim optimizers skip params whose grad is None: no update, no state, no step count.
    saved = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            saved.append((p, p.grad))
            p.grad = None

    def restore(items):
        for p, g in items:
            p.grad = g

    return restore, saved


def snapshot(optimizer):
    """Skip any optimizer's step by copying and restoring it; returns ``(restore, saved)``."""
    # Any other optimizer: copy params, state and group settings, and put them back afterwards.
    params = [p for g in optimizer.param_groups for p in g["params"]]
    saved = (
        [p.detach().clone() for p in params],
        {p: copy.deepcopy(optimizer.state[p]) for p in params if p in optimizer.state},
        [
            {k: copy.deepcopy(v) for k, v in g.items() if k != "params"}
            for g in optimizer.param_groups
        ],
    )

    def restore(items):
        values, state, groups = items
        with torch.no_grad():
            for p, v in zip(params, values, strict=False):
                p.copy_(v)
        for p in params:
            optimizer.state.pop(p, None)
            if p in state:
                optimizer.state[p] = state[p]
        for g, s in zip(optimizer.param_groups, groups, strict=False):
            g.update(s)

    return restore, saved
