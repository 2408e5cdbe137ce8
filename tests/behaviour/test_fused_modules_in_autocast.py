"""mpnb's fused modules inside ``torch.autocast`` behave as Apex's: they run in the region's dtype.

Apex casts the inputs and parameters of its fused layer norm, RMS norm, masked softmax and
MLP to the autocast dtype and runs them with autocast off (run_fused_layer_norm,
run_transformer/test_fused_softmax and run_mlp check it): the output is the region's half
dtype and matches the same module run on half inputs, and backward works.
"""

from __future__ import annotations

import pytest
import torch

from mpnb.mlp import MLP
from mpnb.normalization import FusedLayerNorm, FusedRMSNorm, MixedFusedLayerNorm
from mpnb.transformer import AttnMaskType
from mpnb.transformer.functional import FusedScaleMaskSoftmax, attention_mask_func

HALVES = [torch.float16, torch.bfloat16]
TOL = {torch.float16: dict(rtol=2e-3, atol=2e-3), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def _pair(shape, dtype):
    torch.manual_seed(0)
    x = torch.randn(shape).requires_grad_()
    xh = x.detach().to(dtype).requires_grad_()
    return x, xh


@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("memory_efficient", [False, True])
def test_layer_norm_runs_in_the_autocast_dtype(dtype, affine, memory_efficient):
    shape = [8, 16]
    fused = FusedLayerNorm(shape, elementwise_affine=affine, memory_efficient=memory_efficient)
    native = torch.nn.LayerNorm(shape, elementwise_affine=affine).to(dtype)
    x, xh = _pair((4, *shape), dtype)
    with torch.autocast("cpu", dtype=dtype):
        y = fused(x)
    assert y.dtype == dtype
    expected = native(xh)
    torch.testing.assert_close(y, expected, **TOL[dtype])
    g = torch.rand_like(expected)
    y.backward(g)
    expected.backward(g)
    assert x.grad.dtype == torch.float32
    torch.testing.assert_close(x.grad.to(dtype), xh.grad, **TOL[dtype])
    if affine:
        assert fused.weight.grad.dtype == torch.float32


@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("cls", [FusedRMSNorm, MixedFusedLayerNorm])
def test_rms_and_mixed_norms_run_in_the_autocast_dtype(dtype, cls):
    norm = cls([16])
    x = torch.randn(4, 16, requires_grad=True)
    with torch.autocast("cpu", dtype=dtype):
        y = norm(x)
    assert y.dtype == dtype
    y.float().sum().backward()
    assert x.grad is not None and norm.weight.grad.dtype == torch.float32


def test_norms_outside_autocast_are_unchanged():
    x = torch.randn(4, 16)
    assert FusedLayerNorm(16)(x).dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=False):
        assert FusedRMSNorm(16)(x).dtype == torch.float32


@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("mask_type", [AttnMaskType.padding, AttnMaskType.causal])
def test_scale_mask_softmax_runs_in_the_autocast_dtype(dtype, mask_type):
    def make(fusion):
        return FusedScaleMaskSoftmax(
            dtype == torch.float16,
            dtype == torch.bfloat16,
            mask_type,
            fusion,
            attention_mask_func,
            True,
            0.5,
        )

    x, xh = _pair((2, 3, 8, 8), dtype)
    mask = torch.randint(0, 2, (2, 1, 8, 8)).bool() if mask_type == AttnMaskType.padding else None
    with torch.autocast("cpu", dtype=dtype):
        y = make(True)(x, mask)
    assert y.dtype == dtype
    expected = make(False)(xh, mask)  # the unfused PyTorch path on half scores
    torch.testing.assert_close(y, expected, **TOL[dtype])
    g = torch.rand_like(expected)
    y.backward(g)
    expected.backward(g)
    torch.testing.assert_close(x.grad.to(dtype), xh.grad, **TOL[dtype])


@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("activation", ["relu", "sigmoid", "none"])
@pytest.mark.parametrize("bias", [True, False])
def test_mlp_trains_inside_autocast(dtype, activation, bias):
    torch.manual_seed(0)
    mlp = MLP([16, 32, 8], bias=bias, activation=activation)
    layers = []
    for i in range(mlp.num_layers):
        lin = torch.nn.Linear(mlp.mlp_sizes[i], mlp.mlp_sizes[i + 1], bias=bias)
        with torch.no_grad():
            lin.weight.copy_(mlp.weights[i])
            if bias:
                lin.bias.copy_(mlp.biases[i])
        act = {"relu": torch.nn.ReLU(), "sigmoid": torch.nn.Sigmoid()}.get(activation)
        layers += [lin] + ([act] if act is not None else [])
    ref = torch.nn.Sequential(*layers)
    x = torch.randn(4, 16, requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    with torch.autocast("cpu", dtype=dtype):
        y = mlp(x)
        yr = ref(xr)
    assert y.dtype == yr.dtype == dtype
    torch.testing.assert_close(y, yr, **TOL[dtype])
    y.float().sum().backward()
    yr.float().sum().backward()
    assert mlp.weights[0].grad.dtype == torch.float32
    torch.testing.assert_close(x.grad, xr.grad, **TOL[dtype])
    torch.testing.assert_close(mlp.weights[0].grad, ref[0].weight.grad, **TOL[dtype])
