r"""Apex's ``fused_adam_cuda`` extension (the first FusedAdam's kernel) in torch ops.

fairseq's ``FusedAdamV1`` and other Apex-era optimizers call ``fused_adam_cuda.adam`` on one
parameter at a time. This module computes exactly what that kernel computed, in fp32 with
PyTorch's own elementwise ops (a compatibility surface: mpnb's fused Adam,
:class:`mpnb.optimizers.FusedAdam`, implements today's Adam/AdamW instead):

.. math::
    g &= \text{grad} / \text{grad\_scale}, \quad
    m \leftarrow \beta_1 m + (1-\beta_1) g, \quad v \leftarrow \beta_2 v + (1-\beta_2) g^2 \\
    d &= \sqrt{v + \epsilon}\ (\text{mode } 0) \ \text{or}\ \sqrt{v} + \epsilon\ (\text{mode } 1),
    \quad p \leftarrow p - s\,(m / d + \text{decay}\cdot p)

with :math:`s = \text{lr}\sqrt{1-\beta_2^t}/(1-\beta_1^t)` under bias correction, else lr.
``p_copy`` (when not empty) receives the new ``p`` in its own dtype (the fp16 model copy).

Example::

    >>> import fused_adam_cuda               # under mpnb's Apex alias
    >>> fused_adam_cuda.adam(p, torch.empty(0), m, v, g, 1e-3, 0.9, 0.999, 1e-8, 1.0, 1, 1, 1, 0.0)
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = ["adam", "adam_mt"]


@torch.no_grad()
def adam(
    p: torch.Tensor,
    p_copy: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    grad_scale: float,
    step: int,
    mode: int,
    bias_correction: int,
    decay: float,
) -> None:
    """One Adam step of one parameter, in place (Apex's ``fused_adam_cuda.adam``).

    Args:
        p, m, v: the fp32 parameter and its moments (updated in place).
        p_copy: an empty tensor, or a half copy of ``p`` to write the result to.
        g: the (possibly scaled, possibly half) gradient.
        grad_scale: ``g`` is divided by it first.
        step: the step number, from 1. mode: 0 puts ``eps`` inside the square root, 1 outside.
        bias_correction: 1 to correct the moments' bias. decay: added as ``decay * p``.
    """
    for name, t in (("m", m), ("v", v), ("g", g)):
        if t.numel() != p.numel():
            raise ValueError(
                f"fused_adam_cuda.adam: {name} has {t.numel()} elements but p has {p.numel()}; "
                "pass the moments and gradient of this parameter."
            )
    if p_copy.numel() not in (0, p.numel()):
        raise ValueError(
            f"fused_adam_cuda.adam: p_copy has {p_copy.numel()} elements; pass an empty tensor "
            f"or a copy of p ({p.numel()} elements)."
        )
    if mode not in (0, 1):
        raise ValueError(f"fused_adam_cuda.adam: mode is 0 or 1 (eps inside/outside), got {mode}.")
    step_size = lr
    if bias_correction == 1:
        step_size = lr * math.sqrt(1 - beta2**step) / (1 - beta1**step)
    grad = g.to(torch.float32).view_as(p) / grad_scale
    m.mul_(beta1).add_(grad, alpha=1 - beta1)
    v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    denom = (v + eps).sqrt_() if mode == 0 else v.sqrt().add_(eps)
    update = (m / denom).add_(p, alpha=decay)
    p.add_(update, alpha=-step_size)
    if p_copy.numel():
        p_copy.copy_(p.view_as(p_copy))


def adam_mt(
    chunk_size: int,
    noop_flag: torch.Tensor,
    tensor_lists: Sequence[Sequence[torch.Tensor]],
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    grad_scale: float,
    step: int,
    mode: int,
    bias_correction: int,
    decay: float,
) -> None:
    """:func:`adam` over ``tensor_lists = [p, m, v, g]`` or ``[p, m, v, g, p_copy]``.

    Nothing is written when ``noop_flag`` is set on entry (Apex's overflow skip);
    ``chunk_size`` is accepted for Apex's signature.
    """
    if len(tensor_lists) not in (4, 5):
        raise ValueError(
            f"fused_adam_cuda.adam_mt: expected 4 or 5 tensor lists [p, m, v, g(, p_copy)], "
            f"got {len(tensor_lists)}."
        )
    if bool(noop_flag.item()):
        return
    ps, ms, vs, gs = (list(t) for t in tensor_lists[:4])
    copies = list(tensor_lists[4]) if len(tensor_lists) == 5 else [p.new_empty(0) for p in ps]
    for p, m, v, g, pc in zip(ps, ms, vs, gs, copies, strict=True):
        adam(p, pc, m, v, g, lr, beta1, beta2, eps, grad_scale, step, mode, bias_correction, decay)
