"""``mpnb::fused_novograd_``: one NovoGrad step over tensor lists, in place (Apex's FusedNovoGrad).

Conventions (``masters``, ``steps``, ``inv_scale``, ``found_inf``): :mod:`mpnb.core.ops._optim`.
The second moment is one scalar per tensor, blended from each grad's norm; the caller
computes the norms (:func:`mpnb.core.ops.multi_tensor_l2norm`, or a max-abs reduction)
together with the overflow check and passes them in.

Kernels: ``csrc/cpu/novograd.cpp`` (CPU); the reference elsewhere (PyTorch has no fused
NovoGrad).
"""

from __future__ import annotations

import torch

from mpnb.core.ops._library import Tensor, Tensors, define
from mpnb.core.ops._optim import (
    OPT_DTYPES,
    advance,
    check_step,
    commit,
    correction,
    f32,
    keep_of,
    opt_samples,
    opt_tolerance,
    store,
    unscaled,
    weight,
)

__all__ = ["fused_novograd_", "reference_fused_novograd_"]

_F32 = torch.float32


def reference_fused_novograd_(
    params: Tensors,
    grads: Tensors,
    exp_avgs: Tensors,
    exp_avg_sqs: Tensors,
    masters: Tensors,
    steps: Tensors,
    grad_norms: Tensor,
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
    inv_scale: Tensor | None = None,
    found_inf: Tensor | None = None,
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
    grad norm itself unless ``init_zero``. The reference is written from the NovoGrad paper
    (Ginsburg, 2019).

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
    if not params:
        return
    keep = keep_of(found_inf, params[0].device)
    beta3 = 1 - beta1 if grad_averaging else 1.0
    norms = grad_norms.to(_F32)
    for i in range(len(params)):
        g, w = unscaled(grads[i], inv_scale), weight(params, masters, i)
        step = advance(steps[i], keep)
        v, gn = exp_avg_sqs[i].reshape(()), norms[i].to(w.device)
        if norm_type == 2:
            v_new = (f32(beta2) * (v * v) + f32(1 - beta2) * (gn * gn)).sqrt()
        else:
            v_new = f32(beta2) * v + f32(1 - beta2) * gn
        if not init_zero:  # the first step takes the norm itself
            v_new = torch.where(step == 1, gn, v_new)
        bc1 = correction(beta1, step, bias_correction).float()
        bc2 = correction(beta2, step, bias_correction).sqrt().float()
        denom = v_new / bc2 + f32(eps)
        if reg_inside_moment:
            g = g / denom + f32(weight_decay) * w
            m = f32(beta1) * exp_avgs[i] + f32(beta3) * g
            w = w - f32(lr) * (m / bc1)
        else:
            m = f32(beta1) * exp_avgs[i] + f32(beta3) * g
            w = w - f32(lr) * ((m / bc1) / denom + f32(weight_decay) * w)
        commit(keep, v, v_new)
        commit(keep, exp_avgs[i], m)
        store(params, masters, i, w, keep)


def _check(args, per_tensor: bool) -> None:
    op, n = args.op_name, len(args.params)
    if args.norm_type not in (0, 2):
        raise ValueError(
            f"{op}: norm_type must be 0 (max) or 2 (L2), got {args.norm_type}; pass 0 or 2."
        )
    norms = args.grad_norms
    if norms.dtype != _F32 or norms.numel() != n or not norms.is_contiguous():
        raise ValueError(
            f"{op}: grad_norms must be a contiguous float32 tensor with one norm per param, "
            f"got {norms.dtype} with {norms.numel()} elements for {n} params; pass "
            "multi_tensor_l2norm(..., per_tensor=True)[1].float().contiguous()."
        )
    sqs = args.exp_avg_sqs
    if len(sqs) != n or (per_tensor and any(v.numel() != 1 or v.dtype != _F32 for v in sqs)):
        raise ValueError(
            f"{op}: exp_avg_sqs must hold one one-element float32 tensor per param; pass "
            "[torch.zeros(()) for p in params]."
        )
    check_step(args, per_tensor, "exp_avgs")


def _adapt(kw: dict) -> dict:
    # The sample's step count, a scalar second moment per param and the grads' norms.
    n, step = len(kw["params"]), kw.pop("step")
    for s in kw["steps"]:
        s.fill_(step)
    kw["exp_avg_sqs"] = [torch.tensor(0.5 + k / 8) for k in range(n)]
    kw["grad_norms"] = torch.linspace(0.1, 2.0, n)
    return kw


def _samples(dtype: torch.dtype):
    base = dict(lr=1e-2, beta1=0.95, beta2=0.98, eps=1e-8, weight_decay=0.01)
    base |= dict(step=3.0, reg_inside_moment=False, norm_type=2, init_zero=False)
    variants = (
        ("L2 norms", base),
        ("max norms, reg_inside_moment", base | dict(norm_type=0, reg_inside_moment=True)),
        ("first step: v = norm", base | dict(step=0.0)),
        ("first step, init_zero", base | dict(step=0.0, init_zero=True)),
    )
    return opt_samples(dtype, ("exp_avgs",), variants, _adapt)


OP = define(
    reference_fused_novograd_,
    family="novograd",
    mutates=("params", "exp_avgs", "exp_avg_sqs", "masters", "steps"),
    check=_check,
    dtypes=OPT_DTYPES,
    sample_inputs=_samples,
    tolerance=opt_tolerance(1e-8),
)
fused_novograd_ = OP.wrapper
