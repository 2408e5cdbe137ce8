"""``mpnb::fused_sgd_``: one SGD step (with momentum) over tensor lists, in place (Apex's FusedSGD).

Conventions (``masters``, ``inv_scale``, ``found_inf``): :mod:`mpnb.core.ops._optim`. SGD has
no step count: ``first_run`` says, per param, that its momentum buffer is new. The momentum
buffers are fp32, or, for params without masters, in the params' dtype as ``torch.optim.SGD``
and Apex keep them: the buffer is then computed in fp32, stored rounded, and the step uses the
unrounded value (Apex's kernel). ``stepwise=True`` (params updated directly, buffers in their
dtype) rounds every operation to the params' dtype instead: ``torch.optim.SGD``'s ops on half
tensors (the rule Apex's tests hold FusedSGD to), bit for bit as ATen's vectorized CPU kernels
compute them (the alphas of its adds rounded to the dtype too). ATen computes the last few
elements of a thread's range in scalar code that also rounds ``alpha * x``: those elements can
differ from torch by one ulp.

Kernels: ``csrc/cpu/sgd.cpp`` (CPU; ``torch.optim.SGD``'s arithmetic, bit for bit in fp32,
and so equal to the reference); on CUDA PyTorch's
``torch._fused_sgd_``, one call per ``first_run`` value (the reference with
``wd_after_momentum``, which PyTorch's op lacks).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mpnb.core.ops._checks import check_lists, check_tensors
from mpnb.core.ops._library import Tensor, Tensors, call, define
from mpnb.core.ops._optim import (
    OPT_DTYPES,
    bf16_samples,
    check_step,
    commit,
    f32,
    keep_of,
    opt_samples,
    store,
    unscaled,
    via_torch,
    weight,
)
from mpnb.core.ops._rounding import ROUNDINGS, check_rounding, store_rounded

__all__ = [
    "fused_sgd_",
    "fused_sgd_bf16_",
    "reference_fused_sgd_",
    "reference_fused_sgd_bf16_",
]


def reference_fused_sgd_(
    params: Tensors,
    grads: Tensors,
    momentum_buffers: Tensors,
    masters: Tensors,
    first_run: Sequence[bool],
    *,
    lr: float,
    momentum: float = 0.0,
    dampening: float = 0.0,
    weight_decay: float = 0.0,
    nesterov: bool = False,
    wd_after_momentum: bool = False,
    inv_scale: Tensor | None = None,
    found_inf: Tensor | None = None,
    stepwise: bool = False,
) -> None:
    """One SGD step over lists, in place (``momentum_buffers`` may be empty without momentum).

    .. math::
        g = \\text{grad}\\, s^{-1} + \\lambda w, \\quad
        b \\leftarrow \\mu b + (1 - d) g \\;(b = g \\text{ on the first run}), \\quad
        g = g + \\mu b \\text{ (nesterov) or } b, \\quad w \\leftarrow w - \\eta g

    With ``wd_after_momentum`` the :math:`\\lambda w` term is added after the momentum. The
    reference is ``torch.optim.sgd._single_tensor_sgd``'s ops, in fp32 (a half buffer stored
    rounded after them), or with ``stepwise`` on the param dtype's tensors themselves.

    Args:
        params: the weights (fp32, fp16 or bf16; one dtype), updated in place.
        grads: one grad per param (fp32, fp16 or bf16; one dtype), read only.
        momentum_buffers: the buffers :math:`b`, fp32 or (without masters) the params' dtype,
            stored rounded (empty when ``momentum`` is 0).
        masters: empty, or fp32 master weights (updated; params get their rounded copy).
        first_run: one bool per param: its buffer is new (set to :math:`g`, not blended).
        lr, momentum, dampening, weight_decay, nesterov: ``torch.optim.SGD``'s options.
        wd_after_momentum: add the decay after the momentum (Apex).
        inv_scale: optional one-element tensor :math:`s^{-1}` multiplied into the grads.
        found_inf: optional one-element tensor; nonzero: the step writes nothing.
        stepwise: params without masters, buffers in their dtype: round every operation to
            that dtype (``torch.optim.SGD``'s ops on half tensors, bit for bit) instead of
            computing in fp32 and rounding once.

    Example::

        >>> p, g, buf = [torch.randn(10)], [torch.randn(10)], [torch.zeros(10)]
        >>> fused_sgd_(p, g, buf, [], [True], lr=0.1, momentum=0.9)
    """
    if not params:
        return
    keep = keep_of(found_inf, params[0].device)
    for i in range(len(params)):
        g = unscaled(grads[i], inv_scale)
        if stepwise:  # torch.optim.SGD's single-tensor step on the params' own dtype
            w = params[i].clone()
            g = g.to(w.dtype)  # the grad torch would hold
        else:
            w = weight(params, masters, i)
        if weight_decay != 0 and not wd_after_momentum:
            g = g.add(w, alpha=weight_decay)
        if momentum != 0:
            dtype = momentum_buffers[i].dtype if stepwise else torch.float32
            buf = momentum_buffers[i].to(dtype, copy=True)
            if first_run[i]:
                buf.copy_(g)
            else:
                buf.mul_(momentum).add_(g, alpha=1 - dampening)
            commit(keep, momentum_buffers[i], buf)  # rounded when the buffer is half
            g = g.add(buf, alpha=momentum) if nesterov else buf
        if weight_decay != 0 and wd_after_momentum:
            g = g.add(w, alpha=weight_decay)
        w.add_(g, alpha=-lr)
        if stepwise:
            commit(keep, params[i], w)
        else:
            store(params, masters, i, w, keep)


def _check_momentum(args, per_tensor: bool, buffers_fp32_only: bool) -> None:
    """With momentum: one buffer and one ``first_run`` flag per param, each buffer fp32 or
    (without masters, unless ``buffers_fp32_only``) the params' dtype."""
    op, params, bufs = args.op_name, args.params, args.momentum_buffers
    check_lists(op, False, params=params, momentum_buffers=bufs)
    if len(args.first_run) != len(params):
        raise ValueError(
            f"{op}: 'first_run' must hold one flag per param, got {len(args.first_run)} for "
            f"{len(params)}; pass True for each param whose momentum buffer is new."
        )
    if params:
        b, p = bufs[0].dtype, params[0].dtype
        if b != torch.float32 and (buffers_fp32_only or b != p or getattr(args, "masters", ())):
            raise TypeError(
                f"{op}: momentum buffers are {b}; they must be float32, or the params' dtype "
                f"({p}) when there are no master weights (torch.optim.SGD's and Apex's "
                "buffers)."
            )
    if per_tensor:
        check_tensors(op, params=params, momentum_buffers=bufs)


def _check(args, per_tensor: bool) -> None:
    op = args.op_name
    check_step(args, per_tensor)
    if args.momentum != 0:
        _check_momentum(args, per_tensor, buffers_fp32_only=False)
    if not args.stepwise:
        return
    if args.masters:
        raise ValueError(
            f"{op}: stepwise rounding is for params updated directly; with master weights "
            "the update is fp32: pass stepwise=False."
        )
    bufs, params = args.momentum_buffers, args.params
    if args.momentum != 0 and bufs and params and bufs[0].dtype != params[0].dtype:
        raise TypeError(
            f"{op}: stepwise rounding keeps the momentum buffers in the params' dtype "
            f"({params[0].dtype}), got {bufs[0].dtype}; pass buffers of that dtype."
        )


def _torch_fused_sgd_(args) -> None:
    """:func:`fused_sgd_` through ``torch._fused_sgd_`` (CUDA), one call per ``first_run``
    value; the reference with ``wd_after_momentum`` or ``stepwise`` (torch's op rounds once)."""
    if args.wd_after_momentum or args.stepwise:
        call(reference_fused_sgd_, args)
        return
    momentum, n = args.momentum, len(args.params)
    groups = {False: list(range(n))}
    buffers = list(args.momentum_buffers)
    if momentum != 0:
        flags = [bool(x) for x in args.first_run]
        groups = {f: [i for i, x in enumerate(flags) if x == f] for f in (False, True)}
        if buffers and buffers[0].dtype != torch.float32:  # the op updates fp32 weights
            buffers = [b.float() for b in buffers]

    def fused(w, g, found):
        for first, idx in groups.items():
            if idx:
                torch._fused_sgd_(
                    [w[i] for i in idx],
                    [g[i] for i in idx],
                    [buffers[i] for i in idx] if momentum != 0 else [],
                    weight_decay=args.weight_decay,
                    momentum=momentum,
                    lr=args.lr,
                    dampening=args.dampening,
                    nesterov=args.nesterov,
                    maximize=False,
                    is_first_step=first,
                    found_inf=found,
                )

    via_torch(args, fused)
    if momentum != 0 and buffers and buffers[0] is not args.momentum_buffers[0]:
        torch._foreach_copy_(list(args.momentum_buffers), buffers)  # rounded to the params' dtype


def _adapt(kw: dict) -> dict:
    # SGD has no step counts: a first-run flag per param (new and old buffers in one call);
    # no buffers without momentum, or buffers in the params' dtype (torch.optim.SGD's).
    del kw["steps"]
    masters = kw.get("masters", [])
    kw["first_run"] = [i % 2 == 0 for i in range(len(kw["params"]))]
    if kw["momentum"] == 0:
        kw["momentum_buffers"] = []
    elif kw.pop("half_buffers", False) and not masters:
        kw["momentum_buffers"] = [b.to(kw["params"][0].dtype) for b in kw["momentum_buffers"]]
    kw.pop("half_buffers", None)
    if "stepwise" in kw:
        kw["stepwise"] = bool(kw["stepwise"]) and not masters
    return kw


_HYPER = dict(lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01, nesterov=False)


def _samples(dtype: torch.dtype):
    mom = _HYPER | dict(wd_after_momentum=False)
    variants = (
        ("momentum", mom),
        ("nesterov", mom | dict(nesterov=True)),
        ("wd_after_momentum", mom | dict(wd_after_momentum=True)),
        ("no momentum, no buffers", mom | dict(momentum=0.0)),
        ("buffers in the param dtype", mom | dict(half_buffers=True)),
        ("nesterov, buffers in the param dtype", mom | dict(nesterov=True, half_buffers=True)),
        ("stepwise (torch.optim.SGD's ops)", mom | dict(half_buffers=True, stepwise=True)),
        (
            "stepwise, nesterov, decay after",
            mom | dict(half_buffers=True, stepwise=True, nesterov=True, wd_after_momentum=True),
        ),
        ("stepwise, no momentum", mom | dict(momentum=0.0, stepwise=True)),
    )
    return opt_samples(dtype, ("momentum_buffers",), variants, _adapt)


OP = define(
    reference_fused_sgd_,
    family="sgd",
    mutates=("params", "momentum_buffers", "masters"),
    check=_check,
    cuda=_torch_fused_sgd_,
    triton="sgd",
    dtypes=OPT_DTYPES,
    sample_inputs=_samples,  # kernel == reference bit for bit (torch.optim.SGD's arithmetic)
)
fused_sgd_ = OP.wrapper


# ---- pure bf16: stochastic rounding or Kahan summation ------------------------------------


def _sgd_plain(w, g, buf, first: bool, k: dict, momentum, nesterov, wd_after_momentum):
    """The fp32 SGD step of ``fused_sgd_bf16_``: one rounding per operation, no fma (the
    kernels compute exactly these operations). Updates ``buf`` (a copy: the caller commits
    it); returns the new weight."""
    has_wd = k["has_wd"]
    if has_wd and not wd_after_momentum:
        g = g + k["wd"] * w
    if momentum != 0:
        buf.copy_(g if first else buf * k["momentum"] + k["damp"] * g)
        g = g + k["momentum"] * buf if nesterov else buf
    if has_wd and wd_after_momentum:
        g = g + k["wd"] * w
    return w - k["lr"] * g


def reference_fused_sgd_bf16_(
    params: Tensors,
    grads: Tensors,
    momentum_buffers: Tensors,
    compensations: Tensors,
    first_run: Sequence[bool],
    *,
    lr: float,
    momentum: float = 0.0,
    dampening: float = 0.0,
    weight_decay: float = 0.0,
    nesterov: bool = False,
    wd_after_momentum: bool = False,
    rounding: str,
    seed: int,
    rng_step: int,
    inv_scale: Tensor | None = None,
    found_inf: Tensor | None = None,
) -> None:
    """One SGD step of bf16 params without master weights, rounded stochastically or with
    Kahan summation (the math: :mod:`mpnb.core.ops._rounding`).

    The fp32 step is :func:`fused_sgd_`'s formula, one rounding per operation
    (``g + wd * w``, ``b = momentum * b + (1 - dampening) * g``, ``w - lr * g``), from the
    param upcast to fp32: the reference is :func:`_sgd_plain`, then the rounding; the kernels
    compute exactly these operations.

    Args:
        params: bf16 weights, updated in place.
        grads: one grad per param (fp32, fp16 or bf16; one dtype), read only.
        momentum_buffers: the fp32 buffers (empty when ``momentum`` is 0).
        compensations: ``rounding="kahan"``: one bf16 buffer per param (updated); else empty.
        first_run: one bool per param: its buffer is new.
        lr, momentum, dampening, weight_decay, nesterov, wd_after_momentum: as
            :func:`fused_sgd_`.
        rounding: ``"stochastic"`` or ``"kahan"``.
        seed, rng_step: the random bits' seed and step (stochastic rounding).
        inv_scale: optional one-element tensor :math:`s^{-1}` multiplied into the grads.
        found_inf: optional one-element tensor; nonzero: the step writes nothing.

    Example::

        >>> p, g = [torch.randn(10).bfloat16()], [torch.randn(10)]
        >>> fused_sgd_bf16_(p, g, [], [], [], lr=1e-3, rounding="stochastic", seed=1,
        ...                 rng_step=1)
    """
    if not params:
        return
    keep = keep_of(found_inf, params[0].device)
    k = dict(lr=f32(lr), momentum=f32(momentum), damp=f32(1 - dampening), wd=f32(weight_decay))
    k["has_wd"] = weight_decay != 0
    for i in range(len(params)):
        g, w = unscaled(grads[i], inv_scale), params[i].float()
        buf = momentum_buffers[i].clone() if momentum != 0 else None
        first = bool(first_run[i]) if momentum != 0 else False
        x = _sgd_plain(w, g, buf, first, k, momentum, nesterov, wd_after_momentum)
        if buf is not None:
            commit(keep, momentum_buffers[i], buf)
        comp = compensations[i] if rounding == "kahan" else None
        store_rounded(params[i], comp, x, rounding, seed, rng_step, i, keep)


def _check_bf16(args, per_tensor: bool) -> None:
    check_step(args, per_tensor, masters=None)
    if args.momentum != 0:
        _check_momentum(args, per_tensor, buffers_fp32_only=True)
    check_rounding(args, per_tensor)


def _bf16_samples(dtype: torch.dtype):
    base = _HYPER | dict(wd_after_momentum=False, seed=5, rng_step=2)
    variants = []
    for rounding in ROUNDINGS:
        r = base | dict(rounding=rounding)
        variants += [
            (f"{rounding}: momentum", r),
            (f"{rounding}: nesterov", r | dict(nesterov=True)),
            (f"{rounding}: wd_after_momentum", r | dict(wd_after_momentum=True)),
            (f"{rounding}: no momentum, tiny lr", r | dict(momentum=0.0, lr=1e-5)),
        ]
    return bf16_samples(dtype, ("momentum_buffers",), variants, _adapt)


OP_BF16 = define(
    reference_fused_sgd_bf16_,
    family="sgd",
    mutates=("params", "momentum_buffers", "compensations"),
    check=_check_bf16,
    triton="sgd",
    dtypes=(torch.bfloat16,),
    sample_inputs=_bf16_samples,  # kernel == reference bit for bit
)
fused_sgd_bf16_ = OP_BF16.wrapper
