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

import torch

from mpnb.core.ops._checks import check_lists
from mpnb.core.ops._library import define, ensure_kernels
from mpnb.core.ops._optim import (
    OPT_DTYPES,
    bf16_compensations,
    bf16_samples,
    check_opt_lists,
    f32,
    no_outputs,
    opt_samples,
    skipped,
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

_NAME = "fused_sgd_"


def check_momentum_buffers(op: str, params, masters, bufs) -> None:
    """Buffers sized as the params, fp32 or (without masters) the params' dtype."""
    check_lists(op, params, state=bufs)
    if not params:
        return
    b, p = bufs[0].dtype, params[0].dtype
    if b != torch.float32 and (b != p or masters):
        raise TypeError(
            f"{op}: momentum buffers are {b}; they must be float32, or the params' dtype ({p}) "
            "when there are no master weights (torch.optim.SGD's and Apex's buffers)."
        )


def check_stepwise(op: str, params, masters, bufs) -> None:
    """Stepwise rounding: params updated directly, buffers in their dtype."""
    if masters:
        raise ValueError(
            f"{op}: stepwise rounding is for params updated directly; with master weights "
            "the update is fp32: pass stepwise=False."
        )
    if bufs and params and bufs[0].dtype != params[0].dtype:
        raise TypeError(
            f"{op}: stepwise rounding keeps the momentum buffers in the params' dtype "
            f"({params[0].dtype}), got {bufs[0].dtype}; pass buffers of that dtype."
        )


def _stepwise_sgd(
    params, grads, bufs, first_run, lr, momentum, dampening, weight_decay, nesterov,
    wd_after_momentum, inv_scale,
) -> None:  # fmt: skip
    """torch.optim.SGD's single-tensor step on the params' own dtype (each op rounded to it)."""
    for i, p in enumerate(params):
        g = unscaled(_NAME, grads[i], inv_scale).to(p.dtype)  # the grad torch would hold
        if weight_decay != 0 and not wd_after_momentum:
            g = g.add(p, alpha=weight_decay)
        if momentum != 0:
            if first_run[i]:
                bufs[i].copy_(g)
            else:
                bufs[i].mul_(momentum).add_(g, alpha=1 - dampening)
            g = g.add(bufs[i], alpha=momentum) if nesterov else bufs[i]
        if weight_decay != 0 and wd_after_momentum:
            g = g.add(p, alpha=weight_decay)
        p.add_(g, alpha=-lr)


def _check_first_run(first_run, n: int) -> None:
    if len(first_run) != n:
        raise ValueError(
            f"{_NAME}: 'first_run' must hold one flag per param, got {len(first_run)} for {n}; "
            "pass True for each param whose momentum buffer is new."
        )


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
    stepwise=False,
) -> None:
    """Reference of :func:`fused_sgd_`: ``torch.optim.sgd._single_tensor_sgd``'s ops, in fp32
    (a half buffer stored rounded after them), or with ``stepwise`` on the param dtype's
    tensors themselves."""
    check_opt_lists(_NAME, params, grads, masters)
    if momentum != 0:
        check_momentum_buffers(_NAME, params, masters, momentum_buffers)
        _check_first_run(first_run, len(params))
    if stepwise:
        check_stepwise(_NAME, params, masters, momentum_buffers if momentum != 0 else [])
    if not params or skipped(_NAME, found_inf):
        return
    if stepwise:
        _stepwise_sgd(
            params, grads, momentum_buffers, first_run, lr, momentum, dampening, weight_decay,
            nesterov, wd_after_momentum, inv_scale,
        )  # fmt: skip
        return
    for i in range(len(params)):
        g, w = unscaled(_NAME, grads[i], inv_scale), weight(params, masters, i)
        if weight_decay != 0 and not wd_after_momentum:
            g = g.add(w, alpha=weight_decay)
        if momentum != 0:
            buf = momentum_buffers[i].float()
            if first_run[i]:
                buf.copy_(g)
            else:
                buf.mul_(momentum).add_(g, alpha=1 - dampening)
            momentum_buffers[i].copy_(buf)  # rounded when the buffer is half
            g = g.add(buf, alpha=momentum) if nesterov else buf
        if weight_decay != 0 and wd_after_momentum:
            g = g.add(w, alpha=weight_decay)
        w.add_(g, alpha=-lr)
        store(params, masters, i, w)


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
    stepwise=False,
) -> None:
    """:func:`fused_sgd_` through ``torch._fused_sgd_`` (CUDA), one call per ``first_run``
    value; the reference with ``wd_after_momentum`` or ``stepwise`` (torch's op rounds once)."""
    if wd_after_momentum or stepwise:
        reference_fused_sgd_(
            params, grads, momentum_buffers, masters, first_run, lr, momentum, dampening,
            weight_decay, nesterov, wd_after_momentum, inv_scale, found_inf, stepwise,
        )  # fmt: skip
        return
    groups = {False: list(range(len(params)))}
    buffers = list(momentum_buffers)
    if momentum != 0:
        groups = {f: [i for i, x in enumerate(first_run) if bool(x) == f] for f in (False, True)}
        if buffers and buffers[0].dtype != torch.float32:  # the op updates fp32 weights
            buffers = [b.float() for b in buffers]

    def call(w, g, found):
        for first, idx in groups.items():
            if idx:
                bufs = [buffers[i] for i in idx] if momentum != 0 else []
                torch._fused_sgd_(
                    [w[i] for i in idx], [g[i] for i in idx], bufs, weight_decay=weight_decay,
                    momentum=momentum, lr=lr, dampening=dampening, nesterov=nesterov,
                    maximize=False, is_first_step=first, found_inf=found,
                )  # fmt: skip

    via_torch(params, grads, masters, [], inv_scale, found_inf, call)
    if momentum != 0 and buffers and buffers[0] is not momentum_buffers[0]:
        torch._foreach_copy_(list(momentum_buffers), buffers)  # rounded to the params' dtype


def _args(lists, o: dict) -> tuple:
    params, grads, masters, (bufs,), _ = lists
    if o["momentum"] == 0:
        bufs = []
    elif o.get("half_buffers") and not masters:  # torch.optim.SGD's buffers: the param dtype
        bufs = [b.to(params[0].dtype) for b in bufs]
    first = [i % 2 == 0 for i in range(len(params))]  # new and old buffers in one call
    hyper = (0.1, o["momentum"], 0.1, o["weight_decay"], o["nesterov"], o["wd_after_momentum"])
    stepwise = bool(o.get("stepwise")) and not masters
    extra = (o.get("inv_scale"), o.get("found_inf"), stepwise)
    return (params, grads, bufs, masters, first, *hyper, *extra)


def _samples(dtype: torch.dtype):
    mom = dict(momentum=0.9, weight_decay=0.01, nesterov=False, wd_after_momentum=False)
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
    return opt_samples(dtype, 1, _args, variants)


OP = define(
    "fused_sgd_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] momentum_buffers, "
    "Tensor(c!)[] masters, bool[] first_run, float lr, float momentum, float dampening, "
    "float weight_decay, bool nesterov, bool wd_after_momentum, Tensor? inv_scale=None, "
    "Tensor? found_inf=None, bool stepwise=False) -> ()",
    family="sgd",
    reference=reference_fused_sgd_,
    fake=no_outputs,
    torch_path=_torch_fused_sgd_,
    dtypes=OPT_DTYPES,
    sample_inputs=_samples,  # kernel == reference bit for bit (torch.optim.SGD's arithmetic)
)
_op = OP.overload


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
    stepwise: bool = False,
) -> None:
    """One SGD step over lists, in place (``momentum_buffers`` may be empty without momentum).

    .. math::
        g = \\text{grad}\\, s^{-1} + \\lambda w, \\quad
        b \\leftarrow \\mu b + (1 - d) g \\;(b = g \\text{ on the first run}), \\quad
        g = g + \\mu b \\text{ (nesterov) or } b, \\quad w \\leftarrow w - \\eta g

    With ``wd_after_momentum`` the :math:`\\lambda w` term is added after the momentum.

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
    ensure_kernels()
    _op(
        params, grads, momentum_buffers, masters, first_run, lr, momentum, dampening,
        weight_decay, nesterov, wd_after_momentum, inv_scale, found_inf, stepwise,
    )  # fmt: skip


# ---- pure bf16: stochastic rounding or Kahan summation ------------------------------------

_NAME_BF16 = "fused_sgd_bf16_"


def _sgd_plain(w, g, buf, first: bool, k: dict, momentum, nesterov, wd_after_momentum):
    """The fp32 SGD step of ``fused_sgd_bf16_``: one rounding per operation, no fma (the
    kernels compute exactly these operations). Updates ``buf``; returns the new weight."""
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
    params,
    grads,
    momentum_buffers,
    compensations,
    first_run,
    lr,
    momentum,
    dampening,
    weight_decay,
    nesterov,
    wd_after_momentum,
    rounding,
    seed,
    rng_step,
    inv_scale=None,
    found_inf=None,
) -> None:
    """Reference of :func:`fused_sgd_bf16_`: :func:`_sgd_plain`, then the rounding of
    :mod:`mpnb.core.ops._rounding`."""
    if momentum != 0:
        check_opt_lists(_NAME_BF16, params, grads, [], momentum_buffers)
        _check_first_run(first_run, len(params))
    else:
        check_opt_lists(_NAME_BF16, params, grads, [])
    check_rounding(_NAME_BF16, params, compensations, rounding)
    if not params or skipped(_NAME_BF16, found_inf):
        return
    k = dict(
        lr=f32(lr), momentum=f32(momentum), damp=f32(1 - dampening), wd=f32(weight_decay),
        has_wd=weight_decay != 0,
    )  # fmt: skip
    for i in range(len(params)):
        g, w = unscaled(_NAME_BF16, grads[i], inv_scale), params[i].float()
        buf = momentum_buffers[i] if momentum != 0 else None
        first = bool(first_run[i]) if momentum != 0 else False
        x = _sgd_plain(w, g, buf, first, k, momentum, nesterov, wd_after_momentum)
        comp = compensations[i] if rounding == "kahan" else None
        store_rounded(params[i], comp, x, rounding, seed, rng_step, i)


def _bf16_args(lists, o: dict) -> tuple:
    params, grads, _, (bufs,), _ = lists
    if o["momentum"] == 0:
        bufs = []
    first = [i % 2 == 0 for i in range(len(params))]
    hyper = (o["lr"], o["momentum"], 0.1, o["weight_decay"], o["nesterov"], o["wd_after"])
    comps = bf16_compensations(params) if o["rounding"] == "kahan" else []
    return (
        params, grads, bufs, comps, first, *hyper, o["rounding"], 5, 2, o.get("inv_scale"),
        o.get("found_inf"),
    )  # fmt: skip


def _bf16_samples(dtype: torch.dtype):
    base = dict(lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=False, wd_after=False)
    variants = []
    for rounding in ROUNDINGS:
        r = base | dict(rounding=rounding)
        variants += [
            (f"{rounding}: momentum", r),
            (f"{rounding}: nesterov", r | dict(nesterov=True)),
            (f"{rounding}: wd_after_momentum", r | dict(wd_after=True)),
            (f"{rounding}: no momentum, tiny lr", r | dict(momentum=0.0, lr=1e-5)),
        ]
    return bf16_samples(dtype, 1, _bf16_args, variants)


OP_BF16 = define(
    "fused_sgd_bf16_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] momentum_buffers, "
    "Tensor(c!)[] compensations, bool[] first_run, float lr, float momentum, "
    "float dampening, float weight_decay, bool nesterov, bool wd_after_momentum, "
    "str rounding, int seed, int rng_step, Tensor? inv_scale=None, "
    "Tensor? found_inf=None) -> ()",
    family="sgd",
    reference=reference_fused_sgd_bf16_,
    fake=no_outputs,
    dtypes=(torch.bfloat16,),
    sample_inputs=_bf16_samples,  # kernel == reference bit for bit
)
_op_bf16 = OP_BF16.overload


def fused_sgd_bf16_(
    params,
    grads,
    momentum_buffers,
    compensations,
    first_run,
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
    inv_scale=None,
    found_inf=None,
) -> None:
    """One SGD step of bf16 params without master weights, rounded stochastically or with
    Kahan summation (the math: :mod:`mpnb.core.ops._rounding`).

    The fp32 step is :func:`fused_sgd_`'s formula, one rounding per operation
    (``g + wd * w``, ``b = momentum * b + (1 - dampening) * g``, ``w - lr * g``), from the
    param upcast to fp32.

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
    ensure_kernels()
    _op_bf16(
        params, grads, momentum_buffers, compensations, first_run, lr, momentum, dampening,
        weight_decay, nesterov, wd_after_momentum, rounding, seed, rng_step, inv_scale,
        found_inf,
    )  # fmt: skip
