"""``mpnb::fused_lamb_``: one LAMB step over tensor lists, in place (Apex's FusedLAMB).

Conventions (``masters``, ``steps``, ``inv_scale``, ``found_inf``): :mod:`mpnb.core.ops._optim`.
The global grad norm of the clipping spans every dtype bucket of a step, so the caller
computes it (:func:`mpnb.core.ops.multi_tensor_l2norm`) and passes it in.

Kernels: ``csrc/cpu/lamb.cpp`` (CPU); the reference elsewhere (PyTorch has no fused LAMB).
"""

from __future__ import annotations

import torch

from mpnb.core.ops._library import Tensor, Tensors, define
from mpnb.core.ops._optim import (
    OPT_DTYPES,
    advance,
    bf16_samples,
    check_step,
    commit,
    correction,
    f32,
    f32_value,
    keep_of,
    opt_samples,
    opt_tolerance,
    store,
    unscaled,
    weight,
)
from mpnb.core.ops._rounding import ROUNDINGS, check_rounding, sqrt_rn, store_rounded

__all__ = [
    "NORM_BLOCK",
    "block_norm",
    "fused_lamb_",
    "fused_lamb_bf16_",
    "reference_fused_lamb_",
    "reference_fused_lamb_bf16_",
]

_F32 = torch.float32
_WRITES = ("params", "exp_avgs", "exp_avg_sqs", "steps")


def reference_fused_lamb_(
    params: Tensors,
    grads: Tensors,
    exp_avgs: Tensors,
    exp_avg_sqs: Tensors,
    masters: Tensors,
    steps: Tensors,
    global_grad_norm: Tensor,
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
    inv_scale: Tensor | None = None,
    found_inf: Tensor | None = None,
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

    The reference is written from the LAMB paper (You et al., 2019).

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
    if not params:
        return
    dev = params[0].device
    keep = keep_of(found_inf, dev)
    gnorm = global_grad_norm.reshape(()).to(dev, _F32)
    clip = torch.ones((), dtype=_F32, device=dev)
    if max_grad_norm > 0:
        clip = torch.where(gnorm.double() > max_grad_norm, gnorm / f32(max_grad_norm), clip)
    # f32(...) constants stay 0-dim CPU tensors: a CUDA op reads them as scalars, where a
    # copy to the device (.to(dev)) would make the host wait for the stream.
    beta3 = 1 - beta1 if grad_averaging else 1.0
    for i in range(len(params)):
        g, w = unscaled(grads[i], inv_scale), weight(params, masters, i)
        step = advance(steps[i], keep)
        bc1 = correction(beta1, step, bias_correction).float()
        bc2 = correction(beta2, step, bias_correction).float()
        g = g / clip
        if weight_decay != 0 and not adam_w_mode:
            g = g + f32(weight_decay) * w
        m = exp_avgs[i] * f32(beta1) + f32(beta3) * g
        v = exp_avg_sqs[i] * f32(beta2) + f32(1 - beta2) * g * g
        u = (m / bc1) / ((v / bc2).sqrt() + f32(eps))
        if weight_decay != 0 and adam_w_mode:
            u = u + f32(weight_decay) * w
        ratio = f32(lr)
        if use_nvlamb or weight_decay != 0:
            pn = w.double().square().sum().sqrt().float()
            un = u.double().square().sum().sqrt().float()
            ratio = torch.where((pn != 0) & (un != 0), ratio * (pn / un), ratio)
        commit(keep, exp_avgs[i], m)
        commit(keep, exp_avg_sqs[i], v)
        store(params, masters, i, w - ratio * u, keep)


def _check_norm(args) -> None:
    if args.global_grad_norm.numel() != 1:
        raise ValueError(
            f"{args.op_name}: global_grad_norm must hold one value, got "
            f"{args.global_grad_norm.numel()}; pass the one-element total of "
            "multi_tensor_l2norm."
        )


def _check(args, per_tensor: bool) -> None:
    check_step(args, per_tensor, "exp_avgs", "exp_avg_sqs")
    _check_norm(args)


def _adapt(kw: dict) -> dict:
    kw["global_grad_norm"] = torch.tensor([kw["global_grad_norm"]])  # the sample's norm
    return kw


_HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-6, bias_correction=True)
_HYPER |= dict(grad_averaging=True, max_grad_norm=1.0)


def _samples(dtype: torch.dtype):
    base = _HYPER | dict(global_grad_norm=0.5, weight_decay=0.01, adam_w_mode=True)
    base |= dict(use_nvlamb=False)
    variants = (
        ("adamw decay", base),
        ("clipped, L2 decay", base | dict(global_grad_norm=3.0, adam_w_mode=False)),
        ("no decay: one pass", base | dict(weight_decay=0.0)),
        ("no decay, use_nvlamb", base | dict(weight_decay=0.0, use_nvlamb=True)),
        # a tensor larger than a cache group (655360 elements): both passes shared by threads
        ("a tensor past a group", base | dict(sizes=(5, 655360 + 3, 17))),
    )
    return opt_samples(dtype, ("exp_avgs", "exp_avg_sqs"), variants, _adapt)


OP = define(
    reference_fused_lamb_,
    family="lamb",
    mutates=(*_WRITES, "masters"),
    check=_check,
    triton="lamb",
    dtypes=OPT_DTYPES,
    sample_inputs=_samples,
    tolerance=opt_tolerance(6e-8),
)
fused_lamb_ = OP.wrapper


# ---- pure bf16: stochastic rounding or Kahan summation ------------------------------------

#: The norms of the pure-bf16 step are sums of fp64 squares in a fixed order: each block of
#: this many elements from its first to its last, then the blocks' sums in block order (the
#: kernels share the blocks between threads and add them in the same order).
NORM_BLOCK = 4096


def block_norm(x: torch.Tensor) -> torch.Tensor:
    """``sqrt(sum(x^2))`` in fp64 (a 0-dim tensor on ``x``'s device), summed in
    :data:`NORM_BLOCK` order (``cumsum`` adds one element after the other)."""
    sq = x.reshape(-1).double().square()
    if not sq.numel():
        return torch.zeros((), dtype=torch.float64, device=x.device)
    pad = (-sq.numel()) % NORM_BLOCK
    blocks = torch.nn.functional.pad(sq, (0, pad)).reshape(-1, NORM_BLOCK)
    sums = blocks.cumsum(1)[:, -1]
    return sums.cumsum(0)[-1].sqrt()


def _lamb_plain(w, g, m, v, k: dict, t: int, adam_w_mode: bool):
    """The fp32 LAMB direction of ``fused_lamb_bf16_``: one rounding per operation, no fma,
    reciprocals for the clipping and the bias corrections (as the kernels). Returns the
    direction ``u`` and the new moments ``m``, ``v`` (the caller commits them)."""
    g = g * k["rclip"]  # 1 when the norm is not clipped: g unchanged
    if k["has_wd"] and not adam_w_mode:
        g = g + k["wd"] * w
    m = m * k["beta1"] + k["beta3"] * g
    v = v * k["beta2"] + (k["c2"] * g) * g
    u = (m * k["rbc1"][t]) / (sqrt_rn(v * k["rbc2"][t]) + k["eps"])
    if k["has_wd"] and adam_w_mode:
        u = u + k["wd"] * w
    return u, m, v


def reference_fused_lamb_bf16_(
    params: Tensors,
    grads: Tensors,
    exp_avgs: Tensors,
    exp_avg_sqs: Tensors,
    compensations: Tensors,
    steps: Tensors,
    global_grad_norm: Tensor,
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
    rounding: str,
    seed: int,
    rng_step: int,
    inv_scale: Tensor | None = None,
    found_inf: Tensor | None = None,
) -> None:
    """One LAMB step of bf16 params without master weights, rounded stochastically or with
    Kahan summation (the math: :mod:`mpnb.core.ops._rounding`).

    The fp32 step is :func:`fused_lamb_`'s formula, one rounding per operation, with the
    trust ratio's norms summed in fp64 in a fixed block order (:func:`block_norm`): the
    reference is :func:`_lamb_plain`, the trust ratio, then the rounding.

    Args:
        params: bf16 weights, updated in place.
        grads: one grad per param (fp32, fp16 or bf16; one dtype), read only.
        exp_avgs, exp_avg_sqs: the fp32 moments, updated in place.
        compensations: ``rounding="kahan"``: one bf16 buffer per param (updated); else empty.
        steps: one one-element float32 tensor per param, advanced by the op.
        global_grad_norm: one-element tensor, the L2 norm of all unscaled grads of the step.
        lr, beta1, beta2, eps, weight_decay, adam_w_mode, bias_correction, grad_averaging,
            max_grad_norm, use_nvlamb: as :func:`fused_lamb_`.
        rounding: ``"stochastic"`` or ``"kahan"``.
        seed, rng_step: the random bits' seed and step (stochastic rounding).
        inv_scale: optional one-element tensor :math:`s^{-1}` multiplied into the grads.
        found_inf: optional one-element tensor; nonzero: the step writes nothing.

    Example::

        >>> p, g = [torch.randn(10).bfloat16()], [torch.randn(10)]
        >>> m, v, step = [torch.zeros(10)], [torch.zeros(10)], [torch.tensor(0.0)]
        >>> fused_lamb_bf16_(p, g, m, v, [], step, torch.ones(1), lr=1e-2, beta1=0.9,
        ...                  beta2=0.999, eps=1e-6, weight_decay=0.01,
        ...                  rounding="stochastic", seed=1, rng_step=1)
    """
    if not params:
        return
    dev = params[0].device
    keep = keep_of(found_inf, dev)
    gnorm, mx = global_grad_norm.reshape(()).to(dev, _F32), f32(max_grad_norm)
    rclip = f32(1.0)  # not clipped: g * 1 is g
    if f32_value(max_grad_norm) > 0:
        rclip = torch.where(gnorm > mx, (1.0 / (gnorm / mx).double()).float(), rclip)
    counts = [advance(s, keep) for s in steps]

    def rbc(beta):
        return [(1 / correction(beta, s, bias_correction)).float() for s in counts]

    k = dict(rclip=rclip, wd=f32(weight_decay))
    k |= dict(has_wd=weight_decay != 0, beta1=f32(beta1), beta2=f32(beta2), eps=f32(eps))
    k |= dict(beta3=f32(1 - beta1) if grad_averaging else f32(1.0), c2=f32(1 - beta2))
    k |= dict(rbc1=rbc(beta1), rbc2=rbc(beta2))
    for i in range(len(params)):
        g, w = unscaled(grads[i], inv_scale), params[i].float()
        u, m, v = _lamb_plain(w, g, exp_avgs[i], exp_avg_sqs[i], k, i, adam_w_mode)
        ratio = f32(lr)
        if use_nvlamb or weight_decay != 0:
            pn, un = block_norm(w).float(), block_norm(u).float()
            ratio = torch.where((pn != 0) & (un != 0), ratio * (pn / un), ratio)
        commit(keep, exp_avgs[i], m)
        commit(keep, exp_avg_sqs[i], v)
        comp = compensations[i] if rounding == "kahan" else None
        store_rounded(params[i], comp, w - ratio * u, rounding, seed, rng_step, i, keep)


def _check_bf16(args, per_tensor: bool) -> None:
    check_step(args, per_tensor, "exp_avgs", "exp_avg_sqs", masters=None)
    check_rounding(args, per_tensor)
    _check_norm(args)


def _bf16_samples(dtype: torch.dtype):
    base = _HYPER | dict(global_grad_norm=0.5, weight_decay=0.01, adam_w_mode=True)
    base |= dict(use_nvlamb=False, seed=3, rng_step=4)
    variants = []
    for rounding in ROUNDINGS:
        r = base | dict(rounding=rounding)
        variants += [
            (f"{rounding}: adamw decay", r),
            (f"{rounding}: clipped, L2 decay", r | dict(global_grad_norm=3.0, adam_w_mode=False)),
            (f"{rounding}: no decay", r | dict(weight_decay=0.0)),
            (f"{rounding}: use_nvlamb", r | dict(weight_decay=0.0, use_nvlamb=True)),
        ]
    return bf16_samples(dtype, ("exp_avgs", "exp_avg_sqs"), variants, _adapt)


OP_BF16 = define(
    reference_fused_lamb_bf16_,
    family="lamb",
    mutates=(*_WRITES, "compensations"),
    check=_check_bf16,
    triton="lamb",
    dtypes=(torch.bfloat16,),
    sample_inputs=_bf16_samples,  # kernel == reference bit for bit
)
fused_lamb_bf16_ = OP_BF16.wrapper
