"""Helpers shared by the data-parallel classes: group checks, model checks, broadcasts."""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["require_dist", "unique_params", "check_same_model", "broadcast_state"]


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
