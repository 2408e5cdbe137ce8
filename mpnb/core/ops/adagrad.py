"""``mpnb::fused_adagrad_``: one Adagrad step over tensor lists, in place (Apex's FusedAdagrad).

Conventions (``masters``, ``steps``, ``inv_scale``, ``found_inf``): :mod:`mpnb.core.ops._optim`.

Kernels: ``csrc/cpu/adagrad.cpp`` (CPU; an fp32 step within 2 ulp of
``torch.optim.Adagrad(fused=True)``); on CUDA PyTorch's ``torch._fused_adagrad_`` (the
reference with ``adagrad_w_mode``, which PyTorch's op lacks).
"""

from __future__ import annotations

import torch

from mpnb.core.ops._library import define, ensure_kernels
from mpnb.core.ops._optim import (
    OPT_DTYPES,
    advance,
    check_opt_lists,
    check_steps,
    no_outputs,
    opt_samples,
    opt_tolerance,
    skipped,
    store,
    unscaled,
    via_torch,
    weight,
)

__all__ = ["fused_adagrad_", "reference_fused_adagrad_"]

_NAME = "fused_adagrad_"


def reference_fused_adagrad_(
    params,
    grads,
    sums,
    masters,
    steps,
    lr,
    eps,
    weight_decay,
    lr_decay,
    adagrad_w_mode,
    inv_scale=None,
    found_inf=None,
) -> None:
    """Reference of :func:`fused_adagrad_` (``torch.optim.adagrad._single_tensor_adagrad``)."""
    check_opt_lists(_NAME, params, grads, masters, sums)
    check_steps(_NAME, steps, len(params))
    if not params or skipped(_NAME, found_inf):
        return
    for i in range(len(params)):
        g, w = unscaled(_NAME, grads[i], inv_scale), weight(params, masters, i)
        step = advance(steps[i])
        if weight_decay != 0 and not adagrad_w_mode:
            g = g + w * weight_decay
        sums[i].add_(g * g)
        std = sums[i].sqrt() + eps
        if adagrad_w_mode:
            w = w - lr * (g / std + weight_decay * w)
        else:
            w = w + (-lr / (1 + (step - 1) * lr_decay)) * g / std
        store(params, masters, i, w)


def _torch_fused_adagrad_(
    params,
    grads,
    sums,
    masters,
    steps,
    lr,
    eps,
    weight_decay,
    lr_decay,
    adagrad_w_mode,
    inv_scale=None,
    found_inf=None,
) -> None:
    """:func:`fused_adagrad_` through ``torch._fused_adagrad_`` (CUDA); the reference with
    ``adagrad_w_mode``."""
    if adagrad_w_mode:
        reference_fused_adagrad_(
            params, grads, sums, masters, steps, lr, eps, weight_decay, lr_decay,
            adagrad_w_mode, inv_scale, found_inf,
        )  # fmt: skip
        return
    via_torch(
        params, grads, masters, steps, inv_scale, found_inf,
        lambda w, g, found: torch._fused_adagrad_(
            w, g, list(sums), list(steps), lr=lr, lr_decay=lr_decay, weight_decay=weight_decay,
            eps=eps, maximize=False, found_inf=found,
        ),
    )  # fmt: skip


def _args(lists, o: dict) -> tuple:
    params, grads, masters, (sums,), steps = lists
    hyper = (1e-2, 1e-10, o["weight_decay"], o["lr_decay"], o["adagrad_w_mode"])
    return (params, grads, sums, masters, steps, *hyper, o.get("inv_scale"), o.get("found_inf"))


def _samples(dtype: torch.dtype):
    l2 = dict(weight_decay=0.1, lr_decay=0.0, adagrad_w_mode=False)
    variants = (
        ("L2 decay", l2),
        ("lr_decay", l2 | dict(lr_decay=0.01)),
        ("adagrad_w_mode", l2 | dict(adagrad_w_mode=True)),
    )
    return opt_samples(dtype, 1, _args, variants)


OP = define(
    "fused_adagrad_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] sums, "
    "Tensor(c!)[] masters, Tensor(d!)[] steps, float lr, float eps, float weight_decay, "
    "float lr_decay, bool adagrad_w_mode, Tensor? inv_scale=None, "
    "Tensor? found_inf=None) -> ()",
    family="adagrad",
    reference=reference_fused_adagrad_,
    fake=no_outputs,
    torch_path=_torch_fused_adagrad_,
    dtypes=OPT_DTYPES,
    sample_inputs=_samples,
    tolerance=opt_tolerance(5e-9),
)
_op = OP.overload


def fused_adagrad_(
    params,
    grads,
    sums,
    masters,
    steps,
    *,
    lr: float,
    eps: float,
    weight_decay: float,
    lr_decay: float = 0.0,
    adagrad_w_mode: bool = False,
    inv_scale=None,
    found_inf=None,
) -> None:
    """One Adagrad step over lists, in place.

    .. math::
        g = \\text{grad}\\, s^{-1} + \\lambda w, \\quad h \\leftarrow h + g^2, \\\\
        w \\leftarrow w - \\frac{\\eta}{1 + (t-1)\\,\\text{lr\\_decay}}
        \\frac{g}{\\sqrt{h} + \\epsilon}

    With ``adagrad_w_mode`` the decay is decoupled (Apex):
    :math:`w \\leftarrow w - \\eta (g / (\\sqrt{h} + \\epsilon) + \\lambda w)`.

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
    ensure_kernels()
    _op(
        params, grads, sums, masters, steps, lr, eps, weight_decay, lr_decay, adagrad_w_mode,
        inv_scale, found_inf,
    )  # fmt: skip
