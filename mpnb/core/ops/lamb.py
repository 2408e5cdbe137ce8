"""``mpnb::fused_lamb_``: one LAMB step over tensor lists, in place (Apex's FusedLAMB).

Conventions (``masters``, ``steps``, ``inv_scale``, ``found_inf``): :mod:`mpnb.core.ops._optim`.
The global grad norm of the clipping spans every dtype bucket of a step, so the caller
computes it (:func:`mpnb.core.ops.multi_tensor_l2norm`) and passes it in.

Kernels: ``csrc/cpu/lamb.cpp`` (CPU); the reference elsewhere (PyTorch has no fused LAMB).
"""

from __future__ import annotations

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

__all__ = ["fused_lamb_", "reference_fused_lamb_"]

_NAME = "fused_lamb_"
_F32 = torch.float32


def _update(w, g, m, v, clip, wd, beta1, beta3, beta2, eps, bc1, bc2, adam_w_mode):
    g = g / clip
    if wd != 0 and not adam_w_mode:
        g = g + f32(wd) * w
    m.copy_(m * f32(beta1) + f32(beta3) * g)
    v.copy_(v * f32(beta2) + f32(1 - beta2) * g * g)
    u = (m / f32(bc1)) / ((v / f32(bc2)).sqrt() + f32(eps))
    if wd != 0 and adam_w_mode:
        u = u + f32(wd) * w
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
    check_opt_lists(_NAME, params, grads, masters, exp_avgs, exp_avg_sqs)
    check_steps(_NAME, steps, len(params))
    if global_grad_norm.numel() != 1:
        raise ValueError(
            f"{_NAME}: global_grad_norm must hold one value, got {global_grad_norm.numel()}; "
            "pass the one-element total of multi_tensor_l2norm."
        )
    if not params or skipped(_NAME, found_inf):
        return
    gnorm = global_grad_norm.reshape(()).to("cpu", _F32)
    clip = gnorm / f32(max_grad_norm) if 0 < max_grad_norm < gnorm.item() else f32(1.0)
    beta3 = 1 - beta1 if grad_averaging else 1.0
    for i in range(len(params)):
        g, w = unscaled(_NAME, grads[i], inv_scale), weight(params, masters, i)
        step = advance(steps[i])
        bc1 = 1 - beta1**step if bias_correction else 1.0
        bc2 = 1 - beta2**step if bias_correction else 1.0
        m, v = exp_avgs[i].clone(), exp_avg_sqs[i].clone()
        u = _update(
            w, g, m, v, clip.to(w.device), weight_decay, beta1, beta3, beta2, eps, bc1, bc2,
            adam_w_mode,
        )  # fmt: skip
        ratio = f32(lr)
        if use_nvlamb or weight_decay != 0:
            pn = f32(w.double().square().sum().sqrt().item())
            un = f32(u.double().square().sum().sqrt().item())
            if pn.item() != 0 and un.item() != 0:
                ratio = f32(lr) * (pn / un)
        exp_avgs[i].copy_(m)
        exp_avg_sqs[i].copy_(v)
        store(params, masters, i, w - ratio.to(w.device) * u)


def _args(lists, o: dict) -> tuple:
    params, grads, masters, (m, v), steps = lists
    gnorm = torch.tensor([o["global_grad_norm"]])
    hyper = (1e-2, 0.9, 0.999, 1e-6, o["weight_decay"], o["adam_w_mode"], True, True)
    return (
        params, grads, m, v, masters, steps, gnorm, *hyper, 1.0, o["use_nvlamb"],
        o.get("inv_scale"), o.get("found_inf"),
    )  # fmt: skip


def _samples(dtype: torch.dtype):
    base = dict(global_grad_norm=0.5, weight_decay=0.01, adam_w_mode=True, use_nvlamb=False)
    variants = (
        ("adamw decay", base),
        ("clipped, L2 decay", base | dict(global_grad_norm=3.0, adam_w_mode=False)),
        ("no decay: one pass", base | dict(weight_decay=0.0)),
        ("no decay, use_nvlamb", base | dict(weight_decay=0.0, use_nvlamb=True)),
        # a tensor larger than a cache group (655360 elements): both passes shared by threads
        ("a tensor past a group", base | dict(sizes=(5, 655360 + 3, 17))),
    )
    return opt_samples(dtype, 2, _args, variants)


OP = define(
    "fused_lamb_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, "
    "Tensor(c!)[] exp_avg_sqs, Tensor(d!)[] masters, Tensor(e!)[] steps, "
    "Tensor global_grad_norm, float lr, float beta1, float beta2, float eps, "
    "float weight_decay, bool adam_w_mode, bool bias_correction, bool grad_averaging, "
    "float max_grad_norm, bool use_nvlamb, Tensor? inv_scale=None, "
    "Tensor? found_inf=None) -> ()",
    family="lamb",
    reference=reference_fused_lamb_,
    fake=no_outputs,
    dtypes=OPT_DTYPES,
    sample_inputs=_samples,
    tolerance=opt_tolerance(6e-8),
)
_op = OP.overload


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
        params: the weights (fp32, fp16 or bf16; one dtype), updated in place.
        grads: one grad per param (fp32, fp16 or bf16; one dtype), read only.
        exp_avgs, exp_avg_sqs: the fp32 moments, updated in place.
        masters: empty, or fp32 master weights (updated; params get their rounded copy).
        steps: one one-element float32 tensor per param, advanced by the op.
        global_grad_norm: one-element tensor, the L2 norm of *all* unscaled grads of the step
            (every group and dtype). ``max_grad_norm <= 0`` disables the clipping.
        lr, beta1, beta2, eps, weight_decay, max_grad_norm: the hyper-parameters.
        adam_w_mode: decoupled weight decay instead of L2 decay.
        bias_correction, grad_averaging, use_nvlamb: Apex's FusedLAMB options.
        inv_scale: optional one-element tensor :math:`s^{-1}` multiplied into the grads.
        found_inf: optional one-element tensor; nonzero: the step writes nothing.

    Example::

        >>> p, g = [torch.randn(10)], [torch.randn(10)]
        >>> m, v, step = [torch.zeros(10)], [torch.zeros(10)], [torch.tensor(0.0)]
        >>> norm = torch.linalg.vector_norm(g[0]).reshape(1)
        >>> fused_lamb_(p, g, m, v, [], step, norm, lr=1e-2, beta1=0.9, beta2=0.999,
        ...             eps=1e-6, weight_decay=0.01)
    """
    ensure_kernels()
    _op(
        params, grads, exp_avgs, exp_avg_sqs, masters, steps, global_grad_norm, lr, beta1,
        beta2, eps, weight_decay, adam_w_mode, bias_correction, grad_averaging, max_grad_norm,
        use_nvlamb, inv_scale, found_inf,
    )  # fmt: skip
