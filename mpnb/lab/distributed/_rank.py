"""What every rank runs: the policies round-robin on this rank's shard of each global batch.

Step ``k`` of every policy runs before step ``k + 1`` of any, in an order rotated each round,
as the single-process lab does (a shared machine's drift slows all policies alike). The first
steps (``MEASURE_STEPS``) are measured, not timed: memory by role (:class:`RoleMeter`) and the
collectives' bytes and time in flight (:class:`CollectiveCounter`, a dispatch mode whose
Python hook on every op would slow the step it watches). The later steps are timed.

Each record (one policy's step) is appended to this rank's JSON-lines file as soon as it is
made, so a comparison that a failing or hung rank ends keeps every step measured before.
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist
import torch.utils.benchmark as benchmark

from mpnb.lab.distributed._comm import CollectiveCounter
from mpnb.lab.distributed._memory import RoleMeter

__all__ = ["MEASURE_STEPS", "run_rank", "shard", "progress_path", "records_path"]

#: the first steps of each policy: measured (memory, bytes), not timed
MEASURE_STEPS = 2


def shard(x, rank: int, world: int):
    """Rank ``rank``'s contiguous 1/``world`` of a batch (a tensor, or a tuple/list/dict of
    them; non-tensors pass through). The global batch must split evenly (checked before)."""
    if isinstance(x, torch.Tensor):
        n = x.shape[0] // world
        return x[rank * n : (rank + 1) * n]
    if isinstance(x, (tuple, list)):
        return type(x)(shard(v, rank, world) for v in x)
    if isinstance(x, dict):
        return type(x)({k: shard(v, rank, world) for k, v in x.items()})
    return x


def progress_path(folder: str, rank: int) -> str:
    """The file where ``rank`` writes the policy and step it is in."""
    return os.path.join(folder, f"rank{rank}.now")


def records_path(folder: str, rank: int) -> str:
    """The JSON-lines file of ``rank``'s records."""
    return os.path.join(folder, f"rank{rank}.jsonl")


class _Policy:
    """One policy's model, optimizer and meter on this rank."""

    def __init__(self, cfg, w, job, device) -> None:
        # in the rank process only: the launcher skips the configurations (+160 ms)
        from mpnb.core.precision_configs import make_optimizer

        self.cfg = cfg
        torch.manual_seed(job["seed"])
        model = w.model_fn().to(device)
        lr = job["lr"] or w.lr

        def make(params):
            return make_optimizer(job["optimizer"], params, lr)

        self.model, self.opt = cfg.wrap(model, make)
        self.meter = RoleMeter(self.model, self.opt, cfg.sharded())
        self.comm: list[float] = []


def _step(p: _Policy, w, x, y, measure: bool, world: int) -> dict:
    # in the rank process only: the launcher skips the trainer (+400 ms)
    from mpnb.lab._train import forward

    p.opt.zero_grad(set_to_none=True)
    counter = CollectiveCounter(world) if measure else None
    t0 = benchmark.timer()  # as the single-process lab: it synchronizes CUDA
    if measure:
        with counter:
            with p.meter.forward():
                out = forward(p.model, x)
            loss = w.loss_fn(out, y)
            p.cfg.backward(loss, p.opt)
            p.meter.after_backward()
            p.opt.step()
            p.meter.after_step()
    else:
        loss = w.loss_fn(forward(p.model, x), y)
        p.cfg.backward(loss, p.opt)
        p.opt.step()
    rec = dict(ms=(benchmark.timer() - t0) * 1e3, loss=float(loss.detach().float()))
    if measure:
        rec.update(by_op=dict(counter.by_op), comm_s=counter.comm_seconds(), **p.meter.mib())
    return rec


def _metric(p: _Policy, w, device) -> float:
    """The workload's metric on the first eval batch (every rank the same batch)."""
    # in the rank process only: the launcher skips the trainer (+400 ms)
    from mpnb.lab._train import forward, to_device

    if w.metric_fn is None:
        return float("nan")
    x, y = w.fixed_batch(64)
    p.model.eval()
    with torch.no_grad():
        out = forward(p.model, to_device(x, device))
    p.model.train()
    return float(w.metric_fn(out, to_device(y, device)))


def run_rank(w, configs: list, job: dict, folder: str | None) -> list[dict]:
    """Train every policy of ``configs`` (distributed configuration objects) on this rank
    (the process group is up); return the records of every rank (gathered, so that one rank
    holds them all under torchrun) or of this rank alone when ``folder`` holds the files."""
    # in the rank process only: the launcher skips the trainer (+400 ms)
    from mpnb.lab._train import to_device

    rank, world = dist.get_rank(), dist.get_world_size()
    device = job["device"]
    if device == "cuda":  # one GPU per local rank (torchrun's LOCAL_RANK, or launch's)
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
        device = f"cuda:{torch.cuda.current_device()}"
    if job.get("threads"):
        torch.set_num_threads(job["threads"])
    records: list[dict] = []
    out = open(records_path(folder, rank), "a") if folder else None  # noqa: SIM115

    def note(policy: str, step: int) -> None:
        if folder:
            with open(progress_path(folder, rank), "w") as f:
                f.write(f"{policy}\t{step}")

    def fail(policy: str, step: int, e: BaseException):
        return RuntimeError(
            f"policy {policy!r}, {f'step {step + 1}' if step >= 0 else 'setting up'}, rank "
            f"{rank}: {type(e).__name__}: {e}"
        )

    policies = []
    for cfg in configs:
        note(cfg.name, -1)
        try:
            policies.append(_Policy(cfg, w, job, device))
        except Exception as e:
            raise fail(cfg.name, -1, e) from e
    batches = w.batches(job["global_batch"], job["seed"])
    try:
        for i in range(job["steps"]):
            x, y = next(batches)
            x, y = (
                to_device(shard(x, rank, world), device),
                to_device(shard(y, rank, world), device),
            )
            k = i % len(policies)
            for p in policies[k:] + policies[:k]:
                name = p.cfg.name
                note(name, i)
                try:
                    rec = _step(p, w, x, y, i < MEASURE_STEPS, world)
                    if i == job["steps"] - 1:
                        rec["metric"] = _metric(p, w, device)
                except Exception as e:
                    raise fail(name, i, e) from e
                rec.update(policy=name, step=i, rank=rank, timed=i >= MEASURE_STEPS)
                records.append(rec)
                if out:
                    out.write(json.dumps(rec) + "\n")
                    out.flush()
        note("", job["steps"])
    finally:
        if out:
            out.close()
        for p in policies:
            p.meter.close()
    if folder:
        return records
    gathered: list = [None] * world
    dist.all_gather_object(gathered, records)
    return [r for part in gathered for r in part]
