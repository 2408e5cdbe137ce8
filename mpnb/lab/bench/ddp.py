"""ddp: training steps/s of mpnb DistributedDataParallel vs PyTorch's, 2 gloo ranks on 127.0.0.1.

How a multi-process case is timed with the one-process harness: the suite starts two rank
processes once (spawn, gloo on 127.0.0.1, one torch thread each) that build the same model
three times (PyTorch DDP, mpnb DDP overlapping, mpnb DDP with ``delay_allreduce=True``) and
then wait on a pipe. A candidate is a zero-argument callable in this process that sends "one
step of variant V" to both ranks and returns when both have answered; the collectives keep
the ranks in lockstep, so the harness times one synchronous training step of the pair
(forward, backward with the all-reduces, SGD step) plus one pipe round trip, the same for
every candidate. Candidates run round-robin as in every suite; ``ratio`` above 1 means
faster than PyTorch DDP (target >= 0.9).

The share of communication overlapped is measured before the timed rounds, on the same
ranks: per step, the time backward spends in mpnb's end-of-backward callback (waiting for
and copying back the all-reduces that were not hidden) with overlap, against the same with
``delay_allreduce=True`` (where none is hidden): ``hidden = 1 - exposed(overlap) /
exposed(delay)``. It is shown in the candidate's name as ``N% comm hidden: exposed/exposed
when delayed, ms`` (host clock, the slower rank; measured under the same contention as the
rounds, so noisy).
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
from collections.abc import Iterator

import torch

from mpnb.lab.bench._harness import Candidate, Case, Options

__all__ = ["cases"]

_REPLY_S = 120.0  # a rank that does not answer a step within this is treated as dead


def _model(width: int, depth: int) -> torch.nn.Module:
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def _rank_main(rank: int, port: int, width: int, depth: int, batch: int, conn) -> None:
    import torch.distributed as dist

    from mpnb.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=_REPLY_S),
    )
    bucket = 2**18  # elements (1 MiB of fp32) per bucket for both implementations
    variants = {
        "torch": torch.nn.parallel.DistributedDataParallel(
            _model(width, depth), bucket_cap_mb=bucket * 4 / 2**20
        ),
        "mpnb": DistributedDataParallel(_model(width, depth), message_size=bucket),
        "mpnb_delay": DistributedDataParallel(_model(width, depth), delay_allreduce=True),
    }
    opts = {k: torch.optim.SGD(m.parameters(), lr=1e-9) for k, m in variants.items()}
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(batch, width, generator=g), torch.randn(batch, width, generator=g)
    try:
        while True:
            cmd = conn.recv()
            if cmd[0] == "stop":
                break
            if cmd[0] == "stats":
                m = variants[cmd[1]]
                conn.send((m.stats.exposed_s, m.stats.backwards, m.stats.early_buckets))
                m.stats.reset()
                continue
            m, opt = variants[cmd[1]], opts[cmd[1]]
            opt.zero_grad()
            (m(x) - y).pow(2).mean().backward()
            opt.step()
            conn.send(None)
    finally:
        dist.destroy_process_group()


class _Ranks:
    """Two rank processes driven over pipes; every call waits for both (with a deadline)."""

    def __init__(self, width: int, depth: int, batch: int) -> None:
        from mpnb.parallel import free_port

        ctx = mp.get_context("spawn")
        port = free_port()
        self.conns, self.procs = [], []
        for rank in range(2):
            mine, theirs = ctx.Pipe()
            p = ctx.Process(
                target=_rank_main,
                args=(rank, port, width, depth, batch, theirs),
                daemon=True,
                name=f"mpnb-bench-ddp-rank{rank}",
            )
            p.start()
            self.conns.append(mine)
            self.procs.append(p)

    def call(self, *cmd) -> list:
        for c in self.conns:
            c.send(cmd)
        out = []
        for rank, c in enumerate(self.conns):
            if not c.poll(_REPLY_S):
                self.close()
                raise RuntimeError(
                    f"bench ddp: rank {rank} did not answer {cmd[0]!r} within {_REPLY_S:.0f} s "
                    "(it died or hangs); the ranks were stopped. Re-run with --quick to check."
                )
            out.append(c.recv())
        return out

    def close(self) -> None:
        for c in self.conns:
            try:
                c.send(("stop",))
            except (BrokenPipeError, OSError):
                pass
        for p in self.procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(1)


def _exposed_ms(ranks: _Ranks, variant: str, steps: int) -> tuple[float, int]:
    ranks.call("stats", variant)  # reset
    for _ in range(steps):
        ranks.call("step", variant)
    got = ranks.call("stats", variant)
    exposed = max(e / max(n, 1) for e, n, _ in got)  # the slower rank sets the step
    return 1e3 * exposed, min(b for _, _, b in got)


def cases(opts: Options) -> Iterator[Case]:
    """One case per model size: PyTorch DDP, mpnb DDP, mpnb DDP delay_allreduce."""
    sizes = [(256, 4, 32)] if opts.quick else [(512, 6, 64), (1024, 4, 32)]
    for width, depth, batch in sizes:
        width = max(8, int(width * opts.scale))
        params = depth * (width * width + width)
        ranks = _Ranks(width, depth, batch)
        try:
            for v in ("torch", "mpnb", "mpnb_delay"):  # warm up, first-iteration bucketing
                for _ in range(3):
                    ranks.call("step", v)
            steps = 5 if opts.quick else 20
            delay_ms, _ = _exposed_ms(ranks, "mpnb_delay", steps)
            over_ms, early = _exposed_ms(ranks, "mpnb", steps)
            hidden = 1.0 - over_ms / delay_ms if delay_ms > 0 else 0.0
            workload = f"MLP {depth}x{width} ({params / 1e6:.2f}M params) b{batch}, 2 gloo ranks"
            yield Case(
                "DDP train step",
                workload,
                [
                    Candidate("torch DDP (1 MiB buckets)", lambda r=ranks: r.call("step", "torch")),
                    Candidate(
                        f"mpnb DDP (1 MiB; {hidden:.0%} comm hidden: {over_ms:.1f}/"
                        f"{delay_ms:.1f} ms)",
                        lambda r=ranks: r.call("step", "mpnb"),
                        target=0.9,
                    ),
                    Candidate(
                        "mpnb DDP delay_allreduce=True",
                        lambda r=ranks: r.call("step", "mpnb_delay"),
                    ),
                ],
            )
        finally:
            ranks.close()
