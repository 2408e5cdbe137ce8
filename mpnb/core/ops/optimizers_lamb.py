"""Layer-wise optimizer ops (LAMB, NovoGrad): typed wrappers, references and fake kernels.

Conventions (``masters``, ``steps``, ``inv_scale``, ``found_inf``) are those of
:mod:`mpnb.core.ops.optimizers`. The per-call reductions that span every dtype bucket (LAMB's
global grad norm, NovoGrad's per-tensor grad norms) are computed by the caller and passed in.
"""

from __future__ import annotations

import math

import torch

from mpnb.core.ops._registry import OpInfo, register_fake, register_op
from mpnb.core.ops.optimizers import (
    _advance,
    _grad,
    _skipped,
    _store,
    _weight,
    check_opt_lists,
    dispatch,
)

__all__ = ["fused_lamb_", "fused_novograd_", "reference_fused_lamb_", "reference_fused_novograd_"]

_F32 = torch.float32


def _f(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=_F32)


# ---- LAMB ----------------------------------------------------------------------------------


def _lamb_update(w, g, m, v, clip, wd, beta1, beta3, beta2, eps, bc1, bc2, adam_w_mode):
    g = g / clip
    if wd != 0 and not adam_w_mode:
        g = g + _f(wd) * w
    m.copy_(m * _f(beta1) + _f(beta3) * g)
    v.copy_(v * _f(beta2) + _f(1 - beta2) * g * g)
    u = (m / _f(bc1)) / ((v / _f(bc2)).sqrt() + _f(eps))
    if wd != 0 and adam_w_mode:
        u = u + _f(wd) * w
    return u


def reference_fused_lamb_(
    params,
    grads,
    exp_avgs,
    exp_avg_sqs,
    masters,
    steps,
    global_grad_norm,
    lr,
    beta1,
    beta2,
    eps,
    weight_decay,
    adam_w_mode,
    bias_correction,
    grad_averaging,
    max_grad_norm,
    use_nvlamb,
    inv_scale=None,
    found_inf=None,
) -> None:
    """Reference of :func:`fused_lamb_`, written from the LAMB paper (You et al., 2019)."""
    check_opt_lists("fused_lamb_", params, grads, masters, exp_avgs, exp_avg_sqs)
    if _skipped(found_inf):
        return
    gnorm = global_grad_norm.reshape(()).to("cpu", _F32)
    clip = gnorm / _f(max_grad_norm) if 0 < max_grad_norm < gnorm.item() else _f(1.0)
    beta3 = 1 - beta1 if grad_averaging else 1.0
    for i in range(len(params)):
        g, w = _grad(grads[i], inv_scale), _weight(params, masters, i).clone()
        step = _advance(steps[i])
        bc1 = 1 - beta1**step if bias_correction else 1.0
        bc2 = 1 - beta2**step if bias_correction else 1.0
        m, v = exp_avgs[i].clone(), exp_avg_sqs[i].clone()
        u = _lamb_update(
            w,
            g,
            m,
            v,
            clip.to(w.device),
            weight_decay,
            beta1,
            beta3,
            beta2,
            eps,
            bc1,
            bc2,
            adam_w_mode,
        )
        ratio = _f(lr)
        if use_nvlamb or weight_decay != 0:
            pn = _f(w.double().square().sum().sqrt().item())
            un = _f(u.double().square().sum().sqrt().item())
            if pn.item() != 0 and un.item() != 0:
                ratio = _f(lr) * (pn / un)
        exp_avgs[i].copy_(m)
        exp_avg_sqs[i].copy_(v)
        _store(params, masters, i, w - ratio.to(w.device) * u)


def fused_lamb_(
    params,
    grads,
    exp_avgs,
    exp_avg_sqs,
    masters,
    steps,
    global_grad_norm,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adam_w_mode: bool = True,
    bias_correction: bool = True,
    grad_averaging: bool = True,
    max_grad_norm: float = 1.0,
    use_nvlamb: bool = False,
    inv_scale=None,
    found_inf=None,
) -> None:
    """One LAMB step over lists, in place.

    .. math::
        g &= \\frac{\\text{grad}\\, s^{-1}}{\\max(1, \\lVert G \\rVert / \\text{max\\_grad\\_norm})}
             \\quad (+\\lambda w \\text{ without adam\\_w\\_mode}) \\\\
        m &\\leftarrow \\beta_1 m + \\beta_3 g, \\quad v \\leftarrow \\beta_2 v + (1-\\beta_2) g^2,
        \\quad \\beta_3 = 1-\\beta_1 \\text{ with grad\\_averaging, else } 1 \\\\
        u &= \\frac{m / (1-\\beta_1^t)}{\\sqrt{v / (1-\\beta_2^t)} + \\epsilon}
             \\quad (+\\lambda w \\text{ with adam\\_w\\_mode}) \\\\
        w &\\leftarrow w - \\eta\\, r\\, u, \\quad r = \\lVert w \\rVert / \\lVert u \\rVert
             \\text{ per tensor (1 when a norm is 0, or without decay and use\\_nvlamb)}

    Args:
        global_grad_norm: one-element tensor, the L2 norm of *all* unscaled grads of the step
            (every group and dtype). ``max_grad_norm <= 0`` disables the clipping.
    """
    args = (
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        masters,
        steps,
        global_grad_norm,
        float(lr),
        float(beta1),
        float(beta2),
        float(eps),
        float(weight_decay),
        bool(adam_w_mode),
        bool(bias_correction),
        bool(grad_averaging),
        float(max_grad_norm),
        bool(use_nvlamb),
        inv_scale,
        found_inf,
    )
    dispatch("fused_lamb_", args, reference_fused_lamb_)


# ---- NovoGrad ------------------------------------------------------------------------------


def reference_fused_novograd_(
    params,
    grads,
    exp_avgs,
    exp_avg_sqs,
    masters,
    steps,
    grad_norms,
    lr,
    beta1,
    beta2,
    eps,
    weight_decay,
    bias_correction,
    grad_averaging,
    reg_inside_moment,
    norm_type,
    init_zero,
    inv_scale=None,
    found_inf=None,
) -> None:
    """Reference of :func:`fused_novograd_`, written from the NovoGrad paper (Ginsburg, 2019)."""
    check_opt_lists("fused_novograd_", params, grads, masters, exp_avgs)
    if _skipped(found_inf):
        return
    beta3 = 1 - beta1 if grad_averaging else 1.0
    norms = grad_norms.to("cpu", _F32)
    for i in range(len(params)):
        g, w = _grad(grads[i], inv_scale), _weight(params, masters, i).clone()
        step = _advance(steps[i])
        v, gn = exp_avg_sqs[i].reshape(()), norms[i]
        if step == 1 and not init_zero:
            v.copy_(gn)
        elif norm_type == 2:
            v.copy_((_f(beta2) * (v * v) + _f(1 - beta2) * (gn * gn)).sqrt())
        else:
            v.copy_(_f(beta2) * v + _f(1 - beta2) * gn)
        bc1 = _f(1 - beta1**step if bias_correction else 1.0)
        bc2 = _f(math.sqrt(1 - beta2**step) if bias_correction else 1.0)
        denom = (v.cpu() / bc2 + _f(eps)).to(w.device)
        m = exp_avgs[i]
        if reg_inside_moment:
            g = g / denom + _f(weight_decay) * w
            m.copy_(_f(beta1) * m + _f(beta3) * g)
            w = w - _f(lr) * (m / bc1)
        else:
            m.copy_(_f(beta1) * m + _f(beta3) * g)
            w = w - _f(lr) * ((m / bc1) / denom + _f(weight_decay) * w)
        _store(params, masters, i, w)


def fused_novograd_(
    params,
    grads,
    exp_avgs,
    exp_avg_sqs,
    masters,
    steps,
    grad_norms,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    bias_correction: bool = True,
    grad_averaging: bool = True,
    reg_inside_moment: bool = False,
    norm_type: int = 2,
    init_zero: bool = False,
    inv_scale=None,
    found_inf=None,
) -> None:
    """One NovoGrad step over lists, in place; the second moment is one scalar per tensor.

    .. math::
        n_t &= \\lVert g \\rVert_2 \\text{ (norm\\_type 2) or }
             \\max|g| \\text{ (norm\\_type 0)},\\quad
        v \\leftarrow \\sqrt{\\beta_2 v^2 + (1-\\beta_2) n_t^2} \\text{ or }
             \\beta_2 v + (1-\\beta_2) n_t \\\\
        d &= v / \\sqrt{1-\\beta_2^t} + \\epsilon, \\quad
        m \\leftarrow \\beta_1 m + \\beta_3 g, \\quad
        w \\leftarrow w - \\eta \\left(\\frac{m / (1-\\beta_1^t)}{d} + \\lambda w\\right)

    With ``reg_inside_moment`` the normalized grad and decay enter the moment instead:
    :math:`m \\leftarrow \\beta_1 m + \\beta_3 (g/d + \\lambda w)`,
    :math:`w \\leftarrow w - \\eta\\, m / (1-\\beta_1^t)`. On the first step ``v`` is the
    grad norm itself unless ``init_zero``.

    Args:
        exp_avg_sqs: one one-element float32 tensor per param.
        grad_norms: float32 tensor ``(len(params),)``: each unscaled grad's norm.
    """
    args = (
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        masters,
        steps,
        grad_norms,
        float(lr),
        float(beta1),
        float(beta2),
        float(eps),
        float(weight_decay),
        bool(bias_correction),
        bool(grad_averaging),
        bool(reg_inside_moment),
        int(norm_type),
        bool(init_zero),
        inv_scale,
        found_inf,
    )
    dispatch("fused_novograd_", args, reference_fused_novograd_)


for _name, _ref in (
    ("fused_lamb_", reference_fused_lamb_),
    ("fused_novograd_", reference_fused_novograd_),
):
    register_fake(_name)(lambda *args, **kwargs: None)
    register_op(OpInfo(_name, "optimizer", _ref, dtypes=(_F32, torch.float16, torch.bfloat16)))
