"""A plain model's state dict from a replicated or sharded one, and back, through PyTorch's
own :mod:`torch.distributed.checkpoint.state_dict`.

FSDP2's ``model.state_dict()`` holds each parameter as this rank's ``DTensor`` shard, and a
DDP's keys start with ``module.``; a plain model loads neither (PyTorch says "mixed
torch.Tensor and DTensor", or names missing keys). :func:`full_state_dict` gathers the full
tensors under the plain model's keys; :func:`load_full_state_dict` loads such a state dict into
a plain, replicated or sharded model, and refuses DTensor shards naming the fix.

Example::

    >>> sd = full_state_dict(fsdp_model)          # every rank calls it: an all-gather
    >>> load_full_state_dict(plain_model, sd)     # or into a sharded one: each rank its shard
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from mpnb.core.parallel.distributed import DistributedDataParallel as MpnbDDP
from mpnb.core.parallel.distributed import wrapped_by

__all__ = ["full_state_dict", "load_full_state_dict"]


def full_state_dict(model: torch.nn.Module, *, cpu_offload: bool = False) -> dict:
    """``model``'s state dict as the plain model holds it: FSDP2's DTensor shards gathered into
    full tensors, a DDP's ``module.`` prefix gone (``get_model_state_dict`` with
    ``StateDictOptions(full_state_dict=True)``). A plain model's comes back as it is.

    .. warning:: under FSDP2 every rank must call it (each shard is all-gathered).

    Args:
        model: a plain model, or one wrapped by DDP or sharded by ``fully_shard``.
        cpu_offload: True: the tensors are copied to the CPU and rank 0 alone receives them
            (the other ranks get ``{}``), so that no rank holds the full model on its device.

    Example::

        >>> sd = full_state_dict(model, cpu_offload=True)  # on every rank, not rank 0 alone
        >>> if dist.get_rank() == 0:
        ...     torch.save(sd, "model.pt")
    """
    # torch.distributed.checkpoint takes seconds to import: loaded when first asked
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=cpu_offload)
    return get_model_state_dict(_unwrapped(model), options=options)


def load_full_state_dict(model: torch.nn.Module, state_dict: Mapping, *, strict: bool = True):
    """Load a full (plain-tensor) state dict into ``model``: a plain model, one wrapped by DDP
    (keys without ``module.``), or one sharded by FSDP2 (each rank keeps its shard of the
    full tensors; every rank must call it). Returns ``(missing_keys, unexpected_keys)``.

    Raises:
        TypeError: ``state_dict`` holds DTensor shards (an FSDP2 model's ``state_dict()``)
            and ``model`` is not sharded: gather them with :func:`full_state_dict` first.
    """
    # torch.distributed.checkpoint takes seconds to import: loaded when first asked
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.tensor import DTensor

    shards = [k for k, v in state_dict.items() if isinstance(v, DTensor)]
    if shards and not wrapped_by(model).startswith(("FSDP2", "DTensor")):
        raise TypeError(
            f"load_full_state_dict: {len(shards)} entries of the state dict are DTensor shards "
            f"({shards[0]!r}, ...: an FSDP2 model's state_dict()), and the model's parameters "
            "are plain tensors. Gather them on every rank first: sd = "
            "mpnb.parallel.full_state_dict(fsdp_model) (cpu_offload=True: on rank 0 alone), "
            "then load that."
        )
    options = StateDictOptions(full_state_dict=True, strict=strict)
    return set_model_state_dict(_unwrapped(model), dict(state_dict), options=options)


def _unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """mpnb's DDP holds the model as ``.module`` (PyTorch's own DDP is unwrapped by
    ``torch.distributed.checkpoint``, which knows it)."""
    return model.module if isinstance(model, MpnbDDP) else model
