"""Apex's ``Reducer``: all-reduce a module's (or a list's) gradients when you call it."""

from __future__ import annotations

import torch

from mpnb.core.parallel._buckets import FlatReduce, plan_buckets
from mpnb.core.parallel._common import (
    broadcast_state,
    check_same_model,
    require_dist,
    unique_params,
)

__all__ = ["Reducer"]


class Reducer:
    """Manual all-reduce of a module's (or a list's) gradients: call :meth:`reduce` yourself.

    Module parameters are broadcast from rank 0 at construction. :meth:`reduce` averages the
    gradients over ranks, one flat all-reduce per dtype; module parameters without a gradient
    get a zero one (every rank must reduce the same tensors).

    Args:
        module_or_grads_list: an ``nn.Module``, or a list of gradient tensors to reduce.

    Example::

        >>> reducer = Reducer(model)
        >>> model(x).sum().backward()
        >>> reducer.reduce()
    """

    def __init__(self, module_or_grads_list) -> None:
        require_dist("Reducer")
        self.module = None
        if isinstance(module_or_grads_list, torch.nn.Module):
            self.module = module_or_grads_list
            state = list(self.module.parameters()) + list(self.module.buffers())
            check_same_model(state, None, "Reducer")
            broadcast_state(state, None)
        else:
            self.grads = list(module_or_grads_list)

    def reduce(self) -> None:
        """All-reduce and average the gradients (blocking)."""
        if self.module is not None:
            params = unique_params(self.module)
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            grads = [p.grad for p in params]
        else:
            grads = self.grads
        plan = plan_buckets(grads, range(len(grads)), float("inf"))
        for idx in plan.buckets:
            g = [grads[i] for i in idx]
            r = FlatReduce([t.numel() for t in g], g[0].dtype, g[0].device, False, 1.0, True, None)
            r.launch(g)
            r.finish()
