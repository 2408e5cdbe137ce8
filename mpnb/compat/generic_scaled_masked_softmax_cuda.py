"""Apex's ``generic_scaled_masked_softmax_cuda`` extension, on mpnb's masked softmax op.

Apex's generic kernel (any key length) is the masked softmax of ``[b, np, sq, sk]`` scores
with one difference: a row whose every position is masked attends to nothing (all zeros)
instead of spreading evenly over the masked positions. mpnb's op has that rule as an
argument (:func:`mpnb.core.ops.generic_scaled_masked_softmax_fwd`); the backward is the one
of every softmax, ``scale * y * (dy - sum(dy * y))``, which is zero on such rows.

Example::

    >>> import generic_scaled_masked_softmax_cuda as k     # under mpnb's Apex alias
    >>> y = k.forward(scores, mask, 1.0)                   # fully masked rows: zeros
    >>> dx = k.backward(dy, y, 1.0)
"""

from __future__ import annotations

import torch

from mpnb.core.ops.softmax import generic_scaled_masked_softmax_fwd, scaled_softmax_bwd

__all__ = ["forward", "backward"]


def _scale(scale) -> float:
    # Apex passes a float or one element of a tensor (``scale_t[0]``)
    return float(scale.item() if isinstance(scale, torch.Tensor) else scale)


def forward(inputs: torch.Tensor, mask: torch.Tensor, scale) -> torch.Tensor:
    """Softmax of ``inputs * scale`` with ``mask`` (True = masked) over the last dim.

    Args:
        inputs: ``[b, np, sq, sk]`` scores.
        mask: ``[b or 1, np or 1, sq, sk]`` bool (or uint8) mask.
        scale: a number (or a one-element tensor).
    """
    return generic_scaled_masked_softmax_fwd(inputs, mask, _scale(scale))


def backward(output_grads: torch.Tensor, softmax_results: torch.Tensor, scale) -> torch.Tensor:
    """The gradient of :func:`forward`'s input from its output and the output's gradient."""
    return scaled_softmax_bwd(output_grads, softmax_results, _scale(scale))
