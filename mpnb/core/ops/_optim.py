"""What the optimizer op families share (``adam``, ``adagrad``, ``sgd``, ``lamb``, ``novograd``).

Every optimizer op updates lists of params in place, with these conventions:

* ``masters``: empty, or one fp32 tensor per param. When given, the master is the weight
  that is updated and ``params`` (fp16/bf16) receive its rounded copy in the same pass.
* ``steps``: one one-element float32 tensor per param (PyTorch's fused-optimizer format),
  incremented by the op itself, so a skipped step never advances the count.
* ``inv_scale``: optional one-element tensor; grads are multiplied by it in fp32 on the fly.
* ``found_inf``: optional one-element tensor; when nonzero on entry the op writes nothing.
  The ops never set it: the caller runs :func:`mpnb.core.ops.multi_tensor_check_finite`
  over all grads first (``csrc/cpu/opt_common.h`` says why).

The references read no device value on the host (on CUDA they are what several ops run): a step
is computed whatever ``found_inf`` holds and written through :func:`commit`, which keeps the old
values where the flag is set (:func:`keep_of`); the step counts advance on the device
(:func:`advance`) and the bias corrections are computed there from them, in fp64 as the kernels
compute them.

This module holds the optimizer ops' argument check (:func:`check_step`), the references'
per-tensor helpers, the recipe that runs PyTorch's own fused optimizer ops on CUDA
(:func:`via_torch`), and the sample builders of the op-table test.
"""

from __future__ import annotations

import math
import operator
import struct
from collections.abc import Callable, Sequence
from typing import Any

import torch

from mpnb.core.ops._checks import check_lengths, check_one, check_tensors
from mpnb.core.ops._library import Sample

__all__ = [
    "OPT_DTYPES",
    "advance",
    "bf16_compensations",
    "bf16_samples",
    "check_lr",
    "check_step",
    "check_steps",
    "commit",
    "correction",
    "f32",
    "f32_value",
    "keep_of",
    "lists_for",
    "lr_value",
    "opt_samples",
    "opt_tolerance",
    "store",
    "unscaled",
    "via_torch",
    "weight",
]

#: The param (and grad) dtypes of the optimizer ops; state and masters are always fp32.
OPT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

Tensors = Sequence[torch.Tensor]
_DEVICE = operator.attrgetter("device")


# ---- the check ------------------------------------------------------------------------------


def check_step(args: Any, per_tensor: bool, *states: str, masters: str | None = "masters") -> None:
    """The check of an optimizer step: ``params`` and ``grads`` of one fp32/fp16/bf16 dtype
    per list, ``masters`` empty or one fp32 tensor per param, each list of ``states`` fp32
    and paired with the params, ``steps`` (when the op has them) one one-element fp32 tensor
    per param, ``inv_scale`` and ``found_inf`` one value each."""
    op, params = args.op_name, args.params
    for name in ("params", "grads"):
        lst = getattr(args, name)
        if lst and lst[0].dtype not in OPT_DTYPES:
            raise TypeError(
                f"{op}: '{name}' are {lst[0].dtype}; the optimizer ops take float32, float16 "
                "or bfloat16 params and grads (keep fp64 models on torch.optim)."
            )
    lists = {"params": params, "grads": args.grads}
    m = getattr(args, masters) if masters else None
    if m:
        if len(m) != len(params):
            raise ValueError(
                f"{op}: 'masters' must be empty (no master weights) or hold one fp32 tensor per "
                f"param, got {len(m)} for {len(params)} params."
            )
        if m[0].dtype != torch.float32:
            raise TypeError(
                f"{op}: master weights must be float32, got {m[0].dtype}; pass fp32 copies of "
                "the params (or no masters)."
            )
        lists["masters"] = m
    for name in states:
        lst = getattr(args, name)
        if lst and lst[0].dtype != torch.float32:
            raise TypeError(
                f"{op}: optimizer state must be float32, got {lst[0].dtype}; keep state in "
                "fp32 (the optimizers do)."
            )
        lists[name] = lst
    check_lengths(op, **lists)  # the dtypes are checked above (check_lists' other half)
    steps = getattr(args, "steps", None)
    if steps is not None:
        check_steps(op, steps, params, per_tensor)
    check_one(op, "inv_scale", args.inv_scale)
    check_one(op, "found_inf", args.found_inf)
    check_lr(op, getattr(args, "lr_tensor", None), params)
    if per_tensor:
        check_tensors(op, **lists)


def check_lr(op: str, lr_tensor: torch.Tensor | None, params: Tensors) -> None:
    """``lr_tensor``, when given, is one float32 value on the params' device (as torch's
    capturable optimizers hold the learning rate); checked without reading it."""
    if lr_tensor is None:
        return
    if lr_tensor.numel() != 1 or lr_tensor.dtype != torch.float32:
        raise TypeError(
            f"{op}: lr_tensor must be a one-element float32 tensor (the learning rate on the "
            f"device), got {lr_tensor.dtype} with {lr_tensor.numel()} elements; create it with "
            "torch.tensor(lr, dtype=torch.float32, device=param.device)."
        )
    if params and lr_tensor.device != params[0].device:
        raise ValueError(
            f"{op}: lr_tensor is on {lr_tensor.device} but the params are on "
            f"{params[0].device}; keep the learning rate tensor on the params' device "
            "(FusedAdam(capturable=True) puts it there)."
        )


def check_steps(op: str, steps: Tensors, params: Tensors, per_tensor: bool) -> None:
    """One one-element float32 step tensor per param, on its param's device."""
    if len(steps) != len(params):
        raise ValueError(
            f"{op}: 'steps' must hold one tensor per param, got {len(steps)} for "
            f"{len(params)}; pass one one-element float32 tensor per param."
        )
    if not per_tensor:
        return
    if (
        all(n == 1 for n in map(torch.Tensor.numel, steps))
        and {s.dtype for s in steps} == {torch.float32}
        and list(map(_DEVICE, steps)) == list(map(_DEVICE, params))
    ):
        return  # the passing case in C-level passes; the loop below names the culprit
    for i, (s, p) in enumerate(zip(steps, params, strict=True)):
        if s.numel() != 1 or s.dtype != torch.float32:
            raise TypeError(
                f"{op}: steps[{i}] must be a one-element float32 tensor (torch's fused "
                f"optimizers' format), got {s.dtype} with {s.numel()} elements; create it "
                "with torch.tensor(0.0)."
            )
        if s.device != p.device:
            raise ValueError(
                f"{op}: steps[{i}] is on {s.device} but its param is on {p.device}; keep "
                "each step on its param's device."
            )


# ---- the references' per-tensor steps -------------------------------------------------------


def keep_of(found_inf: torch.Tensor | None, device) -> torch.Tensor | None:
    """The step's write mask: a 0-dim bool tensor on ``device``, True when ``found_inf`` is
    zero (the step writes), or None without a flag (every write happens). No host read."""
    if found_inf is None:
        return None
    return found_inf.reshape(()).to(device) == 0


def commit(keep: torch.Tensor | None, target: torch.Tensor, new: torch.Tensor) -> None:
    """``target = new`` (rounded to ``target``'s dtype), or unchanged where ``keep`` is False
    (a skipped step), on the device."""
    if keep is None:
        target.copy_(new)
    else:
        target.copy_(torch.where(keep, new, target))


def unscaled(g: torch.Tensor, inv_scale: torch.Tensor | None) -> torch.Tensor:
    """The grad in fp32, multiplied by ``inv_scale`` (rounded to fp32) when one is given."""
    g = g.float()
    if inv_scale is not None:
        g = g * inv_scale.reshape(()).to(device=g.device, dtype=torch.float32)
    return g


def f32(x: float | torch.Tensor) -> torch.Tensor:
    """A hyper-parameter as a 0-dim fp32 tensor: rounded to fp32 once, as the kernels hold it
    (a tensor, such as one computed from :func:`lr_value`, is rounded on its device)."""
    if isinstance(x, torch.Tensor):
        return x.float()
    return torch.tensor(x, dtype=torch.float32)


def lr_value(lr: float, lr_tensor: torch.Tensor | None) -> float | torch.Tensor:
    """The step's learning rate: the host number ``lr``, or, when ``lr_tensor`` is given, its
    value as a 0-dim fp64 tensor on its device (exact: fp32 widens to fp64; no host read), so
    the references compute with it in fp64 as the kernels do with ``lr``."""
    return lr if lr_tensor is None else lr_tensor.reshape(()).double()


def f32_value(x: float) -> float:
    """``x`` rounded to fp32, as a Python float (host arithmetic: no tensor is read)."""
    try:
        return struct.unpack("<f", struct.pack("<f", x))[0]
    except OverflowError:  # beyond fp32's range
        return math.copysign(math.inf, x)


def weight(params: Tensors, masters: Tensors, i: int) -> torch.Tensor:
    """A fresh fp32 copy of weight ``i``: its master, or the param widened."""
    return masters[i].clone() if masters else params[i].to(torch.float32, copy=True)


def store(
    params: Tensors, masters: Tensors, i: int, w: torch.Tensor, keep: torch.Tensor | None = None
) -> None:
    """Write the new fp32 weight ``i`` into its master and (rounded) into its param, through
    :func:`commit` (nothing where ``keep`` is False)."""
    if masters:
        commit(keep, masters[i], w)
    commit(keep, params[i], w)


def advance(step: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
    """``step += 1`` in fp32 on the device, as the kernel (not where ``keep`` is False);
    returns the new count as a 0-dim fp64 tensor, for the bias corrections."""
    step.add_(1 if keep is None else keep.to(step.dtype))
    return step.reshape(()).double()


def correction(beta: float, step: torch.Tensor, on: bool = True) -> torch.Tensor:
    """``1 - beta^t`` in fp64 on ``step``'s device (1 when ``on`` is False), as the kernels
    compute it (``std::pow`` in fp64)."""
    if not on:
        return torch.ones((), dtype=torch.float64, device=step.device)
    return 1 - torch.pow(beta, step)


# ---- PyTorch's fused ops (CUDA) ---------------------------------------------------------------


def _fp32_weights(params: Tensors, masters: Tensors) -> list[torch.Tensor]:
    # The fp32 tensors PyTorch's op updates: the masters, fp32 params themselves, or copies.
    if masters:
        return list(masters)
    return [p if p.dtype == torch.float32 else p.float() for p in params]


def _fp32_grads(grads: Tensors, inv_scale: torch.Tensor | None) -> list[torch.Tensor]:
    # Always copies: PyTorch's CUDA fused ops write their (unscaled, decayed) grads back.
    g32 = [g.to(torch.float32, copy=True) for g in grads]
    if inv_scale is not None:
        inv = inv_scale.to(device=g32[0].device, dtype=torch.float32).reshape(())
        torch._foreach_mul_(g32, inv)
    return g32


def via_torch(args: Any, call: Callable[[list, list, torch.Tensor | None], None]) -> None:
    """Run one of PyTorch's fused optimizer ops on an optimizer op's ``args``, under the
    conventions of this module.

    ``call(weights, grads, found)`` runs the op on fp32 weights (the masters, fp32 params, or
    fp32 copies of half params) and fp32 unscaled copies of the grads (``grad * inv_scale``,
    as the kernels do; PyTorch's own ``grad_scale`` would divide and write the grads back),
    with ``found`` the flag as a 0-dim fp32 tensor. The step counts (``args.steps``, when the
    op has them) are advanced before the call and a flagged step's advance is undone after
    it, on the device (PyTorch's recipe: no host sync); the fp32 weights are then cast back
    into half params in one ``_foreach_copy_``.
    """
    params, steps, found_inf = args.params, getattr(args, "steps", ()), args.found_inf
    if not params:
        return
    w = _fp32_weights(params, args.masters)
    found = None
    if found_inf is not None:
        found = found_inf.to(device=params[0].device, dtype=torch.float32).reshape(())
    if steps:
        torch._foreach_add_(list(steps), 1)
    call(w, _fp32_grads(args.grads, args.inv_scale), found)
    if found is not None and steps:
        torch._foreach_sub_(list(steps), [found] * len(steps))
    if params[0].dtype != torch.float32:
        torch._foreach_copy_(list(params), w)


# ---- samples and tolerances for the op-table test ---------------------------------------------


def opt_tolerance(fp32_atol: float) -> dict:
    """An optimizer op's kernel-vs-reference tolerance, per (case dtype, tensor dtype).

    The kernels mirror PyTorch's fused CPU kernels (explicit fmas, a per-tensor step size
    rounded once), the references PyTorch's single-tensor ops: the fp32 values (weights,
    masters, state) agree to 2 ulp, plus ``fp32_atol`` for values that cancel to near zero;
    half params (the fp32 weight rounded once) agree to 1 ulp of their dtype (an fp32 weight
    within an ulp of a rounding midpoint may round either way). Everything else (grads, step
    counts) is bitwise. Measured on this op's samples, kernel vs reference.
    """
    fp32 = (2 * torch.finfo(torch.float32).eps, fp32_atol)
    return {
        torch.float32: fp32,
        torch.float16: (torch.finfo(torch.float16).eps, 2.0**-24),  # + one subnormal ulp
        torch.bfloat16: (torch.finfo(torch.bfloat16).eps, 0.0),
        (torch.float16, torch.float32): fp32,
        (torch.bfloat16, torch.float32): fp32,
    }


#: Odd sizes: a lone element, a partial vector block, several chunks (32768 elements each), and
#: enough in all (> 2^17) for the kernels' parallel path.
SIZES = (1, 7, 33, 4099, 70001, 65536 + 3)


def lists_for(
    pdt: torch.dtype,
    gdt: torch.dtype,
    master: bool,
    nstate: int,
    sizes: Sequence[int] = SIZES,
    seed: int = 0,
    grad_scale: float = 1.0,
    step: float = 3.0,
) -> tuple[list, list, list, list[list], list]:
    """``(params, grads, masters, states, steps)`` of one optimizer call, seeded.

    Params of ``pdt`` (with fp32 masters holding their exact values when ``master``), grads of
    ``gdt`` times ``grad_scale``, ``nstate`` fp32 state lists of small positive values, and one
    step tensor per param holding ``step``.
    """
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(n, generator=g).to(pdt) for n in sizes]
    grads = [(torch.randn(n, generator=g) * grad_scale).to(gdt) for n in sizes]
    masters = [p.float() for p in params] if master else []
    states = [[torch.rand(n, generator=g) * 0.1 for n in sizes] for _ in range(nstate)]
    steps = [torch.tensor(step) for _ in sizes]
    return params, grads, masters, states, steps


def _other(dtype: torch.dtype) -> torch.dtype:
    return {torch.float32: torch.bfloat16, torch.bfloat16: torch.float16}.get(dtype, torch.float32)


Adapt = Callable[[dict], dict]


def _kwargs(lists: tuple, states: Sequence[str], options: dict, adapt: Adapt | None) -> dict:
    params, grads, masters, state_lists, steps = lists
    kw = dict(params=params, grads=grads, masters=masters, steps=steps)
    kw |= dict(zip(states, state_lists, strict=True)) | options
    return adapt(kw) if adapt is not None else kw


def opt_samples(
    dtype: torch.dtype,
    states: Sequence[str],
    variants: Sequence[tuple[str, dict]],
    adapt: Adapt | None = None,
):
    """The op-table samples of one optimizer op for params of ``dtype``.

    Each ``(name, options)`` of ``variants`` (the op's own modes) gives the op's arguments by
    name beside the lists (its hyper-parameters, ``inv_scale``, ``found_inf``; an option
    ``sizes`` replaces the default tensor sizes of that call); ``states`` names the op's fp32
    state lists, and ``adapt(kwargs)`` turns what is not yet an argument into one (a list the
    op names otherwise, a norm given as a number...). Yields, for each variant, a call on
    params of ``dtype`` and grads of another dtype, with fp32 masters for half params; then
    the shared cases: params and grads of ``dtype`` without masters, masters with an
    ``inv_scale`` and a clear ``found_inf``, a set ``found_inf`` (nothing may change, step
    counts included) and empty lists.
    """
    half = dtype != torch.float32
    inv = torch.full((1,), 1 / 64)  # the grads of the scaled cases are 64 times too large
    for k, (name, options) in enumerate(variants):
        options = dict(options)
        sizes = options.pop("sizes", SIZES)
        lists = lists_for(dtype, _other(dtype), half, len(states), sizes, seed=k)
        yield Sample(_kwargs(lists, states, options, adapt), name=name)
    base = {k: v for k, v in variants[0][1].items() if k != "sizes"}
    shared = (
        ("same-dtype grads, no masters", dict(master=False, gdt=dtype), {}),
        ("masters, inv_scale", dict(master=True), dict(inv_scale=inv, found_inf=torch.zeros(1))),
        (
            "found_inf set",
            dict(master=half),
            dict(inv_scale=inv, found_inf=torch.ones(1, dtype=torch.int32)),
        ),
        ("empty lists", dict(master=half, sizes=()), dict(inv_scale=inv)),
    )
    for k, (name, lists_kw, extra) in enumerate(shared, start=len(variants)):
        kw = dict(pdt=dtype, gdt=_other(dtype), nstate=len(states), seed=k) | lists_kw
        if "inv_scale" in extra:
            kw["grad_scale"] = 64.0
        lists = lists_for(**kw)
        yield Sample(_kwargs(lists, states, base | extra, adapt), name=name)


def bf16_compensations(params: Tensors, seed: int = 11) -> list[torch.Tensor]:
    """Kahan compensation buffers for the samples: small bf16 values, as a run leaves them."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(p.numel(), generator=g) * 1e-4).to(torch.bfloat16) for p in params]


#: Many small tensors of odd sizes (one call of a model with many layers).
MANY = tuple(1 + (37 * k) % 300 for k in range(40))


def _bf16_adapt(adapt: Adapt | None) -> Adapt:
    def bf16(kw: dict) -> dict:
        del kw["masters"]  # the pure-bf16 ops have compensations instead
        kw["compensations"] = bf16_compensations(kw["params"]) if kw["rounding"] == "kahan" else []
        return adapt(kw) if adapt is not None else kw

    return bf16


def bf16_samples(
    dtype: torch.dtype,
    states: Sequence[str],
    variants: Sequence[tuple[str, dict]],
    adapt: Adapt | None = None,
):
    """The op-table samples of a pure-bf16 optimizer op (``fused_<opt>_bf16_``).

    ``states``, ``variants`` and ``adapt`` as for :func:`opt_samples`; the options hold
    ``rounding`` (Kahan summation gets compensation buffers). Yields each of ``variants``
    (bf16 params, fp32 grads), then, for each rounding of the first variants: bf16 grads over
    many small tensors, scaled grads with a clear ``found_inf``, a set ``found_inf`` (nothing
    may change), and empty lists.
    """
    assert dtype == torch.bfloat16, "the pure-bf16 ops take bf16 params only"
    adapt = _bf16_adapt(adapt)
    for k, (name, options) in enumerate(variants):
        options = dict(options)
        sizes = options.pop("sizes", SIZES)
        lists = lists_for(dtype, torch.float32, False, len(states), sizes, seed=k)
        yield Sample(_kwargs(lists, states, options, adapt), name=name)
    inv = torch.full((1,), 1 / 64)
    firsts = {}
    for _, options in variants:
        firsts.setdefault(options["rounding"], {k: v for k, v in options.items() if k != "sizes"})
    for r, base in firsts.items():
        shared = (
            ("bf16 grads, many tensors", dict(gdt=dtype, sizes=MANY), {}),
            ("inv_scale", dict(grad_scale=64.0), dict(inv_scale=inv, found_inf=torch.zeros(1))),
            (
                "found_inf set",
                dict(grad_scale=64.0),
                dict(inv_scale=inv, found_inf=torch.ones(1, dtype=torch.int32)),
            ),
            ("empty lists", dict(sizes=()), {}),
        )
        for k, (name, lists_kw, extra) in enumerate(shared, start=len(variants)):
            kw = dict(pdt=dtype, gdt=torch.float32, master=False, nstate=len(states), seed=k)
            lists = lists_for(**(kw | lists_kw))
            yield Sample(_kwargs(lists, states, base | extra, adapt), name=f"{r}: {name}")
