"""apex.mlp's ``MLP`` on mpnb: parity with a ``torch.nn`` stack (on the kernel and on the
reference), gradcheck, the activation after every layer, Apex's init, autocast, and errors that
name the fix.

bias_act_bwd's kernel vs reference on every dtype and opcheck: tests/core/ops/test_library.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mpnb.core.mlp import mlp_function
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


def test_the_activation_follows_every_layer_the_last_one_included(op_impl):
    torch.manual_seed(0)
    x = torch.randn(64, 8)
    assert (MLP([8, 16, 4], activation="relu")(x) >= 0).all()
    y = MLP([8, 16, 4], activation="sigmoid")(x)
    assert ((y > 0) & (y < 1)).all()
    assert (MLP([8, 16, 4], activation="none")(x) < 0).any()


def test_mlp_function_takes_apexs_positional_form(op_impl):
    mlp = MLP([5, 7, 3], activation="sigmoid")
    x = torch.randn(4, 5)
    y = mlp_function(True, 2, x, *mlp.weights, *mlp.biases)
    assert torch.equal(y, mlp(x))
    plain = MLP([5, 3], bias=False, activation="none")
    assert len(list(plain.parameters())) == 1
    torch.testing.assert_close(mlp_function(False, 0, x, plain.weights[0]), x @ plain.weights[0].T)


def test_leading_dims_are_kept(op_impl):
    mlp = MLP([6, 4])
    assert mlp(torch.randn(2, 3, 5, 6)).shape == (2, 3, 5, 4)


def test_under_autocast_the_mlp_runs_in_the_regions_dtype(op_impl):
    mlp = MLP([16, 32, 8])
    x = torch.randn(4, 16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = mlp(x)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32 and mlp.weights[0].grad.dtype == torch.float32
    want = MLP([16, 32, 8])
    want.load_state_dict(mlp.state_dict())
    torch.testing.assert_close(y, want.bfloat16()(x.detach().bfloat16()))


def test_apexs_init_draws_weights_and_biases_at_their_widths():
    torch.manual_seed(0)
    mlp = MLP([512, 256, 128])
    for w in mlp.weights:
        assert w.std().item() == pytest.approx((2.0 / (w.shape[0] + w.shape[1])) ** 0.5, rel=0.05)
    assert mlp.biases[0].std().item() == pytest.approx((1.0 / 256) ** 0.5, rel=0.15)
    assert "MLP sizes: [512, 256, 128], Bias=True, activation=relu" in repr(mlp)


def test_errors_are_clear():
    with pytest.raises(ValueError, match="'tanh'"):
        MLP([4, 4], activation="tanh")
    with pytest.raises(ValueError, match=r"at least \[in, out\]"):
        MLP([4])
    with pytest.raises(ValueError, match="has 5 features") as e:
        MLP([4, 4])(torch.randn(2, 5))
    assert "mlp_sizes" in str(e.value)  # the fix
