"""``mpnb::fused_novograd_``: one NovoGrad step over tensor lists, in place (Apex's FusedNovoGrad).

Conventions (``masters``, ``steps``, ``inv_scale``, ``found_inf``): :mod:`mpnb.core.ops._optim`.
The second moment is one scalar per tensor, blended from each grad's norm; the caller
computes the norms (:func:`mpnb.core.ops.multi_tensor_l2norm`, or a max-abs reduction)
together with the overflow check and passes them in.

Kernels: ``csrc/cpu/novograd.cpp`` (CPU); the reference elsewhere (PyTorch has no fused
NovoGrad).
"""

from __future__ import annotations

import math

import torch

from mpnb.core.ops._library import define, ensure_kernels
from mpnb.core.ops._optim import (
    OPT_DTYPES,
    advance,
    check_opt_lists,
    check_steps,
    f32,
    no_outputs,
    opt_samples,
    opt_tolerance,
    skipped,
    store,
    unscaled,
    weight,
)

__all__ = ["fused_novograd_", "reference_fused_novograd_"]

_NAME = "fused_novograd_"
_F32 = torch.float32


def _check(exp_avg_sqs, grad_norms, norm_type: int, n: int) -> None:
    if norm_type not in (0, 2):
        raise ValueError(
            f"{_NAME}: norm_type must be 0 (max) or 2 (L2), got {norm_type}; pass 0 or 2."
        )
    if grad_norms.dtype != _F32 or grad_norms.numel() != n or not grad_norms.is_contiguous():
        raise ValueError(
            f"{_NAME}: grad_norms must be a contiguous float32 tensor with one norm per param, "
            f"got {grad_norms.dtype} with {grad_norms.numel()} elements for {n} params; pass "
            "multi_tensor_l2norm(..., per_tensor=True)[1].float().contiguous()."
        )
    if len(exp_avg_sqs) != n or any(v.numel() != 1 or v.dtype != _F32 for v in exp_avg_sqs):
        raise ValueError(
            f"{_NAME}: exp_avg_sqs must hold one one-element float32 tensor per param; pass "
            "[torch.zeros(()) for p in params]."
        )


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
    check_opt_lists(_NAME, params, grads, masters, exp_avgs)
    check_steps(_NAME, steps, len(params))
    _check(exp_avg_sqs, grad_norms, norm_type, len(params))
    if not params or skipped(_NAME, found_inf):
        return
    beta3 = 1 - beta1 if grad_averaging else 1.0
    norms = grad_norms.to("cpu", _F32)
    for i in range(len(params)):
        g, w = unscaled(_NAME, grads[i], inv_scale), weight(params, masters, i)
        step = advance(steps[i])
        v, gn = exp_avg_sqs[i].reshape(()), norms[i]
        if step == 1 and not init_zero:
            v.copy_(gn)
        elif norm_type == 2:
            v.copy_((f32(beta2) * (v * v) + f32(1 - beta2) * (gn * gn)).sqrt())
        else:
            v.copy_(f32(beta2) * v + f32(1 - beta2) * gn)
        bc1 = f32(1 - beta1**step if bias_correction else 1.0)
        bc2 = f32(math.sqrt(1 - beta2**step) if bias_correction else 1.0)
        denom = (v.cpu() / bc2 + f32(eps)).to(w.device)
        m = exp_avgs[i]
        if reg_inside_moment:
            g = g / denom + f32(weight_decay) * w
            m.copy_(f32(beta1) * m + f32(beta3) * g)
            w = w - f32(lr) * (m / bc1)
        else:
            m.copy_(f32(beta1) * m + f32(beta3) * g)
            w = w - f32(lr) * ((m / bc1) / denom + f32(weight_decay) * w)
        store(params, masters, i, w)


def _args(lists, o: dict) -> tuple:
    params, grads, masters, (m,), steps = lists
    n = len(params)
    for s in steps:
        s.fill_(o["step"])
    vs = [torch.tensor(0.5 + k / 8) for k in range(n)]
    norms = torch.linspace(0.1, 2.0, n)
    hyper = (1e-2, 0.95, 0.98, 1e-8, 0.01, True, True, o["reg_inside_moment"], o["norm_type"])
    return (
        params, grads, m, vs, masters, steps, norms, *hyper, o["init_zero"],
        o.get("inv_scale"), o.get("found_inf"),
    )  # fmt: skip


def _samples(dtype: torch.dtype):
    base = dict(step=3.0, reg_inside_moment=False, norm_type=2, init_zero=False)
    variants = (
        ("L2 norms", base),
        ("max norms, reg_inside_moment", base | dict(norm_type=0, reg_inside_moment=True)),
        ("first step: v = norm", base | dict(step=0.0)),
        ("first step, init_zero", base | dict(step=0.0, init_zero=True)),
    )
    return opt_samples(dtype, 1, _args, variants)


OP = define(
    "fused_novograd_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, "
    "Tensor(c!)[] exp_avg_sqs, Tensor(d!)[] masters, Tensor(e!)[] steps, "
    "Tensor grad_norms, float lr, float beta1, float beta2, float eps, float weight_decay, "
    "bool bias_correction, bool grad_averaging, bool reg_inside_moment, int norm_type, "
    "bool init_zero, Tensor? inv_scale=None, Tensor? found_inf=None) -> ()",
    family="novograd",
    reference=reference_fused_novograd_,
    fake=no_outputs,
    dtypes=OPT_DTYPES,
    sample_inputs=_samples,
    tolerance=opt_tolerance(1e-8),
)
_op = OP.overload


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
        params: the weights (fp32, fp16 or bf16; one dtype), updated in place.
        grads: one grad per param (fp32, fp16 or bf16; one dtype), read only.
        exp_avgs: the fp32 first moments :math:`m`, updated in place.
        exp_avg_sqs: one one-element float32 tensor :math:`v` per param, updated in place.
        masters: empty, or fp32 master weights (updated; params get their rounded copy).
        steps: one one-element float32 tensor per param, advanced by the op.
        grad_norms: float32 tensor ``(len(params),)``: each unscaled grad's norm :math:`n_t`.
        lr, beta1, beta2, eps, weight_decay: the hyper-parameters.
        bias_correction, grad_averaging, reg_inside_moment, norm_type, init_zero: Apex's
            FusedNovoGrad options (:math:`\\beta_3 = 1-\\beta_1` with grad_averaging, else 1).
        inv_scale: optional one-element tensor :math:`s^{-1}` multiplied into the grads.
        found_inf: optional one-element tensor; nonzero: the step writes nothing.

    Example::

        >>> p, g, m = [torch.randn(10)], [torch.randn(10)], [torch.zeros(10)]
        >>> v, step = [torch.zeros(())], [torch.tensor(0.0)]
        >>> fused_novograd_(p, g, m, v, [], step, torch.stack([g[0].norm()]), lr=1e-2,
        ...                 beta1=0.95, beta2=0.98, eps=1e-8, weight_decay=0.0)
    """
    ensure_kernels()
    _op(
        params, grads, exp_avgs, exp_avg_sqs, masters, steps, grad_norms, lr, beta1, beta2,
        eps, weight_decay, bias_correction, grad_averaging, reg_inside_moment, norm_type,
        init_zero, inv_scale, found_inf,
    )  # fmt: skip
