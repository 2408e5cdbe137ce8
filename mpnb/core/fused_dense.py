"""Apex's ``apex.fused_dense`` and ``fused_weight_gradient_mlp`` on PyTorch matmuls.

* :class:`FusedDense`: ``x W^T + b`` (the bias is fused into ``addmm``; the bias gradient is
  the column sum of ``dy``).
* :class:`FusedDenseGeluDense`: ``gelu(x W1^T + b1) W2^T + b2``; the backward turns ``dy W2``
  into the GELU input gradient and ``b1``'s gradient in one pass of mpnb's ``bias_act_bwd``.
* :func:`wgrad_gemm_accum_fp32` / :func:`wgrad_gemm_accum_fp16`: ``main_grad += dy^T x``
  (Megatron's gradient-accumulation fusion), and :func:`linear_with_grad_accumulation`, a
  linear whose weight gradient is accumulated into ``weight.main_grad`` (fp32) instead of
  ``weight.grad``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from mpnb.core.ops.dense import bias_act_bwd

__all__ = [
    "FusedDense",
    "FusedDenseGeluDense",
    "fused_dense_function",
    "fused_dense_gelu_dense_function",
    "linear_with_grad_accumulation",
    "wgrad_gemm_accum_fp16",
    "wgrad_gemm_accum_fp32",
]


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


def wgrad_gemm_accum_fp32(input: torch.Tensor, d_output: torch.Tensor, main_grad: torch.Tensor):
    """``main_grad += d_output^T @ input`` with an fp32 ``main_grad`` ``[out, in]``.

    Half inputs are multiplied in fp32 (the CPU has no half matmul with fp32 output), so the
    accumulated gradient never rounds to half precision.
    """
    if main_grad.dtype != torch.float32:
        raise TypeError(
            f"wgrad_gemm_accum_fp32: main_grad is {main_grad.dtype}; it must be float32 "
            "(use wgrad_gemm_accum_fp16 for a half main_grad)."
        )
    x, dy = _rows(input), _rows(d_output)
    if main_grad.shape != (dy.shape[1], x.shape[1]) or x.shape[0] != dy.shape[0]:
        raise ValueError(
            f"wgrad_gemm_accum_fp32: main_grad {tuple(main_grad.shape)} must be "
            f"[out={dy.shape[1]}, in={x.shape[1]}] and input/d_output must have the "
            f"same number of rows ({x.shape[0]} vs {dy.shape[0]})."
        )
    main_grad.addmm_(dy.t().float(), x.float())
    return main_grad


def wgrad_gemm_accum_fp16(input: torch.Tensor, d_output: torch.Tensor, main_grad: torch.Tensor):
    """``main_grad += d_output^T @ input`` for a half ``main_grad`` (product computed in fp32)."""
    x, dy = _rows(input), _rows(d_output)
    main_grad.add_((dy.t().float() @ x.float()).to(main_grad.dtype))
    return main_grad


class _LinearGradAccum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, weight, bias):
        ctx.save_for_backward(input, weight)
        ctx.weight, ctx.has_bias = weight, bias is not None
        return F.linear(input, weight, bias)

    @staticmethod
    def backward(ctx, gy):
        input, weight = ctx.saved_tensors
        if getattr(ctx.weight, "main_grad", None) is None:
            ctx.weight.main_grad = torch.zeros(
                weight.shape, dtype=torch.float32, device=weight.device
            )
        wgrad_gemm_accum_fp32(input, gy, ctx.weight.main_grad)
        db = _rows(gy).sum(0) if ctx.has_bias else None
        return gy @ weight, None, db


def linear_with_grad_accumulation(input, weight, bias=None):
    """``F.linear`` whose weight gradient is added to ``weight.main_grad`` (fp32, created on
    first use) instead of ``weight.grad``: Megatron's ``gradient_accumulation_fusion``."""
    return _LinearGradAccum.apply(input, weight, bias)


def fused_dense_function(input, weight, bias):
    """``input @ weight^T + bias`` (Apex's ``fused_dense_function``)."""
    return F.linear(input, weight, bias)


class _DenseGeluDense(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w1, b1, w2, b2):
        h = torch.addmm(b1, x, w1.t())
        g = F.gelu(h)
        ctx.save_for_backward(x, w1, w2, h, g)
        return torch.addmm(b2, g, w2.t())

    @staticmethod
    def backward(ctx, gy):
        x, w1, w2, h, g = ctx.saved_tensors
        gy = gy.contiguous()
        dw2, db2 = gy.t() @ g, gy.sum(0)
        dh, db1 = bias_act_bwd(gy @ w2, h, 3, True)
        return dh @ w1, dh.t() @ x, db1, dw2, db2


def fused_dense_gelu_dense_function(input, weight1, bias1, weight2, bias2):
    """``gelu(input W1^T + b1) W2^T + b2`` with the fused backward epilogue."""
    lead = input.shape[:-1]
    y = _DenseGeluDense.apply(_rows(input), weight1, bias1, weight2, bias2)
    return y.reshape(*lead, y.shape[-1])


def _init_linear(weight: nn.Parameter, bias: nn.Parameter | None) -> None:
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
    if bias is not None:
        bound = 1 / math.sqrt(weight.shape[1]) if weight.shape[1] else 0.0
        nn.init.uniform_(bias, -bound, bound)


class FusedDense(nn.Module):
    """A dense layer ``x W^T + b`` (``torch.nn.Linear`` init), Apex's ``FusedDense``."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        _init_linear(self.weight, self.bias)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """``input @ weight^T + bias``."""
        return fused_dense_function(input, self.weight, self.bias)


class FusedDenseGeluDense(nn.Module):
    """``Linear -> GELU (erf) -> Linear`` with a fused backward epilogue.

    Example::

        >>> m = FusedDenseGeluDense(64, 256, 64)
        >>> m(torch.randn(8, 64)).shape
        torch.Size([8, 64])
    """

    def __init__(
        self, in_features: int, intermediate_features: int, out_features: int, bias: bool = True
    ) -> None:
        super().__init__()
        if not bias:
            raise ValueError(
                "FusedDenseGeluDense: bias=False is not supported (as in Apex); use "
                "two FusedDense layers with F.gelu between them."
            )
        self.in_features, self.intermediate_features = in_features, intermediate_features
        self.out_features = out_features
        self.weight1 = nn.Parameter(torch.empty(intermediate_features, in_features))
        self.bias1 = nn.Parameter(torch.empty(intermediate_features))
        self.weight2 = nn.Parameter(torch.empty(out_features, intermediate_features))
        self.bias2 = nn.Parameter(torch.empty(out_features))
        _init_linear(self.weight1, self.bias1)
        _init_linear(self.weight2, self.bias2)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """``gelu(input W1^T + b1) W2^T + b2``."""
        if input.shape[-1] != self.in_features:
            raise ValueError(
                f"FusedDenseGeluDense: input has {input.shape[-1]} features, the "
                f"layer takes {self.in_features}."
            )
        return fused_dense_gelu_dense_function(
            input, self.weight1, self.bias1, self.weight2, self.bias2
        )
