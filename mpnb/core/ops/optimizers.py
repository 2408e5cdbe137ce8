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

Devices without a kernel of ours (CUDA) take PyTorch's own fused optimizer ops
(``torch._fused_adamw_``, ``_fused_adam_``, ``_fused_sgd_``, ``_fused_adagrad_``) through the
``_torch_fused_*`` paths below, which keep this module's contract: half params are updated
through fp32 weights (the masters, or fp32 copies) and cast back in one ``_foreach_copy_``;
grads are unscaled into fp32 copies (``grad * inv_scale``, as the kernels do; PyTorch's own
``grad_scale`` would divide and write the grads back) and never written; ``found_inf`` is
read on the device (no host sync) and a flagged step changes nothing, step counts included.
Options PyTorch's ops lack (no bias correction, ``adagrad_w_mode``, ``wd_after_momentum``)
fall back to the references, which are PyTorch ops too.
"""

from __future__ import annotations

import math

import torch

from mpnb.core.ops._registry import OpInfo, register_fake, register_op, use_kernel

__all__ = [
    "fused_adam_",
    "fused_adagrad_",
    "fused_sgd_",
    "reference_fused_adam_",
    "reference_fused_adagrad_",
    "reference_fused_sgd_",
]

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


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


# ---- PyTorch's fused ops, for devices without a kernel of ours ----------------------------


def _fp32_weights(params, masters) -> list[torch.Tensor]:
    # The fp32 tensors PyTorch's op updates: the masters, fp32 params themselves, or copies.
    if masters:
        return list(masters)
    return [p if p.dtype == torch.float32 else p.float() for p in params]


def _fp32_grads(grads, inv_scale) -> list[torch.Tensor]:
    # Always copies: PyTorch's CUDA fused ops write their (unscaled, decayed) grads back.
    g32 = [g.to(torch.float32, copy=True) for g in grads]
    if inv_scale is not None:
        inv = inv_scale.to(device=g32[0].device, dtype=torch.float32).reshape(())
        torch._foreach_mul_(g32, inv)
    return g32


def _flag(found_inf, device) -> torch.Tensor | None:
    if found_inf is None:
        return None
    return found_inf.to(device=device, dtype=torch.float32).reshape(())


def _finish(params, weights, steps, found) -> None:
    # Undo the step count of a flagged step (PyTorch's own recipe: no host sync), then cast.
    if found is not None and steps:
        torch._foreach_sub_(list(steps), [found] * len(steps))
    if params[0].dtype != torch.float32:
        torch._foreach_copy_(list(params), weights)


def _torch_fused_adam_(
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
) -> bool:
    """:func:`fused_adam_` through ``torch._fused_adamw_`` / ``_fused_adam_``; False when
    PyTorch's op cannot express the call (no bias correction)."""
    if not bias_correction:
        return False
    if not params:
        return True
    w, found = _fp32_weights(params, masters), _flag(found_inf, params[0].device)
    torch._foreach_add_(list(steps), 1)
    op = torch._fused_adamw_ if adam_w_mode else torch._fused_adam_
    op(
        w,
        _fp32_grads(grads, inv_scale),
        list(exp_avgs),
        list(exp_avg_sqs),
        [],
        list(steps),
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        weight_decay=weight_decay,
        eps=eps,
        amsgrad=False,
        maximize=False,
        found_inf=found,
    )
    _finish(params, w, steps, found)
    return True


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
) -> bool:
    """:func:`fused_adagrad_` through ``torch._fused_adagrad_``; False with adagrad_w_mode."""
    if adagrad_w_mode:
        return False
    if not params:
        return True
    w, found = _fp32_weights(params, masters), _flag(found_inf, params[0].device)
    torch._foreach_add_(list(steps), 1)
    torch._fused_adagrad_(
        w,
        _fp32_grads(grads, inv_scale),
        list(sums),
        list(steps),
        lr=lr,
        lr_decay=lr_decay,
        weight_decay=weight_decay,
        eps=eps,
        maximize=False,
        found_inf=found,
    )
    _finish(params, w, steps, found)
    return True


def _torch_fused_sgd_(
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
) -> bool:
    """:func:`fused_sgd_` through ``torch._fused_sgd_`` (one call per ``first_run`` value);
    False with wd_after_momentum."""
    if wd_after_momentum:
        return False
    if not params:
        return True
    w, found = _fp32_weights(params, masters), _flag(found_inf, params[0].device)
    g = _fp32_grads(grads, inv_scale)
    groups = {False: list(range(len(w)))}
    if momentum != 0:
        groups = {f: [i for i, x in enumerate(first_run) if bool(x) == f] for f in (False, True)}
    for first, idx in groups.items():
        if not idx:
            continue
        bufs = [momentum_buffers[i] for i in idx] if momentum != 0 else []
        torch._fused_sgd_(
            [w[i] for i in idx],
            [g[i] for i in idx],
            bufs,
            weight_decay=weight_decay,
            momentum=momentum,
            lr=lr,
            dampening=dampening,
            nesterov=nesterov,
            maximize=False,
            is_first_step=first,
            found_inf=found,
        )
    _finish(params, w, [], found)
    return True


def _on_other_device(params) -> bool:
    return bool(params) and params[0].device.type != "cpu"


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
    if use_kernel(params):
        torch.ops.mpnb.fused_adam_(*args)
    elif not (_on_other_device(params) and _torch_fused_adam_(*args)):
        reference_fused_adam_(*args)


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
    if use_kernel(params):
        torch.ops.mpnb.fused_adagrad_(*args)
    elif not (_on_other_device(params) and _torch_fused_adagrad_(*args)):
        reference_fused_adagrad_(*args)


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
    if use_kernel(params):
        torch.ops.mpnb.fused_sgd_(*args)
    elif not (_on_other_device(params) and _torch_fused_sgd_(*args)):
        reference_fused_sgd_(*args)


for _name in ("fused_adam_", "fused_adagrad_", "fused_sgd_"):
    register_fake(_name)(lambda *args, **kwargs: None)

for _name, _ref in (
    ("fused_adam_", reference_fused_adam_),
    ("fused_adagrad_", reference_fused_adagrad_),
    ("fused_sgd_", reference_fused_sgd_),
):
    register_op(OpInfo(_name, "optimizer", _ref, dtypes=_DTYPES))
