"""Diagnosis: which layer leaves the half range (``trace_overflow``), which grads flush to zero
(``underflow_report``).

``trace_overflow`` runs your model twice on deep copies (yours is untouched): in fp32, to get
each module's true forward-output and backward-gradient magnitudes, and in pure half (as
O3 would), to find the first op that really produces inf/NaN. Forward and backward hooks
(``register_forward_hook``, ``register_full_backward_hook``) measure each module; a
``TorchDispatchMode`` checks every op's output and names the op.

Example::

    >>> r = mpnb.lab.trace_overflow(model, x, dtype=torch.float16)
    >>> r.module, r.op, r.phase       # ('scale', 'aten.mul.Tensor', 'forward')
    >>> print(r.advice)
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

import pandas as pd
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from mpnb.core.dtype_names import short_name
from mpnb.lab._train import forward
from mpnb.lab.workloads import default_loss

__all__ = ["TraceResult", "trace_overflow", "UnderflowReport", "underflow_report"]


def _tensors(x) -> list[torch.Tensor]:
    return [t for t in tree_flatten(x)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _stats(ts: list[torch.Tensor]) -> tuple[float, float, bool]:
    """(abs-max over finite values, smallest nonzero abs, any inf/NaN) of ``ts``."""
    amax, amin, bad = 0.0, math.inf, False
    for t in ts:
        a = t.detach().abs().float()
        finite = torch.isfinite(a)
        bad |= not bool(finite.all())
        a = a[finite]
        if a.numel():
            amax = max(amax, float(a.max()))
            nz = a[a > 0]
            if nz.numel():
                amin = min(amin, float(nz.min()))
    return amax, amin, bad


class _Watch(TorchDispatchMode):
    """Remembers the first op whose output is inf/NaN, and the module running it."""

    def __init__(self):
        super().__init__()
        self.module, self.phase, self.first = "", "forward", None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.first is None:
            for t in _tensors(out):
                if not bool(torch.isfinite(t).all()):
                    self.first = (str(func), self.module, self.phase)
                    break
        return out


def _run(model, x, loss_fn, watch: _Watch | None) -> list[dict]:
    """Forward + backward with hooks on every module; rows in execution order."""
    rows, hooks = [], []

    def enter(name, phase):
        def hook(m, *args):
            if watch is not None:
                watch.module, watch.phase = name, phase

        return hook

    def measure(name, phase):
        def hook(m, *args):  # (args, output) forward; (grad_input, grad_output) backward
            amax, amin, bad = _stats(_tensors(args[-1]))
            rows.append(
                dict(
                    module=name,
                    type=type(m).__name__,
                    phase=phase,
                    absmax=amax,
                    absmin=amin,
                    nonfinite=bad,
                )
            )

        return hook

    for name, mod in model.named_modules():
        name = name or "(model)"
        hooks += [
            mod.register_forward_pre_hook(enter(name, "forward")),
            mod.register_forward_hook(measure(name, "forward")),
        ]
        # Backward hooks on leaf modules only: they return tensors, while a container may
        # return a dict or ModelOutput, for which torch warns on every call and skips the hook.
        if not any(True for _ in mod.children()):
            hooks += [
                mod.register_full_backward_pre_hook(enter(name, "backward")),
                mod.register_full_backward_hook(measure(name, "backward")),
            ]
    try:
        with warnings.catch_warnings():  # inputs need no grad: hooks then see output grads
            warnings.filterwarnings("ignore", "Full backward hook is firing")
            loss = loss_fn(forward(model, x))
            if loss.requires_grad:
                loss.float().backward()
    finally:
        for h in hooks:
            h.remove()
    return rows


@dataclass
class TraceResult:
    """What :func:`trace_overflow` found.

    Attributes:
        module, op, phase: the first module / op / ``"forward"`` or ``"backward"`` that goes
            inf/NaN in ``dtype`` (or, if none does, that exceeds its range in fp32); ``None``
            when everything fits.
        table: per module and phase, fp32 abs-max/abs-min vs the dtype's max and smallest
            normal, whether the half run was inf/NaN there, and a status.
        advice: what to keep in fp32.
    """

    dtype: torch.dtype
    module: str | None
    op: str | None
    phase: str | None
    table: pd.DataFrame = field(repr=False)
    advice: str = ""


def _cast(x, dtype):
    if isinstance(x, torch.Tensor):
        return x.to(dtype) if x.is_floating_point() else x
    if isinstance(x, (tuple, list)):
        return type(x)(_cast(v, dtype) for v in x)
    return x


def _status(r, fi) -> str:
    if r["nonfinite_half"] or r["absmax"] > fi.max:
        return "overflow"
    if r["absmin"] < fi.tiny:
        return "underflow risk"
    return "ok"


def trace_overflow(
    model: torch.nn.Module, inputs, loss_fn=None, dtype: torch.dtype = torch.float16
) -> TraceResult:
    """Find the first module (and op) whose output or gradient leaves ``dtype``'s range.

    Args:
        model: an fp32 model (deep-copied; yours is not changed).
        inputs: a tensor or tuple of positional inputs (fp32).
        loss_fn: ``output -> scalar loss`` (default: mean of the squared output).
        dtype: ``torch.float16`` (max 65504) or ``torch.bfloat16``.

    Example::

        >>> r = trace_overflow(nn.Sequential(nn.Linear(4, 4), Scale(1e5)), torch.randn(2, 4))
        >>> r.module
        '1'
    """
    loss_fn = loss_fn or default_loss
    fi = torch.finfo(dtype)
    ref = pd.DataFrame(_run(copy.deepcopy(model).float(), inputs, loss_fn, None))
    half = copy.deepcopy(model).to(dtype)
    watch = _Watch()
    with watch:
        got = pd.DataFrame(_run(half, _cast(inputs, dtype), loss_fn, watch))
    table = ref.copy()
    table["nonfinite_half"] = got["nonfinite"].values if len(got) == len(ref) else False
    table["dtype_max"], table["dtype_tiny"] = fi.max, fi.tiny
    table["status"] = [_status(r, fi) for _, r in table.iterrows()]
    table = table.drop(columns=["nonfinite"])
    return _result(dtype, table, watch.first)


def _result(dtype, table: pd.DataFrame, first) -> TraceResult:
    name = short_name(dtype)
    leaves = table[table.module != "(model)"]
    bad = leaves[leaves.status == "overflow"]
    if first is not None:
        op, module, phase = first
    elif len(bad):
        op, module, phase = None, bad.iloc[0].module, bad.iloc[0].phase
    else:
        return TraceResult(
            dtype,
            None,
            None,
            None,
            table,
            f"every module's outputs and gradients fit {name}: nothing to keep in fp32.",
        )
    row = table[(table.module == module) & (table.phase == phase)]
    kind = row.iloc[0].type if len(row) else "?"
    amax = float(row.absmax.max()) if len(row) else math.nan
    top = torch.finfo(dtype).max
    # The module's own values may fit while an op inside it (an exp, a sum) does not.
    why = (
        f"its {phase} values reach {amax:.3g} in fp32, beyond {name}'s max {top:.3g}"
        if not amax <= top
        else f"inside it, {op} gives inf/NaN in {name} (max {top:.3g}), although its {phase} "
        f"values stay within {amax:.3g} in fp32"
    )
    advice = (
        f"keep `{module}` ({kind}) in fp32: {why}. Under O1 register its "
        "function with amp.register_float_function (or run it in torch.autocast("
        "enabled=False) on .float() inputs); under O2/O3 keep the module fp32 and cast its "
        "input with .float(). Or use bf16, which has fp32's range."
    )
    return TraceResult(dtype, module, op, phase, table, advice)


@dataclass
class UnderflowReport:
    """What :func:`underflow_report` found.

    Attributes:
        summary: per loss scale, the share of nonzero gradient values that flush to zero,
            become subnormal (lose precision) or overflow when cast to the dtype.
        params: the same per parameter and loss scale.
        histogram: counts of the unscaled gradients' ``floor(log2|g|)`` (bin, count).
        thresholds: ``log2`` of the dtype's smallest subnormal, smallest normal and max.
    """

    dtype: torch.dtype
    summary: pd.DataFrame
    params: pd.DataFrame = field(repr=False)
    histogram: pd.DataFrame = field(repr=False)
    thresholds: dict = field(default_factory=dict)


def _shares(g: torch.Tensor, scale: float, dtype) -> dict:
    v = g.flatten().double() * scale
    nz = v != 0
    n = max(int(nz.sum()), 1)
    h = v.to(dtype)
    fi = torch.finfo(dtype)
    return dict(
        nonzero=int(nz.sum()),
        flushed=int(((h == 0) & nz).sum()) / n,
        subnormal=int(((h.abs() < fi.tiny) & (h != 0)).sum()) / n,
        overflow=int(torch.isinf(h).sum()) / n,
    )


def underflow_report(
    model: torch.nn.Module,
    inputs,
    loss_fn=None,
    dtype: torch.dtype = torch.float16,
    loss_scale: float | Sequence[float] = 1.0,
) -> UnderflowReport:
    """The share of gradient values that flush to zero in ``dtype`` at each ``loss_scale``.

    The gradients are computed once in fp32 (on a deep copy), multiplied by each loss scale
    and cast to ``dtype``, as amp's scaled backward would hold them.

    Example::

        >>> r = underflow_report(model, x, dtype=torch.float16, loss_scale=(1.0, 2.0**16))
        >>> r.summary       # flushed share drops as the scale grows
    """
    m = copy.deepcopy(model).float()
    m.zero_grad(set_to_none=True)
    (loss_fn or default_loss)(forward(m, inputs)).float().backward()
    grads = [(n, p.grad.detach()) for n, p in m.named_parameters() if p.grad is not None]
    scales = [float(loss_scale)] if isinstance(loss_scale, (int, float)) else list(loss_scale)
    rows = [dict(param=n, loss_scale=s, **_shares(g, s, dtype)) for s in scales for n, g in grads]
    params = pd.DataFrame(rows)
    allg = torch.cat([g.flatten().double() for _, g in grads]) if grads else torch.zeros(0)
    summary = pd.DataFrame([dict(loss_scale=s, **_shares(allg, s, dtype)) for s in scales])
    a = allg[allg != 0].abs()
    b = torch.floor(torch.log2(a)).long()
    bins, counts = torch.unique(b, return_counts=True)
    hist = pd.DataFrame({"log2_bin": bins.tolist(), "count": counts.tolist()})
    fi = torch.finfo(dtype)
    thr = {
        "min_subnormal": math.log2(fi.smallest_normal * fi.eps),
        "min_normal": math.log2(fi.tiny),
        "max": math.log2(fi.max),
    }
    return UnderflowReport(dtype, summary, params, hist, thr)
