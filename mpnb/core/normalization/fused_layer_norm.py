"""Apex's ``apex.normalization``: fused layer norm and RMS norm, functions and modules.

Every function takes the input, optional affine parameters and ``normalized_shape`` (the
trailing dims to normalize over) and runs mpnb's C++ kernel on CPU tensors (statistics in fp32
for fp16/bf16 input), PyTorch's own ops on CUDA, or the pure-PyTorch reference without the
kernels. ``memory_efficient=True`` saves the output instead of the input for the backward,
which recomputes ``xhat = (y - bias) / weight`` (as Apex does: weights must not be zero).
The ``mixed_dtype_*`` forms take fp32 weights with a half input and return the input's dtype.
Inside a ``torch.autocast`` region every function runs in the region's dtype (input and
parameters cast to it, as Apex's do), so its output is the region's dtype.

In an fp16 region on the CPU, layer norm rounds as PyTorch's fp16 layer norm does there, the
one Apex's autocast test compares with: PyTorch's CPU ``native_layer_norm`` computes the mean
and rstd in fp32, writes the output from them (rounded once to fp16, as mpnb's is), and saves
them in fp16 for its backward. mpnb's layer norm saves fp16-rounded statistics too
(``torch_stats`` of :func:`mpnb.core.ops.layer_norm_fwd`), so its input gradient is within
Apex's fp16 tolerance (``rtol=1e-3, atol=1e-5``) of PyTorch's. This costs accuracy, PyTorch's
own: on Apex's test shapes (16 x [32, 16], x ~ randn, dy ~ rand, 200 seeds), the input
gradient's error against fp64 is at most 5.3e-4 (mean 6.0e-5) for PyTorch's and for mpnb's,
against 2.4e-4 (mean 4.2e-5) with fp32 statistics, which left 3593 of 1.6M elements outside
that tolerance. On CUDA, PyTorch's kernel keeps fp32 statistics and so does mpnb's; bf16
regions, and every call outside a region, keep fp32 statistics as well. The weight and bias
gradients are summed in fp32 and rounded once (PyTorch's CPU kernel sums each thread's rows
in fp16 partials).
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import torch
from torch import nn

from mpnb.core.amp.casts import in_autocast_dtype
from mpnb.core.ops._norm import check_eps
from mpnb.core.ops.layer_norm import layer_norm_fwd
from mpnb.core.ops.rms_norm import rms_norm_fwd

__all__ = [
    "FusedLayerNorm",
    "FusedRMSNorm",
    "MixedFusedLayerNorm",
    "MixedFusedRMSNorm",
    "fused_layer_norm",
    "fused_layer_norm_affine",
    "fused_rms_norm",
    "fused_rms_norm_affine",
    "mixed_dtype_fused_layer_norm_affine",
    "mixed_dtype_fused_rms_norm_affine",
]


def _shape(normalized_shape) -> list[int]:
    if isinstance(normalized_shape, numbers.Integral):
        return [int(normalized_shape)]
    return [int(s) for s in normalized_shape]


def _in_region(input) -> bool:
    # read before in_autocast_dtype, which runs the op with autocast off
    return isinstance(input, torch.Tensor) and torch.is_autocast_enabled(input.device.type)


def _ln(input, normalized_shape, weight, bias, eps, memory_efficient, torch_stats):
    out = layer_norm_fwd(input, normalized_shape, weight, bias, eps, memory_efficient, torch_stats)
    return out[0]


def _layer_norm(input, normalized_shape, weight, bias, eps, memory_efficient):
    shape, region = _shape(normalized_shape), _in_region(input)
    return in_autocast_dtype(_ln, input, shape, weight, bias, eps, memory_efficient, region)


def _rms(input, normalized_shape, weight, eps, memory_efficient):
    return rms_norm_fwd(input, normalized_shape, weight, eps, memory_efficient)[0]


def fused_layer_norm_affine(
    input, weight, bias, normalized_shape, eps=1e-6, memory_efficient=False
):
    """``(x - mean) / sqrt(var + eps) * weight + bias`` over the trailing ``normalized_shape``.

    Example::

        >>> x = torch.randn(2, 5, 16, dtype=torch.bfloat16)
        >>> w, b = torch.ones(16, dtype=torch.bfloat16), torch.zeros(16, dtype=torch.bfloat16)
        >>> fused_layer_norm_affine(x, w, b, [16]).shape
        torch.Size([2, 5, 16])
    """
    return _layer_norm(input, normalized_shape, weight, bias, eps, memory_efficient)


def fused_layer_norm(input, normalized_shape, eps=1e-6, memory_efficient=False):
    """Layer norm without affine parameters."""
    return _layer_norm(input, normalized_shape, None, None, eps, memory_efficient)


def mixed_dtype_fused_layer_norm_affine(
    input, weight, bias, normalized_shape, eps=1e-6, memory_efficient=False
):
    """Layer norm of a half input with fp32 ``weight``/``bias``; output in the input dtype."""
    return _layer_norm(input, normalized_shape, weight, bias, eps, memory_efficient)


def fused_rms_norm_affine(input, weight, normalized_shape, eps=1e-6, memory_efficient=False):
    """``x / sqrt(mean(x^2) + eps) * weight`` over the trailing ``normalized_shape``."""
    return in_autocast_dtype(_rms, input, _shape(normalized_shape), weight, eps, memory_efficient)


def fused_rms_norm(input, normalized_shape, eps=1e-6, memory_efficient=False):
    """RMS norm without a weight."""
    return in_autocast_dtype(_rms, input, _shape(normalized_shape), None, eps, memory_efficient)


def mixed_dtype_fused_rms_norm_affine(
    input, weight, normalized_shape, eps=1e-6, memory_efficient=False
):
    """RMS norm of a half input with an fp32 ``weight``; the output has the input's dtype."""
    return in_autocast_dtype(_rms, input, _shape(normalized_shape), weight, eps, memory_efficient)


class FusedLayerNorm(nn.Module):
    """Drop-in for ``torch.nn.LayerNorm`` (and Apex's ``FusedLayerNorm``) on mpnb's kernels.

    Args:
        normalized_shape: the trailing dims to normalize over (an int or a sequence).
        eps: added to the variance; a finite number >= 0 (a ValueError otherwise).
        elementwise_affine: learn a ``weight`` (ones) and ``bias`` (zeros).
        memory_efficient: save the output, not the input, for the backward.

    Example::

        >>> ln = FusedLayerNorm(1024)
        >>> ln(torch.randn(8, 1024)).shape
        torch.Size([8, 1024])
    """

    def __init__(
        self,
        normalized_shape: int | Sequence[int],
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        memory_efficient: bool = False,
    ) -> None:
        super().__init__()
        self.normalized_shape = torch.Size(_shape(normalized_shape))
        self.eps = check_eps(eps, type(self).__name__)
        self.elementwise_affine = elementwise_affine
        self.memory_efficient = memory_efficient
        if elementwise_affine:
            self.weight = nn.Parameter(torch.ones(self.normalized_shape))
            self.bias = nn.Parameter(torch.zeros(self.normalized_shape))
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)

    def reset_parameters(self) -> None:
        """Weight to ones, bias to zeros."""
        if self.elementwise_affine:
            nn.init.ones_(self.weight)
            nn.init.zeros_(self.bias)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """Normalize ``input`` over its trailing ``normalized_shape`` dims."""
        if self.elementwise_affine:
            return fused_layer_norm_affine(
                input,
                self.weight,
                self.bias,
                self.normalized_shape,
                self.eps,
                self.memory_efficient,
            )
        return fused_layer_norm(input, self.normalized_shape, self.eps, self.memory_efficient)

    def extra_repr(self) -> str:
        return (
            f"{tuple(self.normalized_shape)}, eps={self.eps}, elementwise_affine="
            f"{self.elementwise_affine}, memory_efficient={self.memory_efficient}"
        )


class FusedRMSNorm(nn.Module):
    """RMS norm (``torch.nn.RMSNorm`` semantics, Apex's ``FusedRMSNorm``) on mpnb's kernels.

    Args:
        normalized_shape: the trailing dims to normalize over.
        eps: added to the mean square; a finite number >= 0 (a ValueError otherwise).
        elementwise_affine: learn a ``weight`` (ones).
        memory_efficient: save the output, not the input, for the backward.
    """

    def __init__(
        self,
        normalized_shape: int | Sequence[int],
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        memory_efficient: bool = False,
    ) -> None:
        super().__init__()
        self.normalized_shape = torch.Size(_shape(normalized_shape))
        self.eps = check_eps(eps, type(self).__name__)
        self.elementwise_affine = elementwise_affine
        self.memory_efficient = memory_efficient
        if elementwise_affine:
            self.weight = nn.Parameter(torch.ones(self.normalized_shape))
        else:
            self.register_parameter("weight", None)

    def reset_parameters(self) -> None:
        """Weight to ones."""
        if self.elementwise_affine:
            nn.init.ones_(self.weight)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """Normalize ``input`` over its trailing ``normalized_shape`` dims."""
        if self.elementwise_affine:
            return fused_rms_norm_affine(
                input, self.weight, self.normalized_shape, self.eps, self.memory_efficient
            )
        return fused_rms_norm(input, self.normalized_shape, self.eps, self.memory_efficient)

    def extra_repr(self) -> str:
        return (
            f"{tuple(self.normalized_shape)}, eps={self.eps}, elementwise_affine="
            f"{self.elementwise_affine}, memory_efficient={self.memory_efficient}"
        )


def _check_mixed_kwargs(cls: str, kwargs: dict) -> None:
    if "elementwise_affine" in kwargs and not kwargs["elementwise_affine"]:
        raise ValueError(
            f"{cls} always has fp32 affine parameters; drop elementwise_affine=False "
            "or use FusedLayerNorm/FusedRMSNorm without affine parameters."
        )
    unknown = set(kwargs) - {"elementwise_affine"}
    if unknown:
        raise TypeError(f"{cls}: unexpected arguments {sorted(unknown)}.")


class MixedFusedLayerNorm(FusedLayerNorm):
    """Layer norm with fp32 parameters for a half (fp16/bf16) input; output in the input dtype.

    Keep this module in fp32 when the rest of the model is cast to half (``model.half()``
    would cast its parameters too; cast them back or build the model with O2, which keeps
    norms in fp32).
    """

    def __init__(
        self, normalized_shape, eps: float = 1e-5, *, memory_efficient: bool = False, **kwargs
    ) -> None:
        _check_mixed_kwargs("MixedFusedLayerNorm", kwargs)
        super().__init__(normalized_shape, eps, True, memory_efficient)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """Normalize ``input``; fp32 weights, output in ``input.dtype``."""
        return mixed_dtype_fused_layer_norm_affine(
            input, self.weight, self.bias, self.normalized_shape, self.eps, self.memory_efficient
        )


class MixedFusedRMSNorm(FusedRMSNorm):
    """RMS norm with an fp32 weight for a half input; output in the input dtype."""

    def __init__(
        self, normalized_shape, eps: float = 1e-5, *, memory_efficient: bool = False, **kwargs
    ) -> None:
        _check_mixed_kwargs("MixedFusedRMSNorm", kwargs)
        super().__init__(normalized_shape, eps, True, memory_efficient)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """Normalize ``input``; fp32 weight, output in ``input.dtype``."""
        return mixed_dtype_fused_rms_norm_affine(
            input, self.weight, self.normalized_shape, self.eps, self.memory_efficient
        )
