"""``mpnb::fused_adam_``: one Adam or AdamW step over tensor lists, in place (Apex's FusedAdam).

Conventions (``masters``, ``steps``, ``inv_scale``, ``found_inf``): :mod:`mpnb.core.ops._optim`.

Kernels: ``csrc/cpu/adam.cpp`` (CPU; an fp32 step equals ``torch.optim.AdamW(fused=True)``
and ``Adam(fused=True)`` bit for bit; in such a step it hands each tensor of at least
:data:`TORCH_ROUTE_ELEMS` elements to PyTorch's own fused op, see :func:`cpu_route`); on
CUDA PyTorch's ``torch._fused_adamw_`` / ``_fused_adam_`` (the reference without bias
correction, which PyTorch's ops always apply).
"""

from __future__ import annotations

import torch

from mpnb.core.ops._library import Tensor, Tensors, call, define
from mpnb.core.ops._optim import (
    OPT_DTYPES,
    advance,
    bf16_samples,
    check_step,
    commit,
    correction,
    f32,
    keep_of,
    lr_value,
    opt_samples,
    opt_tolerance,
    store,
    unscaled,
    via_torch,
    weight,
)
from mpnb.core.ops._rounding import ROUNDINGS, check_rounding, sqrt_rn, store_rounded

__all__ = [
    "TORCH_ROUTE_ELEMS",
    "adam_constants",
    "cpu_route",
    "fused_adam_",
    "fused_adam_bf16_",
    "reference_fused_adam_",
    "reference_fused_adam_bf16_",
]

_WRITES = ("params", "exp_avgs", "exp_avg_sqs", "steps")

#: The CPU kernel's per-tensor path of an fp32 step without masters (with bias correction and
#: no loss scale): a tensor of at least this many elements goes to PyTorch's own fused op
#: (``torch._fused_adamw_`` / ``_fused_adam_``, the same bits), a smaller one to mpnb's
#: multi-tensor walk. The C++ constant is ``kTorchRouteElems`` in ``csrc/cpu/adam.cpp``;
#: :func:`cpu_route` observes which side of it a call takes.
TORCH_ROUTE_ELEMS = 1 << 20
#: Where :data:`TORCH_ROUTE_ELEMS` comes from: PyTorch's op time / ours, side by side in one
#: process, 1 thread, one list of equal fp32 tensors (8M elements in all), by tensor size (on a
#: shared machine, +-10%; the reasoning is in ``csrc/cpu/adam.cpp``).
TORCH_ROUTE_MEASURED = {
    1 << 12: 1.14,
    1 << 14: 1.01,
    1 << 16: 0.84,
    1 << 17: 1.01,
    1 << 18: 1.01,
    1 << 19: 0.98,
    1 << 20: 0.90,
}


def cpu_route(numel: int, adam_w_mode: bool = True) -> str:
    """The path one fp32 tensor of ``numel`` elements takes through the CPU kernel, observed:
    the op runs once under :mod:`torch.profiler` and PyTorch's fused op is looked for.

    Returns ``"PyTorch's fused op"`` or ``"mpnb's multi-tensor walk"`` (the reference when the
    C++ kernels are not in use, which has no routing).

    Example::

        >>> cpu_route(TORCH_ROUTE_ELEMS)
        "PyTorch's fused op"
    """
    from torch.profiler import ProfilerActivity, profile

    w, g = torch.zeros(numel), torch.zeros(numel)
    m, v, st = torch.zeros(numel), torch.zeros(numel), torch.tensor(0.0)
    torch_op = "aten::_fused_adamw_" if adam_w_mode else "aten::_fused_adam_"
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fused_adam_(
            [w], [g], [m], [v], [], [st], lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
            weight_decay=0.0, adam_w_mode=adam_w_mode, bias_correction=True,
        )  # fmt: skip
    names = {e.name for e in prof.events()}
    return "PyTorch's fused op" if torch_op in names else "mpnb's multi-tensor walk"


def reference_fused_adam_(
    params: Tensors,
    grads: Tensors,
    exp_avgs: Tensors,
    exp_avg_sqs: Tensors,
    masters: Tensors,
    steps: Tensors,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adam_w_mode: bool,
    bias_correction: bool,
    inv_scale: Tensor | None = None,
    found_inf: Tensor | None = None,
    lr_tensor: Tensor | None = None,
) -> None:
    """One Adam (L2 decay) or AdamW (decoupled decay) step over lists, in place.

    .. math::
        g &= \\text{grad} \\cdot s^{-1} \\quad (+\\lambda w \\text{ without adam\\_w\\_mode}) \\\\
        m &\\leftarrow \\beta_1 m + (1-\\beta_1) g, \\qquad
        v \\leftarrow \\beta_2 v + (1-\\beta_2) g^2 \\\\
        w &\\leftarrow w (1 - \\eta\\lambda)_{\\text{adam\\_w\\_mode}}
             - \\frac{\\eta}{1-\\beta_1^t} \\frac{m}{\\sqrt{v}/\\sqrt{1-\\beta_2^t} + \\epsilon}

    The reference is ``torch.optim.adam._single_tensor_adam``'s ops; the C++ kernel's fp32
    step equals ``torch.optim.AdamW(fused=True)`` and ``Adam(fused=True)`` bit for bit.

    Args:
        params: the weights (fp32, fp16 or bf16; one dtype), updated in place.
        grads: one grad per param (fp32, fp16 or bf16; one dtype), read only.
        exp_avgs, exp_avg_sqs: the fp32 moments, updated in place.
        masters: empty, or fp32 master weights (updated; params get their rounded copy).
        steps: one one-element float32 tensor per param, advanced by the op.
        lr, beta1, beta2, eps, weight_decay: the hyper-parameters.
        adam_w_mode: decoupled weight decay (AdamW) instead of L2 decay.
        bias_correction: divide by :math:`1-\\beta^t`.
        inv_scale: optional one-element tensor :math:`s^{-1}` multiplied into the grads.
        found_inf: optional one-element tensor; nonzero: the step writes nothing.
        lr_tensor: optional one-element float32 tensor on the params' device: the learning
            rate read on the device (``lr`` is then not used), so a step captured in a CUDA
            graph follows an LR schedule that writes into it (``group["lr"].fill_(...)``, as
            ``torch.optim.lr_scheduler`` does for a tensor lr).

    See :mod:`mpnb.core.ops._optim` for the conventions of ``masters``, ``steps``,
    ``inv_scale`` and ``found_inf``.

    Example::

        >>> p, g = [torch.randn(10)], [torch.randn(10)]
        >>> m, v, step = [torch.zeros(10)], [torch.zeros(10)], [torch.tensor(0.0)]
        >>> fused_adam_(p, g, m, v, [], step, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
        ...             weight_decay=0.01, adam_w_mode=True, bias_correction=True)
    """
    if not params:
        return
    keep = keep_of(found_inf, params[0].device)
    lr = lr_value(lr, lr_tensor)
    for i in range(len(params)):
        g, w = unscaled(grads[i], inv_scale), weight(params, masters, i)
        step = advance(steps[i], keep)
        if weight_decay != 0:
            if adam_w_mode:
                w.mul_(1 - lr * weight_decay)
            else:
                g = g.add(w, alpha=weight_decay)
        m = exp_avgs[i].lerp(g, 1 - beta1)
        v = exp_avg_sqs[i].mul(beta2).addcmul_(g, g, value=1 - beta2)
        bc1 = correction(beta1, step, bias_correction)
        bc2 = correction(beta2, step, bias_correction)
        denom = (v.sqrt() / bc2.sqrt()).add_(eps)
        w.addcdiv_(m * (-lr / bc1).float(), denom)  # addcdiv's value * m / denom, rounded alike
        commit(keep, exp_avgs[i], m)
        commit(keep, exp_avg_sqs[i], v)
        store(params, masters, i, w, keep)


def _check(args, per_tensor: bool) -> None:
    check_step(args, per_tensor, "exp_avgs", "exp_avg_sqs")


def _torch_fused_adam_(args) -> None:
    """:func:`fused_adam_` through ``torch._fused_adamw_`` / ``_fused_adam_`` (CUDA); the
    reference without bias correction (PyTorch's ops always apply it)."""
    if not args.bias_correction:
        call(reference_fused_adam_, args)
        return
    op = torch._fused_adamw_ if args.adam_w_mode else torch._fused_adam_

    def fused(w, g, found):
        op(
            w,
            g,
            list(args.exp_avgs),
            list(args.exp_avg_sqs),
            [],
            list(args.steps),
            lr=args.lr if args.lr_tensor is None else args.lr_tensor,
            beta1=args.beta1,
            beta2=args.beta2,
            weight_decay=args.weight_decay,
            eps=args.eps,
            amsgrad=False,
            maximize=False,
            found_inf=found,
        )

    via_torch(args, fused)


_HYPER = dict(beta1=0.9, beta2=0.999, eps=1e-8)


def _lr_tensor() -> torch.Tensor:
    """A learning rate on the device for the samples (``lr_tensor``; ``lr`` is then unused)."""
    return torch.tensor(3e-3)


def _samples(dtype: torch.dtype):
    adamw = _HYPER | dict(lr=1e-2, weight_decay=0.1, adam_w_mode=True, bias_correction=True)
    variants = (
        ("adamw", adamw),
        ("adam, L2 decay", adamw | dict(adam_w_mode=False)),
        ("no decay, no bias correction", adamw | dict(weight_decay=0.0, bias_correction=False)),
        ("adamw, lr on the device", adamw | dict(lr=0.0, lr_tensor=torch.tensor(1e-2))),
        (
            "adam, lr on the device, no bias correction",
            adamw | dict(adam_w_mode=False, bias_correction=False, lr=0.0, lr_tensor=_lr_tensor()),
        ),
    )
    return opt_samples(dtype, ("exp_avgs", "exp_avg_sqs"), variants)


OP = define(
    reference_fused_adam_,
    family="adam",
    mutates=(*_WRITES, "masters"),
    check=_check,
    cuda=_torch_fused_adam_,
    triton="adam",
    dtypes=OPT_DTYPES,
    sample_inputs=_samples,
    tolerance=opt_tolerance(2e-8),
)
fused_adam_ = OP.wrapper


# ---- pure bf16: stochastic rounding or Kahan summation ------------------------------------


def _adam_plain(w, g, m, v, k: dict, t: int, adam_w_mode: bool, has_wd: bool):
    """The fp32 Adam step of ``fused_adam_bf16_``: one rounding per operation, no fma (the
    kernels compute exactly these operations, in this order). Returns the new weight and the
    new moments ``m``, ``v`` (the caller commits them)."""
    if has_wd:
        if adam_w_mode:
            w = w * k["decay"]
        else:
            g = g + k["wd"] * w
    m = m * k["beta1"] + k["c1"] * g
    v = v * k["beta2"] + (k["c2"] * g) * g
    denom = sqrt_rn(v) / k["bc2_sqrt"][t] + k["eps"]
    return w + (k["neg_step"][t] * m) / denom, m, v


def adam_constants(lr, beta1, beta2, eps, weight_decay, bias_correction, steps) -> dict:
    """The fp32 constants of the pure-bf16 Adam step, each rounded once from fp64 (as the
    kernels; ``lr`` a host number or a 0-dim fp64 device tensor, :func:`~mpnb.core.ops._optim.
    lr_value`): per tensor ``neg_step = -lr / (1 - beta1^t)`` and ``bc2_sqrt``, from the step
    counts ``steps`` (0-dim fp64 tensors, on the device: :func:`~mpnb.core.ops._optim.
    advance`)."""
    bc = bias_correction
    return dict(
        decay=f32(1 - lr * weight_decay),
        wd=f32(weight_decay),
        beta1=f32(beta1),
        c1=f32(1 - beta1),
        beta2=f32(beta2),
        c2=f32(1 - beta2),
        eps=f32(eps),
        neg_step=[(-lr / correction(beta1, s, bc)).float() for s in steps],
        bc2_sqrt=[correction(beta2, s, bc).sqrt().float() for s in steps],
    )


def reference_fused_adam_bf16_(
    params: Tensors,
    grads: Tensors,
    exp_avgs: Tensors,
    exp_avg_sqs: Tensors,
    compensations: Tensors,
    steps: Tensors,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adam_w_mode: bool,
    bias_correction: bool,
    rounding: str,
    seed: int,
    rng_step: int,
    inv_scale: Tensor | None = None,
    found_inf: Tensor | None = None,
    lr_tensor: Tensor | None = None,
) -> None:
    """One Adam/AdamW step of bf16 params without master weights, rounded stochastically or
    with Kahan summation (the math: :mod:`mpnb.core.ops._rounding`).

    The fp32 step is :func:`fused_adam_`'s formula computed one rounding per operation
    (``m = beta1 m + (1-beta1) g``, ``v = beta2 v + ((1-beta2) g) g``,
    ``w + (-lr/bc1 * m) / (sqrt(v)/sqrt(bc2) + eps)``), from the param upcast to fp32: the
    reference is :func:`_adam_plain`, then the rounding; the kernels compute exactly these
    operations.

    Args:
        params: bf16 weights, updated in place.
        grads: one grad per param (fp32, fp16 or bf16; one dtype), read only.
        exp_avgs, exp_avg_sqs: the fp32 moments, updated in place.
        compensations: ``rounding="kahan"``: one bf16 buffer per param (updated); else empty.
        steps: one one-element float32 tensor per param, advanced by the op.
        lr, beta1, beta2, eps, weight_decay, adam_w_mode, bias_correction: as
            :func:`fused_adam_`.
        rounding: ``"stochastic"`` or ``"kahan"``.
        seed, rng_step: the random bits' seed and step (stochastic rounding; the tensor's
            index in ``params`` and the element's index complete the counter).
        inv_scale: optional one-element tensor :math:`s^{-1}` multiplied into the grads.
        found_inf: optional one-element tensor; nonzero: the step writes nothing.
        lr_tensor: optional learning rate on the device, as :func:`fused_adam_`'s.

    Example::

        >>> p, g = [torch.randn(10).bfloat16()], [torch.randn(10)]
        >>> m, v, step = [torch.zeros(10)], [torch.zeros(10)], [torch.tensor(0.0)]
        >>> fused_adam_bf16_(p, g, m, v, [], step, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
        ...                  weight_decay=0.01, adam_w_mode=True, bias_correction=True,
        ...                  rounding="stochastic", seed=1, rng_step=1)
    """
    if not params:
        return
    keep = keep_of(found_inf, params[0].device)
    counts = [advance(s, keep) for s in steps]
    lr = lr_value(lr, lr_tensor)
    k = adam_constants(lr, beta1, beta2, eps, weight_decay, bias_correction, counts)
    for i in range(len(params)):
        g, w = unscaled(grads[i], inv_scale), params[i].float()
        x, m, v = _adam_plain(
            w, g, exp_avgs[i], exp_avg_sqs[i], k, i, adam_w_mode, weight_decay != 0
        )
        commit(keep, exp_avgs[i], m)
        commit(keep, exp_avg_sqs[i], v)
        comp = compensations[i] if rounding == "kahan" else None
        store_rounded(params[i], comp, x, rounding, seed, rng_step, i, keep)


def _check_bf16(args, per_tensor: bool) -> None:
    check_step(args, per_tensor, "exp_avgs", "exp_avg_sqs", masters=None)
    check_rounding(args, per_tensor)


def _bf16_samples(dtype: torch.dtype):
    base = _HYPER | dict(lr=1e-2, weight_decay=0.1, adam_w_mode=True, bias_correction=True)
    base |= dict(seed=7, rng_step=3)
    variants = []
    for rounding in ROUNDINGS:
        r = dict(rounding=rounding)
        variants += [
            (f"{rounding}: adamw", base | r),
            (f"{rounding}: adam, L2 decay", base | r | dict(adam_w_mode=False)),
            (f"{rounding}: no decay, tiny lr", base | r | dict(weight_decay=0.0, lr=1e-6)),
            (f"{rounding}: lr on the device", base | r | dict(lr=0.0, lr_tensor=_lr_tensor())),
        ]
    return bf16_samples(dtype, ("exp_avgs", "exp_avg_sqs"), variants)


OP_BF16 = define(
    reference_fused_adam_bf16_,
    family="adam",
    mutates=(*_WRITES, "compensations"),
    check=_check_bf16,
    triton="adam",
    dtypes=(torch.bfloat16,),
    sample_inputs=_bf16_samples,  # kernel == reference bit for bit
)
fused_adam_bf16_ = OP_BF16.wrapper
