"""apex.mlp / apex.fused_dense on mpnb: parity with torch.nn layers (on the kernel and on the
reference), gradcheck, main_grad accumulation and errors that name the fix.

bias_act_bwd's kernel vs reference on every dtype and opcheck: tests/core/ops/test_op_table.py.
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
from mpnb.mlp import MLP


def reference_mlp(mlp: MLP) -> nn.Sequential:
    act = {0: nn.Identity, 1: nn.ReLU, 2: nn.Sigmoid}[mlp.activation]
    layers = []
    for i in range(mlp.num_layers):
        lin = nn.Linear(mlp.mlp_sizes[i], mlp.mlp_sizes[i + 1], bias=mlp.bias)
        with torch.no_grad():
            lin.weight.copy_(mlp.weights[i])
            if mlp.bias:
                lin.bias.copy_(mlp.biases[i])
        layers += [lin, act()]
    return nn.Sequential(*layers)


@pytest.mark.parametrize("activation", ["relu", "sigmoid", "none"])
@pytest.mark.parametrize("bias", [True, False])
def test_mlp_matches_sequential(op_impl, activation, bias):
    mlp = MLP([33, 64, 17, 5], bias=bias, activation=activation)
    ref = reference_mlp(mlp)
    x = torch.randn(2, 9, 33)
    xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    ya, yb = mlp(xa), ref(xb)
    torch.testing.assert_close(ya, yb, rtol=1e-5, atol=1e-5)
    dy = torch.randn_like(ya)
    ya.backward(dy), yb.backward(dy)
    torch.testing.assert_close(xa.grad, xb.grad, rtol=1e-5, atol=1e-5)
    lins = [m for m in ref if isinstance(m, nn.Linear)]
    for w, lin in zip(mlp.weights, lins, strict=True):
        torch.testing.assert_close(w.grad, lin.weight.grad, rtol=1e-5, atol=1e-5)
    for b, lin in zip(mlp.biases, lins, strict=bias):
        torch.testing.assert_close(b.grad, lin.bias.grad, rtol=1e-5, atol=1e-5)


def test_mlp_gradcheck_fp64(op_impl):
    mlp = MLP([4, 6, 3], activation="sigmoid").double()
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, *p: mlp(x), (x, *mlp.parameters()))


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
    with pytest.raises(ValueError, match="activation must be"):
        MLP([4, 4], activation="tanh")
    with pytest.raises(ValueError, match="features"):
        MLP([4, 4])(torch.randn(2, 5))
    with pytest.raises(TypeError, match="float32"):
        wgrad_gemm_accum_fp32(torch.randn(2, 3), torch.randn(2, 4), torch.zeros(4, 3).half())
    with pytest.raises(ValueError, match=r"\[out=4, in=3\]"):
        wgrad_gemm_accum_fp32(torch.randn(2, 3), torch.randn(2, 4), torch.zeros(3, 4))
    with pytest.raises(ValueError, match="does not match.*the forward saved"):
        ops.bias_act_bwd(torch.randn(2, 3), torch.randn(3, 2), 1, True)
    with pytest.raises(ValueError, match="activation must be one of"):
        ops.bias_act_bwd(torch.randn(2, 3), torch.randn(2, 3), 7, True)
    with pytest.raises(TypeError, match="supported dtypes"):
        ops.bias_act_bwd(torch.ones(2, 3, dtype=torch.int32), torch.ones(2, 3).int(), 0, True)
