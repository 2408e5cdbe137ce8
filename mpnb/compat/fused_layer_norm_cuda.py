"""Apex's ``fused_layer_norm_cuda`` extension: its forward/backward functions on mpnb's ops.

Code that writes its own autograd Function around Apex's kernels (Megatron's and fairseq's
layer norms do) calls these. Each runs mpnb's layer/RMS norm op (the C++ kernel on CPU,
PyTorch's ops on CUDA, the reference otherwise) without recording autograd, as the extension
did. Statistics are fp32 for half input; ``mean``/``invvar`` have one value per normalized
row. The ``*_mixed_dtypes`` forms take fp32 weights with a half input and, like
:mod:`mpnb.normalization`, return the input's dtype (Apex's returned the weight's).

Example::

    >>> import fused_layer_norm_cuda          # under mpnb's Apex alias
    >>> y, mean, invvar = fused_layer_norm_cuda.forward_affine(x, [64], w, b, 1e-5)
    >>> dx, dw, db = fused_layer_norm_cuda.backward_affine(dy, mean, invvar, x, [64], w, b, 1e-5)
"""

from __future__ import annotations

import numbers

import torch

from mpnb.core.ops import layer_norm_bwd, layer_norm_fwd, rms_norm_bwd, rms_norm_fwd

__all__ = [
    "forward",
    "forward_affine",
    "forward_affine_mixed_dtypes",
    "backward",
    "backward_affine",
    "rms_forward",
    "rms_forward_affine",
    "rms_forward_affine_mixed_dtypes",
    "rms_backward",
    "rms_backward_affine",
]


def _shape(normalized_shape) -> list[int]:
    if isinstance(normalized_shape, numbers.Integral):
        return [int(normalized_shape)]
    return [int(s) for s in normalized_shape]


@torch.no_grad()
def forward_affine(input, normalized_shape, gamma, beta, epsilon):
    """``[output, mean, invvar]`` of layer norm with weight ``gamma`` and bias ``beta``."""
    return list(layer_norm_fwd(input, _shape(normalized_shape), gamma, beta, epsilon))


@torch.no_grad()
def forward(input, normalized_shape, epsilon):
    """``[output, mean, invvar]`` of layer norm without affine parameters."""
    return list(layer_norm_fwd(input, _shape(normalized_shape), None, None, epsilon))


forward_affine_mixed_dtypes = forward_affine


@torch.no_grad()
def backward_affine(
    dout,
    mean,
    invvar,
    input_or_output,
    normalized_shape,
    gamma,
    beta,
    epsilon,
    memory_efficient=False,
):
    """``[grad_input, grad_gamma, grad_beta]``; ``input_or_output`` is the output when
    ``memory_efficient`` (``epsilon`` is accepted for Apex's signature)."""
    shape = _shape(normalized_shape)
    return list(
        layer_norm_bwd(dout, input_or_output, mean, invvar, shape, gamma, beta, memory_efficient)
    )


@torch.no_grad()
def backward(
    dout, mean, invvar, input_or_output, normalized_shape, epsilon, memory_efficient=False
):
    """``grad_input`` of layer norm without affine parameters."""
    shape = _shape(normalized_shape)
    return layer_norm_bwd(dout, input_or_output, mean, invvar, shape, None, None, memory_efficient)[
        0
    ]


@torch.no_grad()
def rms_forward_affine(input, normalized_shape, gamma, epsilon):
    """``[output, invvar]`` of RMS norm with weight ``gamma``."""
    return list(rms_norm_fwd(input, _shape(normalized_shape), gamma, epsilon))


@torch.no_grad()
def rms_forward(input, normalized_shape, epsilon):
    """``[output, invvar]`` of RMS norm without a weight."""
    return list(rms_norm_fwd(input, _shape(normalized_shape), None, epsilon))


rms_forward_affine_mixed_dtypes = rms_forward_affine


@torch.no_grad()
def rms_backward_affine(
    dout, invvar, input_or_output, normalized_shape, gamma, epsilon, memory_efficient=False
):
    """``[grad_input, grad_gamma]`` of RMS norm."""
    shape = _shape(normalized_shape)
    return list(rms_norm_bwd(dout, input_or_output, invvar, shape, gamma, memory_efficient))


@torch.no_grad()
def rms_backward(dout, invvar, input_or_output, normalized_shape, epsilon, memory_efficient=False):
    """``grad_input`` of RMS norm without a weight."""
    shape = _shape(normalized_shape)
    return rms_norm_bwd(dout, input_or_output, invvar, shape, None, memory_efficient)[0]
