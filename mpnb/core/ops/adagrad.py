"""``mpnb::fused_adagrad_``: one Adagrad step over tensor lists, in place (Apex's FusedAdagrad).

Conventions (``masters``, ``steps``, ``inv_scale``, ``found_inf``): :mod:`mpnb.core.ops._optim`.

Kernels: ``csrc/cpu/adagrad.cpp`` (CPU; an fp32 step within 2 ulp of
``torch.optim.Adagrad(fused=True)``); on CUDA PyTorch's ``torch._fused_adagrad_`` (the
reference with ``adagrad_w_mode``, which PyTorch's op lacks).
"""

from __future__ import annotations

import torch

from mpnb.core.ops._library import Tensor, Tensors, call, define
from mpnb.core.ops._optim import (
    OPT_DTYPES,
    advance,
    check_step,
    commit,
    keep_of,
    opt_samples,
    opt_tolerance,
    store,
    unscaled,
    via_torch,
    weight,
)

__all__ = ["fused_adagrad_", "reference_fused_adagrad_"]


def reference_fused_adagrad_(
    params: Tensors,
    grads: Tensors,
    sums: Tensors,
    masters: Tensors,
    steps: Tensors,
    *,
    lr: float,
    eps: float,
    weight_decay: float,
    lr_decay: float = 0.0,
    adagrad_w_mode: bool = False,
    inv_scale: Tensor | None = None,
    found_inf: Tensor | None = None,
) -> None:
    """One Adagrad step over lists, in place.

    .. math::
        g = \\text{grad}\\, s^{-1} + \\lambda w, \\quad h \\leftarrow h + g^2, \\\\
        w \\leftarrow w - \\frac{\\eta}{1 + (t-1)\\,\\text{lr\\_decay}}
        \\frac{g}{\\sqrt{h} + \\epsilon}

    With ``adagrad_w_mode`` the decay is decoupled (Apex):
    :math:`w \\leftarrow w - \\eta (g / (\\sqrt{h} + \\epsilon) + \\lambda w)`. The reference
    is ``torch.optim.adagrad._single_tensor_adagrad``'s ops.

    Args:
        params: the weights (fp32, fp16 or bf16; one dtype), updated in place.
        grads: one grad per param (fp32, fp16 or bf16; one dtype), read only.
        sums: the fp32 sums of squared grads :math:`h`, updated in place.
        masters: empty, or fp32 master weights (updated; params get their rounded copy).
        steps: one one-element float32 tensor per param, advanced by the op.
        lr, eps, weight_decay, lr_decay: the hyper-parameters.
        adagrad_w_mode: decoupled weight decay (Apex's mode 1) instead of L2 decay.
        inv_scale: optional one-element tensor :math:`s^{-1}` multiplied into the grads.
        found_inf: optional one-element tensor; nonzero: the step writes nothing.

    Example::

        >>> p, g, h = [torch.randn(10)], [torch.randn(10)], [torch.zeros(10)]
        >>> fused_adagrad_(p, g, h, [], [torch.tensor(0.0)], lr=1e-2, eps=1e-10,
        ...                weight_decay=0.0)
    """
    if not params:
        return
    keep = keep_of(found_inf, params[0].device)
    for i in range(len(params)):
        g, w = unscaled(grads[i], inv_scale), weight(params, masters, i)
        step = advance(steps[i], keep)
        if weight_decay != 0 and not adagrad_w_mode:
            g = g + w * weight_decay
        h = sums[i] + g * g
        std = h.sqrt() + eps
        if adagrad_w_mode:
            w = w - lr * (g / std + weight_decay * w)
        else:
            w = w + (-lr / (1 + (step - 1) * lr_decay)).float() * g / std
        commit(keep, sums[i], h)
        store(params, masters, i, w, keep)


def _check(args, per_tensor: bool) -> None:
    check_step(args, per_tensor, "sums")


def _torch_fused_adagrad_(args) -> None:
    """:func:`fused_adagrad_` through ``torch._fused_adagrad_`` (CUDA); the reference with
    ``adagrad_w_mode``."""
    if args.adagrad_w_mode:
        call(reference_fused_adagrad_, args)
        return

    def fused(w, g, found):
        torch._fused_adagrad_(
            w,
            g,
            list(args.sums),
            list(args.steps),
            lr=args.lr,
            lr_decay=args.lr_decay,
            weight_decay=args.weight_decay,
            eps=args.eps,
            maximize=False,
            found_inf=found,
        )

    via_torch(args, fused)


def _samples(dtype: torch.dtype):
    l2 = dict(lr=1e-2, eps=1e-10, weight_decay=0.1, lr_decay=0.0, adagrad_w_mode=False)
    variants = (
        ("L2 decay", l2),
        ("lr_decay", l2 | dict(lr_decay=0.01)),
        ("adagrad_w_mode", l2 | dict(adagrad_w_mode=True)),
    )
    return opt_samples(dtype, ("sums",), variants)


OP = define(
    reference_fused_adagrad_,
    family="adagrad",
    mutates=("params", "sums", "masters", "steps"),
    check=_check,
    cuda=_torch_fused_adagrad_,
    dtypes=OPT_DTYPES,
    sample_inputs=_samples,
    tolerance=opt_tolerance(5e-9),
)
fused_adagrad_ = OP.wrapper
