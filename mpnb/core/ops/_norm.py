"""What the two norm families (``layer_norm.py``, ``rms_norm.py``) share: their argument
checks, the backward formula, the fakes and the test samples.

A norm views its input as rows ``[M, N]`` (``N = prod(normalized_shape)``); ``mean`` and
``invvar`` hold one fp32 value per row (fp64 for fp64 input; fp16-rounded values for an fp16
layer norm with ``torch_stats``, see :func:`saves_half_stats`). ``saved`` is the input, or the
output when ``memory_efficient`` (the backward then recomputes ``xhat = (y - b) / w``, as Apex
does). The checks are the ops' only ones (``csrc/cpu/norm_common.h`` keeps the kernels in
bounds, with short messages).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch

from mpnb.core._numbers import positive_finite
from mpnb.core.ops._checks import acc_dtype, check_float, check_param, norm_rows
from mpnb.core.ops._library import Sample

Shape = Sequence[int]


def rows_cols(x: torch.Tensor, shape: Shape) -> tuple[int, int]:
    """``(rows, cols)`` of ``x`` normalized over its trailing ``shape`` (checked before)."""
    cols = 1
    for s in shape:
        cols *= int(s)
    return (x.numel() // cols if cols else 0), cols


def _check_params(op: str, x: torch.Tensor, weight, bias, cols: int) -> None:
    check_param(op, x, weight, cols, "weight")
    check_param(op, x, bias, cols, "bias")
    if weight is not None and bias is not None and weight.dtype != bias.dtype:
        raise TypeError(
            f"{op}: weight is {weight.dtype} but bias is {bias.dtype}; give them one dtype."
        )


def check_eps(eps, owner: str) -> float:
    """``eps`` as a float, or a ValueError naming ``owner`` and the fix: a norm's ``eps`` is
    added to the variance (mean square): a negative one gives NaN rows, an infinite one zeros.

    Example::

        >>> check_eps(1e-5, "FusedLayerNorm")
        1e-05
    """
    fix = "pass eps= a small number >= 0 such as 1e-5"
    return positive_finite(eps, "eps", owner=owner, fix=fix, allow_zero=True)


def check_forward(args: Any, per_tensor: bool) -> None:
    """The check of a norm forward (``args.bias`` absent for RMS norm)."""
    op, x = args.op_name, args.input
    check_eps(args.eps, op)
    check_float(op, x, "input")
    _, cols = norm_rows(op, x, args.normalized_shape)
    _check_params(op, x, args.weight, getattr(args, "bias", None), cols)


def check_backward(args: Any, per_tensor: bool) -> None:
    """The check of a norm backward (``args.mean`` and ``args.bias`` absent for RMS norm)."""
    op, grad_out, saved, invvar = args.op_name, args.grad_out, args.saved, args.invvar
    check_float(op, saved, "saved")
    rows, cols = norm_rows(op, saved, args.normalized_shape)
    if grad_out.shape != saved.shape or grad_out.dtype != saved.dtype:
        raise ValueError(
            f"{op}: grad_out {tuple(grad_out.shape)} {grad_out.dtype} does not match the saved "
            f"tensor {tuple(saved.shape)} {saved.dtype}; pass the gradient of the forward's "
            "output."
        )
    if grad_out.device != saved.device:
        raise ValueError(
            f"{op}: grad_out is on {grad_out.device} but the saved tensor is on "
            f"{saved.device}; pass the gradient of the forward's output."
        )
    acc = acc_dtype(saved)
    if invvar.numel() != rows or invvar.dtype != acc:
        raise ValueError(
            f"{op}: invvar must hold one {acc} per row ({rows}), got {invvar.numel()} of "
            f"{invvar.dtype}; pass the invvar the forward returned."
        )
    mean = getattr(args, "mean", None)
    if mean is not None and not args.memory_efficient and mean.numel() != rows:
        raise ValueError(
            f"{op}: mean must hold one value per row ({rows}), got {mean.numel()}; pass the "
            "mean the forward returned."
        )
    _check_params(op, saved, args.weight, getattr(args, "bias", None), cols)


def saves_half_stats(x: torch.Tensor, weight, bias) -> bool:
    """Whether PyTorch's own layer norm of these tensors saves its statistics in fp16.

    PyTorch's CPU ``native_layer_norm`` computes the mean and rstd of a half row in fp32, writes
    the output from them, and returns them in the parameters' dtype: fp16 for an fp16 input
    with fp16 parameters or none, and its backward reads them back from fp16. Its CUDA kernel
    keeps them in fp32 (the accumulation type), as mpnb does, and so does an fp16 input with
    fp32 parameters (the mixed layers) on both. This is the rule ``torch_stats`` follows
    (:func:`mpnb.core.ops.layer_norm.layer_norm_fwd`), for fp16 only: bf16 statistics stay
    fp32 (PyTorch's CPU kernel rounds them to bf16, 2**-9 of rstd; Apex's bf16 tolerance holds
    without it).

    Example::

        >>> saves_half_stats(torch.randn(2, 8).half(), None, None)
        True
    """
    p = weight if weight is not None else bias
    half = x.dtype == torch.float16 and (p is None or p.dtype == torch.float16)
    return half and x.device.type == "cpu"


def round_half_stats(*stats: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each fp32 statistic rounded to fp16 (to nearest even) and widened back: the values
    PyTorch's CPU layer norm saves (see :func:`saves_half_stats`), kept in the ops' fp32."""
    return tuple(t.to(torch.float16).to(t.dtype) for t in stats)


def _xhat(saved, mean, invvar, weight, bias, rows, cols, memory_efficient, acc):
    s = saved.reshape(rows, cols).to(acc)
    if not memory_efficient:
        return s * invvar[:, None] if mean is None else (s - mean[:, None]) * invvar[:, None]
    if bias is not None:
        s = s - bias.reshape(cols).to(acc)
    if weight is not None:
        s = s / weight.reshape(cols).to(acc)
    return s


def backward(grad_out, saved, mean, invvar, rows, cols, weight, bias, memory_efficient):
    """``(dx, dw, db)`` of a norm in fp32 (fp64 for fp64); ``mean`` None: RMS norm.

    ``dx = invvar * (g - xhat * mean(g * xhat) - mean(g))`` with ``g = dy * w`` (RMS norm drops
    the last term); ``dw = sum(dy * xhat)``, ``db = sum(dy)`` over the rows; a missing weight
    or bias gets an empty gradient.
    """
    acc = acc_dtype(saved)
    rms = mean is None
    xhat = _xhat(saved, mean, invvar, weight, bias, rows, cols, memory_efficient, acc)
    dy = grad_out.reshape(rows, cols).to(acc)
    g = dy * weight.reshape(cols).to(acc) if weight is not None else dy
    dx = g - xhat * (g * xhat).mean(dim=1, keepdim=True)
    if not rms:
        dx = dx - g.mean(dim=1, keepdim=True)
    dx = (dx * invvar[:, None]).to(saved.dtype).reshape(saved.shape)
    empty = saved.new_empty(0)
    dw = empty if weight is None else (dy * xhat).sum(0).to(weight.dtype).view(weight.shape)
    db = empty if bias is None else dy.sum(0).to(bias.dtype).view(bias.shape)
    return dx, dw, db


# ---- fakes ----------------------------------------------------------------------------------


def fake_like(x: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor like ``x`` (every output the kernels allocate is contiguous)."""
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def fake_grad(p, saved: torch.Tensor) -> torch.Tensor:
    """The gradient of an optional parameter: like ``p``, or empty when there is none."""
    return saved.new_empty(0) if p is None else fake_like(p)


# ---- test samples ---------------------------------------------------------------------------

#: Kernel vs reference, measured over the samples below (with a margin for the weight/bias
#: gradients, whose per-thread partial sums depend on the number of threads): fp32 statistics
#: and sums differ in summation order only; a half output is within one rounding (rtol one
#: ulp) of values that agree to ~1e-7.
TOLERANCE = {
    torch.float32: (1e-6, 2e-6),
    torch.float64: (1e-12, 1e-15),
    torch.float16: (2**-10, 1e-6),
    torch.bfloat16: (2**-7, 1e-6),
}


def sample_data(rows, cols, dtype, wdtype=None, seed=0, shape=None):
    """``(x, w, b, dy)``: ``x`` with a nonzero mean, ``w`` in [0.5, 1.5) (never 0, which the
    memory-efficient backward divides by), ``b`` and ``dy`` standard normal."""
    g = torch.Generator().manual_seed(seed)
    shape = shape or (rows, cols)
    x = (torch.randn(shape, generator=g, dtype=torch.float64) * 2 + 0.5).to(dtype)
    w = (torch.rand(cols, generator=g, dtype=torch.float64) + 0.5).to(wdtype or dtype)
    b = torch.randn(cols, generator=g, dtype=torch.float64).to(wdtype or dtype)
    dy = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    return x, w, b, dy


def sample_cases(dtype: torch.dtype) -> Iterator[dict]:
    """The norm configurations the op-table test sweeps, as keyword dicts.

    Keys: ``rows``, ``cols``, ``shape`` (the input's shape, default ``(rows, cols)``),
    ``nshape`` (normalized_shape), ``affine`` (``"wb"``, ``"w"``, ``"b"`` or ``""``), ``wdtype``
    (the parameters' dtype), ``me`` (memory_efficient), ``grad`` (leaves require grad),
    ``transpose`` (a non-contiguous input).
    The first case of each dtype is the one opcheck runs: across the dtypes it covers both
    ``memory_efficient`` settings and fp32 weights with a half input (the mixed layers).
    """
    half = dtype in (torch.float16, torch.bfloat16)
    first_me = dtype in (torch.float16, torch.float64)
    yield dict(rows=3, cols=7, me=first_me, grad=True, wdtype=torch.float32 if half else dtype)
    for i, cols in enumerate((1, 3, 1000, 4097)):
        yield dict(rows=5, cols=cols, me=bool(i % 2))
    if half:
        for me in (False, True):
            yield dict(rows=9, cols=1000, me=me, wdtype=torch.float32)
        for affine in ("w", "b"):
            yield dict(rows=4, cols=33, affine=affine, me=True, wdtype=torch.float32)
    for affine in ("", "w", "b"):
        yield dict(rows=4, cols=33, affine=affine, me=affine != "")
    yield dict(rows=24, cols=30, shape=(4, 6, 10, 3), nshape=(10, 3), transpose=True)
    yield dict(rows=0, cols=8)


def sample_tensors(dtype: torch.dtype, case: dict):
    """The tensors of one case: ``(x, w, b, dy, nshape)`` (``w``/``b`` None when not affine)."""
    rows, cols = case["rows"], case["cols"]
    shape = case.get("shape")
    x, w, b, dy = sample_data(rows, cols, dtype, case.get("wdtype"), seed=rows + cols, shape=shape)
    nshape = list(case.get("nshape", (cols,)))
    if len(nshape) > 1:
        w, b = w.reshape(nshape), b.reshape(nshape)
    if case.get("transpose"):
        x = x.transpose(0, 1).contiguous().transpose(0, 1)  # same values, strided memory
        dy = dy.transpose(0, 1).contiguous().transpose(0, 1)
    affine = case.get("affine", "wb")
    w = w if "w" in affine else None
    b = b if "b" in affine else None
    if case.get("grad"):
        x, w, b = (t.requires_grad_(True) if t is not None else None for t in (x, w, b))
    return x, w, b, dy, nshape


def sample_name(case: dict) -> str:
    """A short readable name of a case."""
    keys = ("rows", "cols", "nshape", "affine", "wdtype", "me", "transpose")
    return " ".join(f"{k}={case[k]}" for k in keys if k in case)


def backward_samples(dtype: torch.dtype, forward, rms: bool) -> Iterator[Sample]:
    """Samples of a norm backward: every forward case, its statistics from ``forward``."""
    for case in sample_cases(dtype):
        x, w, b, dy, nshape = sample_tensors(dtype, {**case, "grad": False})
        me = case.get("me", False)
        if rms:
            y, invvar = forward(x, nshape, w, 1e-5)
            kw = dict(invvar=invvar, weight=w)
        else:
            y, mean, invvar = forward(x, nshape, w, b, 1e-5)
            kw = dict(mean=mean, invvar=invvar, weight=w, bias=b)
        kw |= dict(grad_out=dy, saved=y if me else x, normalized_shape=nshape)
        yield Sample(kw | dict(memory_efficient=me), name=sample_name(case))
