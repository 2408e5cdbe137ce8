"""Helpers shared by the data-parallel classes: group checks, model checks, broadcasts, and
the finiteness of reduced gradients."""

from __future__ import annotations

import torch
import torch.distributed as dist

from mpnb.core.ops import multi_tensor_check_finite

__all__ = [
    "require_dist",
    "unique_params",
    "check_same_model",
    "broadcast_state",
    "GradOverflowError",
    "count_nonfinite_grads",
]


class GradOverflowError(RuntimeError):
    """Gradients came back inf/NaN from a reduction (an fp16 wire overflows past 65504); the
    step was not taken, so weights and optimizer state are as they were."""


def require_dist(who: str) -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"{who}: torch.distributed is not initialized. Call "
            "torch.distributed.init_process_group(...) first (or start the ranks with "
            "mpnb.parallel.launch(fn, nprocs) or torchrun, which do it for you)."
        )


def unique_params(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    seen, out = set(), []
    for p in module.parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def check_same_model(tensors: list[torch.Tensor], group, who: str) -> None:
    # Every rank must hold the same parameters, or the broadcasts/all-reduces would pair up
    # wrong tensors (or hang): compare counts and element totals first, with one all_gather.
    mine = torch.tensor([len(tensors), sum(t.numel() for t in tensors)], dtype=torch.int64)
    if dist.get_backend(group) == "nccl":
        mine = mine.cuda()
    got = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(got, mine, group=group)
    shapes = {tuple(g.tolist()) for g in got}
    if len(shapes) != 1:
        raise RuntimeError(
            f"{who}: the ranks hold different models ((tensors, elements) per rank: "
            f"{[tuple(g.tolist()) for g in got]}); build the same model on every rank."
        )


def broadcast_state(tensors: list[torch.Tensor], group, src: int = 0) -> None:
    """Broadcast ``tensors`` in place from the rank ``src`` of ``group``."""
    src = dist.get_global_rank(group, src) if group is not None else src
    with torch.no_grad():
        for t in tensors:
            dist.broadcast(t.data, src=src, group=group)


def count_nonfinite_grads(params, across_ranks: bool) -> int:
    """How many elements of the ``.grad`` of ``params`` are inf or NaN (0 when none is).

    One read-only multi-tensor pass per grad dtype (mpnb's ``multi_tensor_check_finite`` op)
    sets a device flag; FSDP2's grads are DTensors, checked on their local shard.

    .. warning:: one host read per call (the flag), as a ``torch.optim`` step skipped on
       overflow needs. Elements are counted only when the flag is set.

    Args:
        params: the parameters whose grads to check (those without a grad are left out).
        across_ranks: True when the ranks hold different grads (FSDP2's shards): the flag and
            the count are summed over the default process group, so that every rank decides
            alike. False (DDP: every rank holds the same all-reduced grads): no collective.
    """
    grads = [_local(p.grad) for p in params if p.grad is not None]
    if not grads:
        return 0
    flag = torch.zeros(1, dtype=torch.float32, device=grads[0].device)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g.contiguous())
    for same in by_dtype.values():
        multi_tensor_check_finite(flag, same)
    if across_ranks:
        dist.all_reduce(flag)
    if not bool(flag.item()):  # the one host read
        return 0
    bad = torch.stack([(~torch.isfinite(g)).sum() for g in grads]).sum().reshape(1)
    if across_ranks:
        dist.all_reduce(bad)
    return int(bad.item())


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2's sharded grads); any other tensor as it is."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t
