"""O2 under data parallelism: the fp32 masters follow the model weights until the first step.

``amp.initialize`` runs before the model is wrapped in DDP, whose constructor broadcasts rank
0's weights into the model. The masters must take those weights too, or every rank steps from
its own initialisation (Apex's ``tests/distributed/amp_master_params``: each rank seeds its
own model, trains under O2 with DDP, and the model and master params must agree across ranks).
Here each rank seeds differently, and the params of both kinds are compared bit for bit.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

from mpnb import amp
from mpnb.optimizers import FusedAdam
from mpnb.parallel import DistributedDataParallel, launch

pytestmark = pytest.mark.dist

CONFIGS = [
    ("mpnb", "torch.SGD", torch.float16),
    ("torch", "torch.SGD", torch.float16),
    ("mpnb", "FusedAdam", torch.float16),
    ("torch", "FusedAdam", torch.bfloat16),
]


def _spread(tensors) -> float:
    """Largest difference of these tensors between the ranks (0.0 when identical)."""
    flat = torch.cat([t.detach().float().flatten() for t in tensors])
    parts = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, flat)
    return max((p - parts[0]).abs().max().item() for p in parts)


def _masters(opt) -> list[torch.Tensor]:
    """The fp32 values the optimizer updates: amp's masters or the fused optimizer's own."""
    out = []
    for p in amp.master_params(opt):
        out.append(opt.state.get(p, {}).get("master_param", p))
    return out


def _train(ddp: str, opt_name: str, half: torch.dtype) -> dict:
    rank = dist.get_rank()
    torch.manual_seed(rank)  # as Apex's script: every rank starts from its own weights
    model = torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    if opt_name == "FusedAdam":
        opt = FusedAdam(model.parameters(), lr=1e-3)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt = amp.initialize(model, opt, opt_level="O2", half_dtype=half, verbosity=0)
    before = _spread(model.parameters())
    if ddp == "mpnb":
        model = DistributedDataParallel(model)
    else:
        model = torch.nn.parallel.DistributedDataParallel(model)
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own batch
    x, y = torch.randn(8, 32, generator=g), torch.randn(8, 4, generator=g)
    for _ in range(5):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
    masters = _masters(opt)
    params = list(model.parameters())
    return {
        "before": before,
        "model": _spread(params),
        "masters": _spread(masters),
        "rounded": all(torch.equal(m.to(p.dtype), p) for m, p in zip(masters, params, strict=True)),
        "dtypes": sorted({str(m.dtype) for m in masters}),
    }


def _all() -> dict:
    return {f"{d}/{o}/{h}": _train(d, o, h) for d, o, h in CONFIGS}


@pytest.fixture(scope="module")
def results():
    return launch(_all, 2, backend="gloo", timeout=200, threads=1)


@pytest.mark.parametrize("ddp,opt,half", CONFIGS)
def test_o2_ranks_end_identical_from_different_seeds(results, ddp, opt, half):
    for res in results:
        r = res[f"{ddp}/{opt}/{half}"]
        assert r["before"] > 0, "the ranks started equal: the test would prove nothing"
        assert r["dtypes"] == ["torch.float32"]
        assert r["model"] == 0.0, f"model params differ across ranks by {r['model']}"
        assert r["masters"] == 0.0, f"fp32 masters differ across ranks by {r['masters']}"
        assert r["rounded"], "the model params are not the rounded fp32 masters"
