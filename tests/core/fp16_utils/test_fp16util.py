"""``fp16_utils.FP16Model``: a network in half with its affine batch norms kept fp32.

Mirrors Apex's run_fp16util: nested blocks of convolutions and batch norms (affine and not);
every param and buffer is half except the affine batch norms', and the output is half.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mpnb.fp16_utils import FP16Model


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(6, 6, 2)
        self.bn = nn.BatchNorm2d(6, affine=True)

    def forward(self, x):
        return self.conv(self.bn(x))


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm2d(3, affine=True)
        self.conv = nn.Conv2d(3, 6, 2)
        self.plain_bn = nn.BatchNorm2d(6, affine=False)
        self.blocks = nn.Sequential(_Block(), _Block())

    def forward(self, x):
        return self.blocks(self.plain_bn(self.conv(self.bn(x))))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_params_and_buffers_are_half_except_affine_batch_norms(dtype):
    model = FP16Model(_Net(), dtype) if dtype != torch.float16 else FP16Model(_Net())
    fp32 = {model.network.bn, model.network.blocks[0].bn, model.network.blocks[1].bn}
    for m in model.modules():
        want = torch.float32 if m in fp32 else dtype
        for p in m.parameters(recurse=False):
            assert p.dtype == want, m
        for b in m.buffers(recurse=False):
            assert b.dtype in (want, torch.int64), m


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_output_is_half_and_backward_reaches_every_param(dtype):
    model = FP16Model(_Net(), dtype)
    out = model(torch.randn(4, 3, 9, 9))
    assert out.dtype == dtype
    out.float().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == p.dtype for p in model.parameters())
