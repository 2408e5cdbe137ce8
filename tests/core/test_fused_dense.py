"""apex.fused_dense on mpnb: parity with torch.nn layers (on the kernel and on the reference),
gradcheck, main_grad accumulation and errors that name the fix. apex.mlp: tests/core/test_mlp.py.

bias_act_bwd's kernel vs reference on every dtype and opcheck: tests/core/ops/test_library.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mpnb.core.ops as ops
from mpnb.fused_dense import (
    FusedDense,
    FusedDenseGeluDense,
    linear_with_grad_accumulation,
    wgrad_gemm_accum_fp32,
)


def test_fused_dense_gelu_dense(kernels):
    m = FusedDenseGeluDense(16, 48, 8).double()
    x = torch.randn(3, 5, 16, dtype=torch.float64, requires_grad=True)
    y = m(x)
    ref = F.linear(F.gelu(F.linear(x, m.weight1, m.bias1)), m.weight2, m.bias2)
    torch.testing.assert_close(y, ref)
    assert torch.autograd.gradcheck(lambda x, *p: m(x), (x, *m.parameters()))
    d = FusedDense(16, 8)
    torch.testing.assert_close(d(x.float()), F.linear(x.float(), d.weight, d.bias))


def test_bf16_dense_gelu_dense_close_to_fp32(kernels):
    m = FusedDenseGeluDense(64, 128, 32)
    x = torch.randn(16, 64)
    y32 = m(x)
    y16 = m.bfloat16()(x.bfloat16())
    torch.testing.assert_close(y16.float(), y32, rtol=5e-2, atol=5e-2)


def test_main_grad_accumulation(kernels):
    x = torch.randn(6, 8).bfloat16()
    w = nn.Parameter(torch.randn(4, 8).bfloat16())
    b = nn.Parameter(torch.zeros(4).bfloat16())
    for _ in range(2):  # two micro-batches accumulate
        linear_with_grad_accumulation(x, w, b).float().sum().backward()
    assert w.grad is None and w.main_grad.dtype == torch.float32
    expected = 2 * (torch.ones(6, 4).t() @ x.float())
    torch.testing.assert_close(w.main_grad, expected)
    mg = torch.zeros(4, 8)
    wgrad_gemm_accum_fp32(x, torch.ones(6, 4).bfloat16(), mg)
    torch.testing.assert_close(mg, expected / 2)


def test_errors_are_clear(op_impl):
    with pytest.raises(TypeError, match="float32"):
        wgrad_gemm_accum_fp32(torch.randn(2, 3), torch.randn(2, 4), torch.zeros(4, 3).half())
    with pytest.raises(ValueError, match=r"\[out=4, in=3\]"):
        wgrad_gemm_accum_fp32(torch.randn(2, 3), torch.randn(2, 4), torch.zeros(3, 4))
    with pytest.raises(ValueError, match="the saved activation"):
        ops.bias_act_bwd(torch.randn(2, 3), torch.randn(3, 2), 1, True)
    with pytest.raises(ValueError, match="got 7"):
        ops.bias_act_bwd(torch.randn(2, 3), torch.randn(2, 3), 7, True)
    with pytest.raises(TypeError, match="supported dtypes"):
        ops.bias_act_bwd(torch.ones(2, 3, dtype=torch.int32), torch.ones(2, 3).int(), 0, True)
