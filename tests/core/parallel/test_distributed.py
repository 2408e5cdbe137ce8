"""DistributedDataParallel and Reducer on 2 gloo ranks: gradients vs one process and torch DDP.

Every scenario runs inside ONE launch (spawning ranks costs seconds on a shared 2-core
machine); each rank returns a dict of measured errors and the tests assert on them.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mpnb.parallel import DistributedDataParallel as DDP
from mpnb.parallel import Reducer, launch

pytestmark = pytest.mark.dist

B = 6  # rows per rank


def _mlp(dtype=torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Tanh(), torch.nn.Linear(10, 3))
    return m.to(dtype)


class _TwoHeads(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Linear(6, 8)
        self.a = torch.nn.Linear(8, 3)
        self.b = torch.nn.Linear(8, 3)
        self.never = torch.nn.Linear(8, 3)

    def forward(self, x, use_a=True, use_b=True):
        h = torch.tanh(self.body(x))
        out = self.a(h) if use_a else 0
        return out + self.b(h) if use_b else out


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(2 * B, 6, generator=g), torch.randn(2 * B, 3, generator=g)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def _max_rel(model, ref_grads) -> float:
    return max(_rel(p.grad, g) for p, g in zip(model.parameters(), ref_grads, strict=True))


def _loss(m, x, y, **kw):
    return (m(x, **kw) - y).pow(2).mean()


def _step(m, x, y, **kw):
    m.zero_grad(set_to_none=True)
    _loss(m, x, y, **kw).backward()


def _gathered_mean(local: list[torch.Tensor]) -> list[torch.Tensor]:
    """The expected reduction: mean over ranks of each rank's local gradient (fp32 sums)."""
    out = []
    for g in local:
        parts = [torch.empty_like(g) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, g.contiguous())
        out.append(sum(p.float() for p in parts) / len(parts))
    return out


def _ddp_checks() -> dict[str, float]:
    r = dist.get_rank()
    x, y = _data()
    xs, ys = x[r * B : (r + 1) * B], y[r * B : (r + 1) * B]
    ref = _mlp()
    _step(ref, x, y)
    ref_g = [p.grad.clone() for p in ref.parameters()]
    out: dict[str, float] = {}
    variants = {
        "overlap": {"message_size": 30},
        "one_bucket": {},
        "delay": {"delay_allreduce": True},
        "streams": {"message_size": 30, "num_allreduce_streams": 2},
        "predivide": {"message_size": 30, "gradient_predivide_factor": 2.0},
        "fp32_of_fp32": {"allreduce_always_fp32": True},
    }
    for name, kw in variants.items():
        m = DDP(_mlp(), **kw)
        for it in range(3):  # the 1st backward records the order, later ones overlap
            _step(m, xs, ys)
            out[f"{name}/it{it}"] = _max_rel(m, ref_g)
        out[f"{name}/early_buckets"] = m.stats.early_buckets
    m = DDP(_mlp(), message_size=30, gradient_average=False, gradient_predivide_factor=4.0)
    _step(m, xs, ys)
    out["sum_predivide4"] = _max_rel(m, [2 * g / 4 for g in ref_g])
    trig = _mlp()
    m = DDP(trig, allreduce_trigger_params=[trig[2].weight])
    for _ in range(2):
        _step(m, xs, ys)
    out["triggers"] = _max_rel(m, ref_g)
    m = DDP(_mlp(), message_size=30, retain_allreduce_buffers=True)
    _step(m, xs, ys)
    flat = torch.cat([b for b in m.allreduce_buffers])
    out["retain"] = _rel(flat.sort().values, torch.cat([g.flatten() for g in ref_g]).sort().values)
    tmod = torch.nn.parallel.DistributedDataParallel(_mlp())
    _step(tmod, xs, ys)
    m = DDP(_mlp(), message_size=30)
    for _ in range(2):
        _step(m, xs, ys)
    out["vs_torch_ddp"] = _max_rel(m, [p.grad for p in tmod.parameters()])
    red_m = _mlp()
    reducer = Reducer(red_m)
    _step(red_m, xs, ys)
    reducer.reduce()
    out["reducer"] = _max_rel(red_m, ref_g)
    out.update(_half_and_unused_checks(xs, ys, r))
    return out


def _half_and_unused_checks(xs, ys, r) -> dict[str, float]:
    out = {}
    # bf16 grads reduced in fp32: equals the fp32 mean of the local bf16 grads, rounded once.
    local = _mlp(torch.bfloat16)
    _step(local, xs.bfloat16(), ys.bfloat16())
    want = [g.bfloat16() for g in _gathered_mean([p.grad for p in local.parameters()])]
    m = DDP(_mlp(torch.bfloat16), message_size=30, allreduce_always_fp32=True)
    for _ in range(2):
        _step(m, xs.bfloat16(), ys.bfloat16())
    out["bf16_fp32_reduce"] = _max_rel(m, want)
    # unused params: head a skipped on rank 1 in even steps, head b on rank 0 in odd steps,
    # head `never` never used; the first backward already misses some.
    m = DDP(_TwoHeads(), message_size=40)
    plain = _TwoHeads()
    errs = []
    for it in range(4):
        kw = {"use_a": not (r == 1 and it % 2 == 0), "use_b": not (r == 0 and it % 2 == 1)}
        _step(plain, xs, ys, **kw)
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in plain.parameters()]
        want = _gathered_mean(grads)
        _step(m, xs, ys, **kw)
        errs.append(
            max(
                _rel(p.grad, w) if w.abs().max() > 0 else p.grad.abs().max().item()
                for p, w in zip(m.parameters(), want, strict=True)
            )
        )
    out["unused"] = max(errs)
    # no_sync: the first micro-batch accumulates locally, the second reduces the sum
    m = DDP(_mlp(), message_size=30)
    plain = _mlp()
    plain.zero_grad()
    for half in (0, 1):
        _loss(plain, xs[half::2], ys[half::2]).backward()
    want = _gathered_mean([p.grad for p in plain.parameters()])
    for _ in range(2):
        m.zero_grad()
        with m.no_sync():
            _loss(m, xs[0::2], ys[0::2]).backward()
        inside = [p.grad.clone() for p in m.parameters()]
        _loss(m, xs[1::2], ys[1::2]).backward()
    local_first = [p.grad for p in _grads_of(xs[0::2], ys[0::2])]
    out["no_sync_local"] = max(_rel(a, b) for a, b in zip(inside, local_first, strict=True))
    out["no_sync"] = _max_rel(m, want)
    return out


def _grads_of(x, y):
    m = _mlp()
    _loss(m, x, y).backward()
    return list(m.parameters())


@pytest.fixture(scope="module")
def ddp_results():
    return launch(_ddp_checks, 2, backend="gloo", timeout=120, threads=1)


GRAD_KEYS = [
    *(
        f"{n}/it{i}"
        for n in ("overlap", "one_bucket", "delay", "streams", "predivide", "fp32_of_fp32")
        for i in range(3)
    ),
    "sum_predivide4",
    "triggers",
    "retain",
    "vs_torch_ddp",
    "reducer",
]


@pytest.mark.parametrize("key", GRAD_KEYS)
def test_grads_equal_single_process_on_concatenated_batch(ddp_results, key):
    for rank, res in enumerate(ddp_results):
        assert res[key] <= 1e-6, f"rank {rank}: {key} relative error {res[key]:.3g}"


def test_overlap_launches_buckets_during_backward(ddp_results):
    for res in ddp_results:
        assert res["overlap/early_buckets"] > 0  # iterations 2 and 3 launch before the end
        assert res["delay/early_buckets"] == 0


def test_bf16_grads_reduced_in_fp32(ddp_results):
    for res in ddp_results:
        assert res["bf16_fp32_reduce"] == 0.0


def test_unused_and_sometimes_unused_params_reduce_without_hanging(ddp_results):
    for res in ddp_results:
        assert res["unused"] <= 1e-6


def test_no_sync_accumulates_locally_then_reduces_the_sum(ddp_results):
    for res in ddp_results:
        assert res["no_sync_local"] <= 1e-6
        assert res["no_sync"] <= 1e-6


def test_needs_a_process_group():
    with pytest.raises(RuntimeError, match="init_process_group"):
        DDP(_mlp())
    with pytest.raises(RuntimeError, match="init_process_group"):
        Reducer(_mlp())
