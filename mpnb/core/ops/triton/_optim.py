"""What the Triton optimizer steps share: their list checks, the step counter, fp64 powers.

Conventions are those of the optimizer ops (:mod:`mpnb.core.ops.adam` and its siblings):
``masters`` empty or one fp32 tensor per param (the weight updated; ``params`` then receive
its rounded copy in the same pass), ``steps`` one one-element fp32 tensor per param,
``inv_scale`` multiplied into the grads in fp32, and ``found_inf``: when nonzero on entry
nothing is written, step counts included. The flag is read on the device (no host sync):
every store is masked by it and :func:`advance_steps` adds ``found_inf == 0`` to each step
after the update.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mpnb.core.ops.triton._checks import ListIds, check_same_device, guard_lists
from mpnb.core.ops.triton._chunks import ChunkTable
from mpnb.core.ops.triton._common import flag_view, from_acc, launch, to_acc

__all__ = [
    "OPT_DTYPES",
    "check_flags",
    "guard_step",
    "advance_steps",
    "pow64",
    "bias_corrections",
    "step_of",
    "not_found",
    "load_scale",
    "learning_rate",
    "load_grad",
    "load_weight",
    "store_weight",
]

OPT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_STEP_BLOCK = 256


def check_flags(args) -> None:
    """Raise unless ``inv_scale`` and ``found_inf`` (read by address) live on the params'
    device (the one guard the op's check cannot know: :mod:`._checks`)."""
    if args.params:
        flags = dict(inv_scale=args.inv_scale, found_inf=args.found_inf)
        flags["lr_tensor"] = getattr(args, "lr_tensor", None)
        check_same_device(args.op_name, args.params[0], **flags)


def guard_step(
    args, *states: str, masters: str | None = "masters", rounding: bool = False
) -> ListIds | None:
    """The per-tensor checks of an optimizer step (:func:`mpnb.core.ops._optim.check_step`'s,
    and the momentum's and rounding's where the op has them) in one pass, through
    :func:`~mpnb.core.ops.triton._checks.guard_lists`: ``params``, ``grads``, the ``states``,
    the masters, the momentum buffers (with momentum) and the compensations paired tensor by
    tensor; ``steps`` one fp32 value each; bf16 compensations and params below 2^32 elements
    with a ``rounding``. Returns the lists' ids for the chunk table."""
    data = ["params", "grads", *states]
    if masters:
        data.append(masters)
    if getattr(args, "momentum", 0) != 0:
        data.append("momentum_buffers")
    dtypes = {"steps": torch.float32}
    if rounding:
        data.append("compensations")
        dtypes["compensations"] = torch.bfloat16
    return guard_lists(
        args,
        data,
        singles=("steps",),
        below_2e32=("params",) if rounding else (),
        dtypes=dtypes,
    )


@triton.jit
def pow64(base, n):
    """``base ** n`` in fp64 for an integer ``n`` in [0, 2**31), by repeated squaring."""
    acc = tl.full((), 1.0, tl.float64)
    b = base
    e = n
    for _ in range(31):
        acc = tl.where((e & 1) != 0, acc * b, acc)
        b = b * b
        e = e >> 1
    return acc


@triton.jit
def bias_corrections(step, beta1, beta2):
    """``(1 - beta1**step, 1 - beta2**step)`` in fp64 (``step`` a whole fp32 count)."""
    n = step.to(tl.int32)
    return 1.0 - pow64(beta1, n), 1.0 - pow64(beta2, n)


@triton.jit
def step_of(table, t, col, carrier, ROW: tl.constexpr):
    """The step count this update uses: the stored count plus one."""
    addr = tl.load(table + t * ROW + col)
    return tl.load(addr.to(tl.pointer_type(carrier.dtype.element_ty))) + 1.0


@triton.jit
def not_found(found_ptr, HAS_FOUND: tl.constexpr):
    """1 unless the caller's overflow flag is set, then 0 (int32: multiply a count by it).

    A flagged step then runs no loop at all: nothing is read or written.
    """
    if HAS_FOUND:
        ok = (to_acc(tl.load(found_ptr), tl.float32) == 0.0).to(tl.int32)
    else:
        ok = tl.full((), 1, tl.int32)
    return ok


@triton.jit
def load_scale(inv_ptr, HAS_INV: tl.constexpr):
    """The grads' unscale factor ``inv_scale`` in fp32 (1 without one)."""
    if HAS_INV:
        inv = to_acc(tl.load(inv_ptr), tl.float32)
    else:
        inv = tl.full((), 1.0, tl.float32)
    return inv


@triton.jit
def learning_rate(lr_ptr, lr_hi, lr_lo, wd_hi, wd_lo, neg_lr, decay, HAS_LR_T: tl.constexpr):
    """``(lr, -lr, 1 - lr * weight_decay)``: lr in fp64, the other two in fp32, rounded once.

    From the host's numbers (``lr`` split in two fp32 halves, ``neg_lr`` and ``decay`` rounded
    on the host), or, with ``HAS_LR_T``, from the fp32 learning rate at ``lr_ptr`` (the op's
    ``lr_tensor``: a captured step reads whatever an LR schedule last wrote there).
    """
    if HAS_LR_T:
        lr = tl.load(lr_ptr).to(tl.float64)
        out_neg = (-lr).to(tl.float32)
        out_decay = (1.0 - lr * (tl.cast(wd_hi, tl.float64) + tl.cast(wd_lo, tl.float64))).to(
            tl.float32
        )
    else:
        lr = tl.cast(lr_hi, tl.float64) + tl.cast(lr_lo, tl.float64)
        out_neg = tl.cast(neg_lr, tl.float32)
        out_decay = tl.cast(decay, tl.float32)
    return lr, out_neg, out_decay


@triton.jit
def load_grad(g_ptr, offs, mask, inv, HAS_INV: tl.constexpr):
    """Grads widened to fp32 and unscaled."""
    g = to_acc(tl.load(g_ptr + offs, mask=mask, other=0.0), tl.float32)
    if HAS_INV:
        g = g * inv
    return g


@triton.jit
def load_weight(p_ptr, w_ptr, offs, mask, HAS_MASTER: tl.constexpr):
    """The fp32 weight: the master, or the param widened."""
    if HAS_MASTER:
        w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    else:
        w = to_acc(tl.load(p_ptr + offs, mask=mask, other=0.0), tl.float32)
    return w


@triton.jit
def store_weight(p_ptr, w_ptr, offs, w, mask, HAS_MASTER: tl.constexpr):
    """Write the updated fp32 weight: into the master, and rounded into the param."""
    if HAS_MASTER:
        tl.store(w_ptr + offs, w, mask=mask)
    tl.store(p_ptr + offs, from_acc(w, p_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _advance_kernel(
    table,
    n_tensors,
    found_ptr,
    s0,
    COL: tl.constexpr,
    HAS_FOUND: tl.constexpr,
    ROW: tl.constexpr,
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = t < n_tensors * not_found(found_ptr, HAS_FOUND)
    addr = tl.load(table + t.to(tl.int64) * ROW + COL, mask=m, other=0)
    ptr = addr.to(tl.pointer_type(s0.dtype.element_ty))
    tl.store(ptr, tl.load(ptr, mask=m) + 1.0, mask=m)


def advance_steps(tab: ChunkTable, col: int, steps, found_inf) -> None:
    """``steps[i] += 1`` for every tensor (in table column ``col``) unless ``found_inf``."""
    if not tab.n_tensors:
        return
    launch(
        _advance_kernel,
        (triton.cdiv(tab.n_tensors, _STEP_BLOCK),),
        tab.table,
        tab.n_tensors,
        tab.table if found_inf is None else flag_view(found_inf),
        steps[0],
        COL=col,
        HAS_FOUND=found_inf is not None,
        ROW=tab.row,
        BLOCK=_STEP_BLOCK,
    )
