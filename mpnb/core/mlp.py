"""Apex's ``apex.mlp.MLP``: a stack of dense layers with one activation, fused backward epilogue.

Forward: one ``addmm`` per layer (bias fused into the matmul) and the activation applied in
place on its output, so each layer keeps a single activation tensor. Backward: mpnb's
``bias_act_bwd`` kernel turns ``dy`` into ``dz = dy * act'(y)`` and the bias gradient in one
pass, then two matmuls give the weight and input gradients.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from mpnb.core.amp.casts import in_autocast_dtype
from mpnb.core.ops.dense import ACTIVATIONS, bias_act_bwd

__all__ = ["MLP", "mlp_function"]


class _MlpFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, bias: bool, activation: int, input: torch.Tensor, *params: torch.Tensor):
        n = len(params) // 2 if bias else len(params)
        weights, biases = params[:n], params[n:]
        outs, x = [input], input
        for i, w in enumerate(weights):
            y = torch.addmm(biases[i], x, w.t()) if bias else x @ w.t()
            if activation == 1:
                y.relu_()
            elif activation == 2:
                y.sigmoid_()
            outs.append(y)
            x = y
        ctx.bias, ctx.activation, ctx.n = bias, activation, n
        ctx.save_for_backward(*outs, *weights)
        return x

    @staticmethod
    def backward(ctx, gy: torch.Tensor):
        saved = ctx.saved_tensors
        n = ctx.n
        outs, weights = saved[: n + 1], saved[n + 1 :]
        dws, dbs = [None] * n, [None] * n
        g = gy.contiguous()
        for i in reversed(range(n)):
            dz, db = bias_act_bwd(g, outs[i + 1], ctx.activation, ctx.bias)
            dws[i] = dz.t() @ outs[i]
            dbs[i] = db if ctx.bias else None
            g = dz @ weights[i] if (i > 0 or ctx.needs_input_grad[2]) else None
        return (None, None, g, *dws, *(dbs if ctx.bias else []))


def mlp_function(bias: bool, activation: int, input: torch.Tensor, *params: torch.Tensor):
    """Apex's ``mlp_function(bias, activation, input, *weights, *biases)`` (activation 0/1/2).

    Inside a ``torch.autocast`` region the input, weights and biases are cast to the region's
    dtype first (as Apex does), so forward and backward run in one dtype.
    """
    return in_autocast_dtype(_MlpFunction.apply, bias, activation, input, *params)


class MLP(nn.Module):
    """A multi-layer perceptron: ``act(... act(act(x W0^T + b0) W1^T + b1) ...)``.

    The activation follows every layer, the last one included (as in Apex).

    Args:
        mlp_sizes: feature sizes ``[in, hidden..., out]`` (at least two).
        bias: learn a bias per layer.
        activation: ``"relu"``, ``"sigmoid"`` or ``"none"``.

    Example::

        >>> mlp = MLP([64, 128, 10])
        >>> mlp(torch.randn(32, 64)).shape
        torch.Size([32, 10])
    """

    def __init__(self, mlp_sizes: Sequence[int], bias: bool = True, activation: str = "relu"):
        super().__init__()
        if len(mlp_sizes) < 2:
            raise ValueError(f"MLP: mlp_sizes needs at least [in, out], got {list(mlp_sizes)}.")
        if activation not in ("none", "relu", "sigmoid"):
            raise ValueError(
                f"MLP: activation must be 'relu', 'sigmoid' or 'none', got {activation!r}."
            )
        self.mlp_sizes = list(mlp_sizes)
        self.num_layers = len(mlp_sizes) - 1
        self.bias = bool(bias)
        self.activation = ACTIVATIONS[activation]
        self.weights = nn.ParameterList(
            nn.Parameter(torch.empty(mlp_sizes[i + 1], mlp_sizes[i]))
            for i in range(self.num_layers)
        )
        self.biases = nn.ParameterList(
            nn.Parameter(torch.empty(mlp_sizes[i + 1]))
            for i in range(self.num_layers if bias else 0)
        )
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Apex's init: weights ~ N(0, 2/(fan_in+fan_out)), biases ~ N(0, 1/fan_out)."""
        for w in self.weights:
            nn.init.normal_(w, 0.0, math.sqrt(2.0 / (w.shape[0] + w.shape[1])))
        for b in self.biases:
            nn.init.normal_(b, 0.0, math.sqrt(1.0 / b.shape[0]))

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """Apply the layers to ``input`` ``[..., mlp_sizes[0]]``."""
        if input.shape[-1] != self.mlp_sizes[0]:
            raise ValueError(
                f"MLP: input has {input.shape[-1]} features but the first layer takes "
                f"{self.mlp_sizes[0]}; reshape the input or fix mlp_sizes."
            )
        lead = input.shape[:-1]
        x = input.reshape(-1, input.shape[-1])
        y = mlp_function(self.bias, self.activation, x, *self.weights, *self.biases)
        return y.reshape(*lead, y.shape[-1])

    def extra_repr(self) -> str:
        act = {v: k for k, v in ACTIVATIONS.items()}[self.activation]
        return f"MLP sizes: {self.mlp_sizes}, Bias={self.bias}, activation={act}"
