"""Optimizer update ops (Adam, Adagrad, SGD): typed wrappers, references and fake kernels.

Every op updates lists of params in place. Shared conventions:

* ``masters``: empty, or one fp32 tensor per param. When given, the master is the weight
  that is updated and ``params`` (fp16/bf16) receive its rounded copy in the same pass.
* ``steps``: one one-element float32 tensor per param (PyTorch's fused-optimizer format),
  incremented by the op itself, so a skipped step never advances the count.
* ``inv_scale``: optional one-element tensor; grads are multiplied by it in fp32 on the fly.
* ``found_inf``: optional one-element tensor; when nonzero on entry the op writes nothing.
  The ops never set it: the caller runs :func:`mpnb.core.ops.multi_tensor_check_finite`
  over all grads first (see ``csrc/cpu/opt_common.h`` for why).

The references are written with PyTorch's elementwise ops in the order of
``torch.optim``'s single-tensor implementations; the kernels match them to a few ulp.

Devices without a kernel of ours (CUDA) take PyTorch's own fused optimizer ops through
:mod:`mpnb.core.ops.optimizers_torch`.
"""

from __future__ import annotations

import math

import torch

from mpnb.core.ops._registry import OpInfo, op_caller, register_fake, register_op, use_kernel
from mpnb.core.ops.multi_tensor import _check_lists
from mpnb.core.ops.optimizers_torch import (
    _torch_fused_adagrad_,
    _torch_fused_adam_,
    _torch_fused_sgd_,
)

__all__ = [
    "fused_adam_",
    "fused_adagrad_",
    "fused_sgd_",
    "reference_fused_adam_",
    "reference_fused_adagrad_",
    "reference_fused_sgd_",
]

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_opt_lists(op: str, params, grads, masters, *states) -> None:
    """The reference path's mirror of the kernels' list checks (``opt_common.h``), same errors.

    Params and grads: one dtype each, equal lengths and sizes; ``masters`` empty or one fp32
    tensor per param; every state list fp32 and the same sizes as ``params``.
    """
    _check_lists(op, params, grads=grads)
    if masters:
        _check_lists(op, params, masters=masters)
        if masters[0].dtype != torch.float32:
            raise TypeError(f"{op}: master weights must be float32, got {masters[0].dtype}.")
    for state in states:
        _check_lists(op, params, state=state)
        if state and state[0].dtype != torch.float32:
            raise TypeError(
                f"{op}: optimizer state must be float32, got {state[0].dtype}; keep state in "
                "fp32 (the optimizers do)."
            )


def _skipped(found_inf) -> bool:
    # The reference reads the flag on the host; the kernels read it in C++ (CPU memory).
    return found_inf is not None and bool(found_inf.reshape(()).item() != 0)


def _grad(g: torch.Tensor, inv_scale) -> torch.Tensor:
    g = g.float()
    if inv_scale is not None:
        g = g * inv_scale.to(device=g.device, dtype=torch.float32).reshape(())
    return g


def _weight(params, masters, i) -> torch.Tensor:
    return masters[i] if masters else params[i].float()


def _store(params, masters, i, w: torch.Tensor) -> None:
    if masters:
        masters[i].copy_(w)
    params[i].copy_(w)


def _advance(step: torch.Tensor) -> float:
    step.add_(1)
    return float(step.item())


def _on_other_device(params) -> bool:
    return bool(params) and params[0].device.type != "cpu"


def dispatch(name: str, args: tuple, reference, torch_path=None) -> None:
    """Run ``mpnb::name`` on our kernel, else PyTorch's fused op (devices without a kernel of
    ours, when ``torch_path`` accepts the call), else the reference; one signature for all."""
    params = args[0]
    if use_kernel(params):
        op_caller(name)(*args)
    elif not (torch_path is not None and _on_other_device(params) and torch_path(*args)):
        reference(*args)


# ---- Adam / AdamW ------------------------------------------------------------------------


def reference_fused_adam_(
    params,
    grads,
    exp_avgs,
    exp_avg_sqs,
    masters,
    steps,
    lr,
    beta1,
    beta2,
    eps,
    weight_decay,
    adam_w_mode,
    bias_correction,
    inv_scale=None,
    found_inf=None,
) -> None:
    """Reference of :func:`fused_adam_` (``torch.optim.adam._single_tensor_adam``'s ops)."""
    check_opt_lists("fused_adam_", params, grads, masters, exp_avgs, exp_avg_sqs)
    if _skipped(found_inf):
        return
    for i in range(len(params)):
        g, w = _grad(grads[i], inv_scale), _weight(params, masters, i).clone()
        m, v = exp_avgs[i], exp_avg_sqs[i]
        step = _advance(steps[i])
        if weight_decay != 0:
            if adam_w_mode:
                w.mul_(1 - lr * weight_decay)
            else:
                g = g.add(w, alpha=weight_decay)
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        bc1 = 1 - beta1**step if bias_correction else 1.0
        bc2 = 1 - beta2**step if bias_correction else 1.0
        denom = (v.sqrt() / math.sqrt(bc2)).add_(eps)
        w.addcdiv_(m, denom, value=-lr / bc1)
        _store(params, masters, i, w)


def fused_adam_(
    params,
    grads,
    exp_avgs,
    exp_avg_sqs,
    masters,
    steps,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adam_w_mode: bool,
    bias_correction: bool,
    inv_scale=None,
    found_inf=None,
) -> None:
    """One Adam (L2 decay) or AdamW (decoupled decay) step over lists, in place.

    .. math::
        g &= \\text{grad} \\cdot s^{-1} \\quad (+\\lambda w \\text{ without adam\\_w\\_mode}) \\\\
        m &\\leftarrow \\beta_1 m + (1-\\beta_1) g, \\qquad
        v \\leftarrow \\beta_2 v + (1-\\beta_2) g^2 \\\\
        w &\\leftarrow w (1 - \\eta\\lambda)_{\\text{adam\\_w\\_mode}}
             - \\frac{\\eta}{1-\\beta_1^t} \\frac{m}{\\sqrt{v}/\\sqrt{1-\\beta_2^t} + \\epsilon}

    See the module docstring for ``masters``, ``steps``, ``inv_scale`` and ``found_inf``.
    """
    args = (
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        masters,
        steps,
        float(lr),
        float(beta1),
        float(beta2),
        float(eps),
        float(weight_decay),
        bool(adam_w_mode),
        bool(bias_correction),
        inv_scale,
        found_inf,
    )
    dispatch("fused_adam_", args, reference_fused_adam_, _torch_fused_adam_)


# ---- Adagrad -----------------------------------------------------------------------------


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
    check_opt_lists("fused_adagrad_", params, grads, masters, sums)
    if _skipped(found_inf):
        return
    for i in range(len(params)):
        g, w = _grad(grads[i], inv_scale), _weight(params, masters, i).clone()
        step = _advance(steps[i])
        if weight_decay != 0 and not adagrad_w_mode:
            g = g + w * weight_decay
        sums[i].add_(g * g)
        std = sums[i].sqrt() + eps
        if adagrad_w_mode:
            w = w - lr * (g / std + weight_decay * w)
        else:
            w = w + (-lr / (1 + (step - 1) * lr_decay)) * g / std
        _store(params, masters, i, w)


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
    """
    args = (
        params,
        grads,
        sums,
        masters,
        steps,
        float(lr),
        float(eps),
        float(weight_decay),
        float(lr_decay),
        bool(adagrad_w_mode),
        inv_scale,
        found_inf,
    )
    dispatch("fused_adagrad_", args, reference_fused_adagrad_, _torch_fused_adagrad_)


# ---- SGD -----------------------------------------------------------------------------------


def reference_fused_sgd_(
    params,
    grads,
    momentum_buffers,
    masters,
    first_run,
    lr,
    momentum,
    dampening,
    weight_decay,
    nesterov,
    wd_after_momentum,
    inv_scale=None,
    found_inf=None,
) -> None:
    """Reference of :func:`fused_sgd_` (``torch.optim.sgd._single_tensor_sgd``'s ops)."""
    if momentum != 0:
        check_opt_lists("fused_sgd_", params, grads, masters, momentum_buffers)
    else:
        check_opt_lists("fused_sgd_", params, grads, masters)
    if _skipped(found_inf):
        return
    for i in range(len(params)):
        g, w = _grad(grads[i], inv_scale), _weight(params, masters, i).clone()
        if weight_decay != 0 and not wd_after_momentum:
            g = g.add(w, alpha=weight_decay)
        if momentum != 0:
            buf = momentum_buffers[i]
            if first_run[i]:
                buf.copy_(g)
            else:
                buf.mul_(momentum).add_(g, alpha=1 - dampening)
            g = g.add(buf, alpha=momentum) if nesterov else buf
        if weight_decay != 0 and wd_after_momentum:
            g = g.add(w, alpha=weight_decay)
        w.add_(g, alpha=-lr)
        _store(params, masters, i, w)


def fused_sgd_(
    params,
    grads,
    momentum_buffers,
    masters,
    first_run,
    *,
    lr: float,
    momentum: float = 0.0,
    dampening: float = 0.0,
    weight_decay: float = 0.0,
    nesterov: bool = False,
    wd_after_momentum: bool = False,
    inv_scale=None,
    found_inf=None,
) -> None:
    """One SGD step over lists, in place (``momentum_buffers`` may be empty without momentum).

    .. math::
        g = \\text{grad}\\, s^{-1} + \\lambda w, \\quad
        b \\leftarrow \\mu b + (1 - d) g \\;(b = g \\text{ on the first run}), \\quad
        g = g + \\mu b \\text{ (nesterov) or } b, \\quad w \\leftarrow w - \\eta g

    With ``wd_after_momentum`` the :math:`\\lambda w` term is added after the momentum.
    """
    args = (
        params,
        grads,
        momentum_buffers,
        masters,
        [bool(f) for f in first_run],
        float(lr),
        float(momentum),
        float(dampening),
        float(weight_decay),
        bool(nesterov),
        bool(wd_after_momentum),
        inv_scale,
        found_inf,
    )
    dispatch("fused_sgd_", args, reference_fused_sgd_, _torch_fused_sgd_)


for _name in ("fused_adam_", "fused_adagrad_", "fused_sgd_"):
    register_fake(_name)(lambda *args, **kwargs: None)

for _name, _ref in (
    ("fused_adam_", reference_fused_adam_),
    ("fused_adagrad_", reference_fused_adagrad_),
    ("fused_sgd_", reference_fused_sgd_),
):
    register_op(OpInfo(_name, "optimizer", _ref, dtypes=_DTYPES))
