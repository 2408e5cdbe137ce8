"""``convert_syncbn_model``: a copy of a model with every batch norm made a SyncBatchNorm."""

from __future__ import annotations

import copy

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from mpnb.core.parallel.sync_batchnorm import SyncBatchNorm

__all__ = ["convert_syncbn_model"]


def _convert(bn: _BatchNorm, process_group, channel_last: bool) -> SyncBatchNorm:
    new = SyncBatchNorm(
        bn.num_features,
        bn.eps,
        bn.momentum,
        bn.affine,
        bn.track_running_stats,
        process_group=process_group,
        channel_last=channel_last,
    )
    if bn.affine:  # the copy's own Parameters: optimizer-visible identity of the copy
        new.weight, new.bias = bn.weight, bn.bias
    if bn.track_running_stats:
        new.running_mean, new.running_var = bn.running_mean, bn.running_var
        new.num_batches_tracked = bn.num_batches_tracked
    new.train(bn.training)
    return new


def _walk(module: torch.nn.Module, process_group, channel_last: bool) -> torch.nn.Module:
    if isinstance(module, _BatchNorm) and not isinstance(module, SyncBatchNorm):
        return _convert(module, process_group, channel_last)
    for name, child in module.named_children():
        new = _walk(child, process_group, channel_last)
        if new is not child:
            setattr(module, name, new)
    return module


def convert_syncbn_model(
    module: torch.nn.Module, process_group=None, channel_last: bool = False
) -> torch.nn.Module:
    """Return a deep copy of ``module`` whose ``BatchNorm1d/2d/3d`` (and
    ``torch.nn.SyncBatchNorm``) layers are :class:`SyncBatchNorm`, weights and buffers kept.

    The original model is not changed. Convert before wrapping in DistributedDataParallel
    and before building the optimizer (the copy has new Parameter objects).

    Args:
        module: the model.
        process_group: the group the new layers synchronize over (default: the world).
        channel_last: the new layers read ``(N, ..., C)`` inputs.

    Example::

        >>> net = convert_syncbn_model(torchvision.models.resnet18())
    """
    return _walk(copy.deepcopy(module), process_group, channel_last)
