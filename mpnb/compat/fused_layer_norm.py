"""Apex's ``apex.normalization.fused_layer_norm`` module: mpnb's layers plus Apex's Function names.

The modules and functions are :mod:`mpnb.core.normalization.fused_layer_norm`'s. Apex also
exposed its autograd Functions, which client code calls directly
(``FusedLayerNormAffineFunction.apply(x, w, b, shape, eps)``); here each such name is a class
whose ``apply`` runs the same differentiable mpnb op as the functional form, with Apex's
argument order. The mixed-dtype forms return the input's dtype, as in
:mod:`mpnb.normalization` (Apex's returned the weight's).

Example::

    >>> from apex.normalization.fused_layer_norm import FusedLayerNormAffineFunction
    >>> y = FusedLayerNormAffineFunction.apply(x, weight, bias, (64,), 1e-5)
"""

from __future__ import annotations

import importlib

from mpnb.core.normalization.fused_layer_norm import *  # noqa: F401,F403

# The module itself (``mpnb.core.normalization.fused_layer_norm`` as an attribute of its package
# is the function of that name).
_ln = importlib.import_module("mpnb.core.normalization.fused_layer_norm")

__all__ = [
    *_ln.__all__,
    "FusedLayerNormAffineFunction",
    "FusedLayerNormFunction",
    "FusedLayerNormAffineMixedDtypesFunction",
    "FusedRMSNormAffineFunction",
    "FusedRMSNormFunction",
    "FusedRMSNormAffineMixedDtypesFunction",
]


class FusedLayerNormAffineFunction:
    """Apex's Function name: ``apply(input, weight, bias, normalized_shape, eps,
    memory_efficient=False)`` is :func:`fused_layer_norm_affine`."""

    @staticmethod
    def apply(input, weight, bias, normalized_shape, eps, memory_efficient=False):
        """Layer norm with affine parameters (differentiable)."""
        return _ln.fused_layer_norm_affine(
            input, weight, bias, normalized_shape, eps, memory_efficient
        )


class FusedLayerNormAffineMixedDtypesFunction:
    """Apex's Function name: ``apply(input, weight, bias, normalized_shape, eps,
    memory_efficient=False)`` is :func:`mixed_dtype_fused_layer_norm_affine`."""

    @staticmethod
    def apply(input, weight, bias, normalized_shape, eps, memory_efficient=False):
        """Layer norm of a half input with fp32 affine parameters (differentiable)."""
        return _ln.mixed_dtype_fused_layer_norm_affine(
            input, weight, bias, normalized_shape, eps, memory_efficient
        )


class FusedLayerNormFunction:
    """Apex's Function name: ``apply(input, normalized_shape, eps, memory_efficient=False)``
    is :func:`fused_layer_norm`."""

    @staticmethod
    def apply(input, normalized_shape, eps, memory_efficient=False):
        """Layer norm without affine parameters (differentiable)."""
        return _ln.fused_layer_norm(input, normalized_shape, eps, memory_efficient)


class FusedRMSNormAffineFunction:
    """Apex's Function name: ``apply(input, weight, normalized_shape, eps,
    memory_efficient=False)`` is :func:`fused_rms_norm_affine`."""

    @staticmethod
    def apply(input, weight, normalized_shape, eps, memory_efficient=False):
        """RMS norm with a weight (differentiable)."""
        return _ln.fused_rms_norm_affine(input, weight, normalized_shape, eps, memory_efficient)


class FusedRMSNormAffineMixedDtypesFunction:
    """Apex's Function name: ``apply(input, weight, normalized_shape, eps,
    memory_efficient=False)`` is :func:`mixed_dtype_fused_rms_norm_affine`."""

    @staticmethod
    def apply(input, weight, normalized_shape, eps, memory_efficient=False):
        """RMS norm of a half input with an fp32 weight (differentiable)."""
        return _ln.mixed_dtype_fused_rms_norm_affine(
            input, weight, normalized_shape, eps, memory_efficient
        )


class FusedRMSNormFunction:
    """Apex's Function name: ``apply(input, normalized_shape, eps, memory_efficient=False)``
    is :func:`fused_rms_norm`."""

    @staticmethod
    def apply(input, normalized_shape, eps, memory_efficient=False):
        """RMS norm without a weight (differentiable)."""
        return _ln.fused_rms_norm(input, normalized_shape, eps, memory_efficient)
