"""DDP with mpnb.amp (O0/O1/O2, bf16) and the fused optimizers: ranks stay identical.

Each rank trains on its own data for 20 steps; after every step the flattened parameters
(and, under O2, the fp32 masters) are gathered and compared across ranks bit for bit.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

from mpnb import amp
from mpnb.optimizers import FusedAdam, FusedSGD
from mpnb.parallel import DistributedDataParallel as DDP
from mpnb.parallel import launch

pytestmark = pytest.mark.dist

CONFIGS = [
    ("O0", "FusedAdam", {}),
    ("O1", "FusedAdam", {}),
    ("O2", "FusedAdam", {"allreduce_always_fp32": True}),
    ("O2", "FusedSGD", {"delay_allreduce": True}),
    ("O1", "torch.SGD", {"gradient_predivide_factor": 2.0}),
    ("O3", "FusedAdam", {"allreduce_always_fp32": True}),
]


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16),
        torch.nn.ReLU(),
        torch.nn.Linear(16, 16),
        torch.nn.ReLU(),
        torch.nn.Linear(16, 4),
    )


def _opt(name: str, params):
    if name == "FusedAdam":
        return FusedAdam(params, lr=1e-2)
    if name == "FusedSGD":
        return FusedSGD(params, lr=1e-2, momentum=0.9)
    return torch.optim.SGD(params, lr=1e-2)


def _spread(tensors) -> float:
    """Largest difference of these tensors between the ranks (0.0 when identical)."""
    flat = torch.cat([t.detach().float().flatten() for t in tensors])
    parts = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, flat)
    return max((p - parts[0]).abs().max().item() for p in parts)


def _train(level: str, opt_name: str, ddp_kw: dict) -> dict:
    model = _net()
    opt = _opt(opt_name, model.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt = amp.initialize(
            model, opt, opt_level=level, half_dtype=torch.bfloat16, verbosity=0
        )
    model = DDP(model, message_size=200, **ddp_kw)
    start = [p.detach().float().clone() for p in model.parameters()]
    g = torch.Generator().manual_seed(100 + dist.get_rank())  # different data per rank
    spread = 0.0
    for _ in range(20):
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
        opt.zero_grad()
        loss = (model(x).float() - y).pow(2).mean()
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        spread = max(spread, _spread(model.parameters()), _spread(amp.master_params(opt)))
    moved = max(
        (p.detach().float() - s).abs().max().item()
        for p, s in zip(model.parameters(), start, strict=True)
    )
    dtypes = sorted({str(p.dtype) for p in model.parameters()})
    return {"spread": spread, "moved": moved, "dtypes": dtypes}


def _all_configs() -> dict:
    return {f"{lv}/{opt}/{kw}": _train(lv, opt, kw) for lv, opt, kw in CONFIGS}


@pytest.fixture(scope="module")
def results():
    return launch(_all_configs, 2, backend="gloo", timeout=150, threads=1)


@pytest.mark.parametrize("level,opt,kw", CONFIGS)
def test_params_identical_across_ranks_for_20_steps(results, level, opt, kw):
    for res in results:
        r = res[f"{level}/{opt}/{kw}"]
        assert r["spread"] == 0.0, f"ranks diverged by {r['spread']}"
        assert r["moved"] > 1e-4, "the parameters did not train: the test would prove nothing"
        if level in ("O2", "O3"):
            assert "torch.bfloat16" in r["dtypes"]
