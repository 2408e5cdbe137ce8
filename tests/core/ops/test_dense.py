"""``mpnb::bias_act_bwd`` (``mpnb/core/ops/dense.py``): the backward epilogue of a dense layer is
autograd's gradient through each activation (relu and sigmoid from their output, gelu in its
erf form from its input), and the bias gradient is that gradient summed over every row, on the
kernel and on the reference; without ``bias_grad`` the bias gradient is empty, and bad
arguments are refused naming the problem. (Kernel vs reference on every dtype and opcheck:
``test_library.py``; the layers that call it: ``tests/core/test_fused_dense.py``.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mpnb.core import ops
from mpnb.core.ops.dense import ACTIVATIONS

# name -> (the activation, whether the op is given its output (True) or its input (False))
FORWARD = {
    "none": (lambda x: x, True),
    "relu": (torch.relu, True),
    "sigmoid": (torch.sigmoid, True),
    "gelu": (lambda x: F.gelu(x, approximate="none"), False),
}


@pytest.mark.parametrize("name", list(ACTIVATIONS))
@pytest.mark.parametrize("shape", [(37, 65), (3, 5, 17)], ids=["2d", "3d"])
def test_the_gradient_is_autograds_through_the_activation(op_impl, name, shape):
    g = torch.Generator().manual_seed(len(shape))
    x = torch.randn(shape, generator=g, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(shape, generator=g, dtype=torch.float64)
    act, from_output = FORWARD[name]
    y = act(x)
    y.backward(grad)
    saved = y.detach() if from_output else x.detach()
    dz, db = ops.bias_act_bwd(grad, saved, ACTIVATIONS[name], True)
    torch.testing.assert_close(dz, x.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(db, x.grad.reshape(-1, shape[-1]).sum(0), rtol=1e-12, atol=1e-12)


def test_without_bias_grad_the_bias_gradient_is_empty(op_impl):
    grad, y = torch.randn(8, 4), torch.relu(torch.randn(8, 4))
    dz, db = ops.bias_act_bwd(grad, y, ACTIVATIONS["relu"], False)
    assert db.numel() == 0
    assert torch.equal(dz, grad * (y > 0))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_gradients_are_computed_in_fp32_and_rounded_once(op_impl, dtype):
    g = torch.Generator().manual_seed(5)
    grad = torch.randn(64, 33, generator=g).to(dtype)
    s = torch.sigmoid(torch.randn(64, 33, generator=g)).to(dtype)
    dz, db = ops.bias_act_bwd(grad, s, ACTIVATIONS["sigmoid"], True)
    want = grad.float() * s.float() * (1 - s.float())
    assert dz.dtype == db.dtype == dtype
    assert torch.equal(dz, want.to(dtype))
    torch.testing.assert_close(db.float(), want.sum(0), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize(
    ("grad", "saved", "activation", "match"),
    [
        (torch.randn(2, 3), torch.randn(3, 2), 1, "does not match"),
        (torch.randn(2, 3), torch.randn(2, 3), 7, "activation must be"),
        (torch.randn(()), torch.randn(()), 0, "grad is a scalar"),
    ],
    ids=["shape", "activation", "scalar"],
)
def test_bad_arguments_are_refused(op_impl, grad, saved, activation, match):
    with pytest.raises(ValueError, match=match):
        ops.bias_act_bwd(grad, saved, activation, True)
