"""The fused optimizers on a GPU: PyTorch's fused CUDA ops behind mpnb's optimizer classes
(the ops' CUDA path itself is tested in tests/core/ops/test_optimizer_torch_path.py)."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.gpu
@pytest.mark.parametrize(
    "cls", ["FusedAdam", "FusedSGD", "FusedAdagrad", "FusedLAMB", "FusedNovoGrad"]
)
def test_cuda_optimizers_step_and_skip(cls):
    from mpnb import optimizers

    torch.manual_seed(0)
    model = torch.nn.Linear(16, 8).cuda().to(torch.bfloat16)
    # lr 0.1 for every class: at a default lr of 1e-3 a normalized step (NovoGrad: g / |g|)
    # moves each weight less than half a bf16 ulp, and the bf16 model would not change.
    opt = getattr(optimizers, cls)(model.parameters(), master_weights=True, lr=0.1)
    model(torch.randn(4, 16, device="cuda", dtype=torch.bfloat16)).float().sum().backward()
    before = [p.detach().clone() for p in model.parameters()]
    model.weight.grad[0, 0] = float("inf")
    found = torch.zeros(1, device="cuda")
    opt._mpnb_set_scale(torch.ones(1, device="cuda"), found)
    opt.step()
    assert found.item() == 1
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    model.weight.grad[0, 0] = 0.0
    opt.step()
    assert not torch.equal(before[0], model.weight)
