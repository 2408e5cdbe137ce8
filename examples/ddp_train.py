"""Train a tiny model with mpnb.parallel on 2 ranks; the same script runs two ways.

    python examples/ddp_train.py                        # mpnb.parallel.launch starts 2 ranks
    torchrun --nproc_per_node=2 examples/ddp_train.py   # torchrun starts them; launch joins

On CPU the ranks talk over gloo on 127.0.0.1; with GPUs, NCCL. The model has a batch norm
(converted to SyncBatchNorm), is wrapped in DistributedDataParallel and trained under
mpnb.amp O1 (bf16 on CPU) with FusedAdam; at the end every rank checks that its parameters
equal rank 0's.
"""

from __future__ import annotations

import argparse
import warnings

import torch
import torch.distributed as dist

from mpnb import amp
from mpnb.optimizers import FusedAdam
from mpnb.parallel import DistributedDataParallel, convert_syncbn_model, launch


def train(steps: int) -> dict:
    """One rank's training loop; returns its last loss and whether it matches rank 0."""
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = (
        torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend() == "nccl"
        else torch.device("cpu")
    )
    torch.manual_seed(0)  # the same initial model everywhere (DDP also broadcasts rank 0's)
    net = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32), torch.nn.ReLU(), torch.nn.Linear(32, 4)
    )
    net = convert_syncbn_model(net).to(dev)
    opt = FusedAdam(net.parameters(), lr=1e-2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        net, opt = amp.initialize(net, opt, opt_level="O1", verbosity=0)
    model = DistributedDataParallel(net, message_size=256)
    g = torch.Generator().manual_seed(1000 + rank)  # each rank its own data
    for _ in range(steps):
        x, y = torch.randn(8, 16, generator=g).to(dev), torch.randint(0, 4, (8,), generator=g)
        loss = torch.nn.functional.cross_entropy(model(x).float(), y.to(dev))
        opt.zero_grad()
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
    flat = torch.cat([p.detach().float().flatten() for p in model.parameters()])
    ref = flat.clone()
    dist.broadcast(ref, src=0)
    same = bool(torch.equal(flat, ref))
    if rank == 0 or not same:
        print(
            f"rank {rank}/{world}: loss {loss.item():.4f}, params identical across ranks: {same}",
            flush=True,
        )
    return {"rank": rank, "loss": loss.item(), "identical": same}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--nprocs", type=int, default=2, help="ranks when not under torchrun")
    args = p.parse_args()
    results = launch(train, args.nprocs, args=(args.steps,), timeout=300)
    if not all(r["identical"] for r in results):
        raise SystemExit("the ranks' parameters differ")


if __name__ == "__main__":
    main()
