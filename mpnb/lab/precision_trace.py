"""``trace_precision``: which precision every op of one training step ran in, and why.

One forward and backward of a copy of your model under a precision configuration (a name of
:data:`mpnb.core.precision_configs.PRECISION_CONFIGS`: ``"O1"``, ``"fp8-delayed"``...) records every
aten op (see :mod:`mpnb.lab._precision_trace` for how) and explains its dtype with one of
:data:`REASONS`. The result is a DataFrame (one row per op) and a :class:`PrecisionSummary`.

Columns of ``trace.ops``:

=============  ==============================================================================
``seq``        order of execution
``phase``      ``forward`` (inside the model), ``loss`` (``loss_fn``), ``backward``,
               ``loss-scaling`` (amp's scaled loss and unscale)
``module``     qualified name of the innermost module (``(root)``: the model; ``-``: none)
``module_type`` its class
``api``        the torch call in your code the op came from (``torch.nn.functional.linear``)
``op``         the aten op (``addmm``, ``_to_copy``, ``_scaled_mm``)
``kind``       ``compute``, ``cast`` (a dtype change) or ``view`` (no data moved)
``in_dtypes``  dtypes of its tensor inputs; ``out_dtypes``: of its outputs
``dtype``      the dtype it computes in (casts: the target; ``_scaled_mm``: its FP8 operands)
``reason``     one of :data:`REASONS`; ``detail``: the same in words, with specifics
``flops``      from ``torch.utils.flop_counter``'s formulas (0 for ops it has none for)
``bytes``      bytes of its tensor inputs and outputs (0 for views)
``grad_fn``    backward ops: the autograd node running (``AddmmBackward0``)
=============  ==============================================================================

Example::

    >>> trace = mpnb.lab.trace_precision(model, torch.randn(32, 64), "O1")
    >>> ops, summary = trace
    >>> summary.by_dtype          # share of FLOPs and bytes per dtype
    >>> summary.fp32_ops          # what stayed float32 under a half configuration, and why
"""

from __future__ import annotations

import copy
from contextlib import nullcontext
from dataclasses import dataclass
from typing import NamedTuple

import pandas as pd
import torch

from mpnb.core import amp
from mpnb.core.amp import preserve_current_handle
from mpnb.core.dtype_names import default_half_dtype, torch_name
from mpnb.core.fp8 import Float8Linear
from mpnb.core.number_formats import format_named, is_block_scale, is_scaled
from mpnb.core.precision_configs import PrecisionConfig, get_config
from mpnb.lab._precision_trace import CAST_APIS, ApiMode, ModuleTracker, OpMode, autocast_policy
from mpnb.lab._train import forward
from mpnb.lab.workloads import default_loss

__all__ = ["trace_precision", "PrecisionTrace", "PrecisionSummary", "REASONS", "COLUMNS"]

REASONS = {
    "autocast-lower-precision": "on torch.autocast's lower-precision list: ran in the half dtype",
    "autocast-fp32": "on torch.autocast's float32 list: ran in float32",
    "autocast-promote": "on torch.autocast's promote list: inputs cast to their widest dtype",
    "autocast-cast": "a cast torch.autocast inserted before the op it wraps",
    "autocast-disabled": "in a region where autocast was turned off (amp.disable_casts)",
    "user-registration": "inside an amp.register_*_function / amp.half_function wrapper",
    "explicit-cast": "a cast written in code (.to/.float/.half), yours or amp's cast hooks",
    "fp8-recipe": "inside an mpnb.fp8 layer: quantization, FP8 GEMM, dequantization",
    "promotion": "no cast rule applied: ran in its inputs' dtype (type promotion)",
    "backward": "backward op: autocast does not run in backward; it follows the forward's dtypes",
    "loss-scaling": "amp's loss scaling: the loss times the scale, its backward, the unscale",
    "view": "a view: no computation, its input's dtype",
    "unknown": "autocast was on but its rule for this call could not be measured",
}

COLUMNS = [
    "seq",
    "phase",
    "module",
    "module_type",
    "api",
    "op",
    "kind",
    "in_dtypes",
    "out_dtypes",
    "dtype",
    "reason",
    "detail",
    "flops",
    "bytes",
    "grad_fn",
]


@dataclass
class PrecisionSummary:
    """The aggregate views of a trace.

    Attributes:
        config, half_dtype, device: what was traced.
        by_dtype: per compute dtype: ``ops``, ``flops``, ``flops_share``, ``bytes``,
            ``bytes_share`` (views excluded; shares in 0..1).
        by_reason: per reason: ``ops``, ``flops``, ``flops_share``.
        fp32_ops: under a low-precision configuration, the float32 compute ops grouped by
            ``phase, module, op, reason`` with ``calls``, ``flops``, ``bytes`` and a ``detail``.
        fp8_emulated: the scaled format's GEMMs were emulated (a device without FP8
            hardware, the CPU; or a recipe emulated everywhere: MXFP8, the four-bit ones): its
            numerics, not its speed.
        scaled_format: how the trace names the scaled format ("FP8", "NVFP4"; "": none ran).
    """

    config: str
    half_dtype: str
    device: str
    by_dtype: pd.DataFrame
    by_reason: pd.DataFrame
    fp32_ops: pd.DataFrame
    fp8_emulated: bool
    scaled_format: str = ""

    def __str__(self) -> str:
        lines = [f"precision trace of {self.config} ({self.half_dtype}, {self.device})"]
        for r in self.by_dtype.itertuples():
            lines.append(
                f"  {r.dtype:>24}: {r.flops_share:6.1%} of FLOPs, {r.bytes_share:6.1%} of bytes"
            )
        if len(self.fp32_ops):
            lines.append(f"  float32 compute ops: {int(self.fp32_ops['calls'].sum())}")
        if self.fp8_emulated:
            fmt = self.scaled_format or "FP8"
            lines.append(f"  {fmt} is emulated on this device: {fmt} numerics, not {fmt} speed")
        return "\n".join(lines)


class PrecisionTrace(NamedTuple):
    """``(ops, summary)``: unpack it, or use the attributes."""

    ops: pd.DataFrame
    summary: PrecisionSummary


def has_scaled_ops(ops: pd.DataFrame) -> bool:
    """True where a traced op ran in a scaled format's dtype (FP8, MX, NVFP4: the table's
    ``scaled`` rows, :mod:`mpnb.core.number_formats`)."""
    return bool(ops["dtype"].map(is_scaled).any())


#: the aten ops of a GEMM (an emulated FP8/FP4 GEMM runs one of these in float32)
_GEMM_OPS = ("mm", "bmm", "matmul", "addmm")


def _fp8_detail(f, fmt: str) -> str:
    """What op ``f`` of an mpnb.fp8 layer does, naming the layer's format ``fmt`` ("FP8")."""
    if f.op == "_scaled_mm":
        return f"{fmt} GEMM in torch._scaled_mm ({f.dtype})"
    if f.kind == "cast" and is_scaled(f.dtype):
        return f"quantize to {f.dtype}"
    if f.kind == "cast" and f.in_dtypes and is_block_scale(f.in_dtypes[0]):
        return "E8M0 block scales to float32"
    if f.kind == "cast" and is_scaled(f.in_dtypes[0]):
        return f"dequantize (emulated {fmt} GEMM)"
    if f.op in _GEMM_OPS:  # bmm: the four-bit GEMM's blocks at once
        return f"emulated {fmt} GEMM: dequantized operands multiplied in float32"
    return f"{fmt} scaling: amax, scale, saturation, bias"


def scaled_format_label(cfg: PrecisionConfig) -> str:
    """How the trace names ``cfg``'s scaled format ("FP8", "NVFP4", "MXFP4"; "FP8" for a
    configuration without one, whose layers are mpnb.fp8's)."""
    name = getattr(cfg, "format_name", None)
    return format_named(name).name.upper() if name else "FP8"


_LISTS = ("lower-precision", "fp32", "promote")


def _source(facts, i: int) -> int:
    """The op that made the data of op ``i``'s output, looking through views (-1: none)."""
    seen = set()
    while i >= 0 and facts[i].kind == "view" and i not in seen:
        seen.add(i)
        i = next((j for j in facts[i].inputs_from if j >= 0), -1)
    return i


class _Explainer:
    """The reason of every op, from the facts and the measured autocast rules.

    ``policies`` are the rules of the torch calls in the model code (``F.linear``), measured
    on the call; ``op_policies`` those of the aten ops themselves (``addmm``), measured on
    each op. An op in an autocast region is explained by its own rule when it has one; else
    by the autocast cast that made one of its inputs (its dtype was chosen for the op that
    autocast wraps, as the bias ``add`` inside ``linear``); else by type promotion. A call's
    rule alone never explains the ops inside it: ``multi_head_attention_forward`` is on no
    list, its ``mm`` is.
    """

    def __init__(self, facts, policies: dict, op_policies: dict, half: str, cfg) -> None:
        self.facts, self.policies, self.op_policies = facts, policies, op_policies
        self.half, self.cfg = half, cfg
        self.fmt = scaled_format_label(cfg)
        self.autocast_casts: set[int] = set()
        self.consumer: dict[int, int] = {}  # an op -> the first compute op reading its output
        for i, f in enumerate(facts):
            for j in {_source(facts, j) for j in f.inputs_from}:
                if j >= 0 and f.kind == "compute":
                    self.consumer.setdefault(j, i)

    def own_rule(self, f) -> str:
        return self.op_policies.get(f.op_key, "unknown") if f.op_key is not None else "none"

    def wrapped(self, i: int) -> int | None:
        """The op a cast was made for: its first reader, followed through ops of one input
        and no rule of their own (the ``clone`` and ``_unsafe_view`` before an ``mm``)."""
        c, seen = self.consumer.get(i), set()
        while c is not None and c not in seen and self.own_rule(self.facts[c]) not in _LISTS:
            seen.add(c)
            if len(self.facts[c].inputs_from) != 1 or c not in self.consumer:
                break
            c = self.consumer[c]
        return c

    def cast_inputs(self, i: int) -> str | None:
        """The dtype an autocast cast gave one of op ``i``'s inputs (None: no such input)."""
        for j in self.facts[i].inputs_from:
            j = _source(self.facts, j)
            if j in self.autocast_casts:
                return self.facts[j].dtype
        return None

    def __call__(self, i: int) -> tuple[str, str]:
        f, cfg = self.facts[i], self.cfg
        call = f.call
        if f.fp8_module:
            return "fp8-recipe", _fp8_detail(f, self.fmt)
        if f.phase == "loss-scaling":
            return "loss-scaling", _scaling_detail(f)
        if call is not None and call.wrapper is not None:
            policy, fn = call.wrapper
            return "user-registration", f"amp {policy} function {fn}"
        if f.phase == "backward":
            node = f.grad_fn or "the autograd engine (initial gradient)"
            return "backward", f"backward of {node}: the dtypes its forward saved"
        if f.kind == "view":
            return "view", "no computation"
        if f.dtype is None:
            return "promotion", "no floating tensors: nothing for a precision rule to change"
        api = call.name if call is not None else "-"
        if f.kind == "cast" and api.split(".")[-1] in CAST_APIS:
            return "explicit-cast", f"{api} to {f.dtype}"
        if call is not None and call.autocast:
            return self._autocast(i, f, api)
        if cfg.autocast and f.phase == "forward" and f.module != "-":
            return "autocast-disabled", f"{api} ran with autocast off inside an {cfg.name} forward"
        if f.dtype == self.half and cfg.weights[0] != "float32":
            return "promotion", f"its inputs are {self.half}: {cfg.name} cast the model's weights"
        return "promotion", f"no autocast here: ran in its inputs' dtype ({f.dtype})"

    def _autocast(self, i: int, f, api: str) -> tuple[str, str]:
        half = self.half
        inside = "" if api.split(".")[-1] == f.op else f" (inside {api})"
        if f.kind == "cast":
            c = self.wrapped(i)
            target = self.own_rule(self.facts[c]) if c is not None else "none"
            if target in _LISTS or self.policies.get(f.call.key, "unknown") in _LISTS:
                self.autocast_casts.add(i)
                what = "the op it wraps" if c is None else self.facts[c].op
                if target in _LISTS:
                    what += f", on autocast's {_LIST_NAME[target]} list"
                return "autocast-cast", f"cast to {f.dtype} by torch.autocast for {what}{inside}"
            return "promotion", f"a cast inside {api} (not autocast's)"
        own = self.own_rule(f)
        if own == "lower-precision" and f.dtype == half:
            return "autocast-lower-precision", f"{f.op} is on autocast's {half} list{inside}"
        if own == "fp32" and f.dtype == "float32":
            return "autocast-fp32", f"{f.op} is on autocast's float32 list{inside}"
        if own == "promote":
            return "autocast-promote", f"{f.op} is on autocast's promote list{inside}"
        cast = self.cast_inputs(i)
        if cast is not None and cast == f.dtype:
            code = "autocast-lower-precision" if cast == half else "autocast-fp32"
            return code, (
                f"its inputs were cast to {cast} by torch.autocast for the op it wraps{inside}; "
                f"{f.op} itself has no autocast rule"
            )
        if own == "unknown":
            return "unknown", f"{f.op}{inside}: autocast's rule could not be measured"
        return "promotion", f"{f.op} has no autocast rule: ran in its inputs' dtype{inside}"


_LIST_NAME = {"lower-precision": "lower-precision", "fp32": "float32", "promote": "promote"}


def _scaling_detail(f) -> str:
    if f.phase == "loss-scaling" and f.grad_fn:
        return f"backward of the loss scaling ({f.grad_fn}): the loss's gradient times the scale"
    what = f.call.name if f.call is not None else f.op
    return f"amp's loss scaling ({what}), outside the model: {f.dtype or 'no floating data'}"


def _rows(facts, policies, op_policies, half, cfg) -> list[dict]:
    rows = []
    explain = _Explainer(facts, policies, op_policies, half, cfg)
    for i, f in enumerate(facts):
        reason, detail = explain(i)
        rows.append(
            dict(
                seq=i,
                phase=f.phase,
                module=f.module,
                module_type=f.module_type,
                api=f.call.name if f.call is not None else "-",
                op=f.op,
                kind=f.kind,
                in_dtypes=",".join(f.in_dtypes),
                out_dtypes=",".join(f.out_dtypes),
                dtype=f.dtype or "-",
                reason=reason,
                detail=detail,
                flops=f.flops,
                bytes=f.bytes,
                grad_fn=f.grad_fn,
            )
        )
    return rows


def _share(df: pd.DataFrame, by: str, cols=("flops", "bytes")) -> pd.DataFrame:
    g = df.groupby(by, sort=False).agg(ops=("op", "size"), **{c: (c, "sum") for c in cols})
    for c in cols:
        total = g[c].sum()
        g[f"{c}_share"] = g[c] / total if total else 0.0
    return g.sort_values(list(cols)[0], ascending=False).reset_index()


def _block_scaled_emulated(cfg: PrecisionConfig, device: str) -> bool:
    """True for a block-scaled recipe whose GEMMs run emulated on ``device`` (the decision of
    the configuration's own ``status``)."""
    return bool(getattr(cfg, "gemm_emulated", False)) and cfg.status("fp8", None, device) == (
        "emulated"
    )


def _summary(ops: pd.DataFrame, cfg: PrecisionConfig, half: str, device: str) -> PrecisionSummary:
    work = ops[(ops["kind"] != "view") & (ops["dtype"] != "-")]
    # an mpnb.fp8 layer's scaling math (amax, scales, saturation) did not "stay" float32: it
    # is the recipe; its emulated GEMM is listed, since it does compute in float32
    recipe_math = (work["reason"] == "fp8-recipe") & ~work["op"].isin(_GEMM_OPS)
    fp32 = work[(work["dtype"] == "float32") & (work["kind"] == "compute") & ~recipe_math]
    if not cfg.low_precision:
        fp32 = fp32.iloc[0:0]
    keys = ["phase", "module", "op", "reason"]
    fp32 = (
        fp32.groupby(keys, sort=False)
        .agg(
            calls=("op", "size"),
            flops=("flops", "sum"),
            bytes=("bytes", "sum"),
            detail=("detail", "first"),
        )
        .reset_index()
    )
    has_fp8 = has_scaled_ops(ops) or bool((ops["reason"] == "fp8-recipe").any())
    return PrecisionSummary(
        config=cfg.name,
        half_dtype=half,
        device=device,
        by_dtype=_share(work, "dtype"),
        by_reason=_share(ops, "reason", ("flops",)),
        fp32_ops=fp32,
        fp8_emulated=bool(has_fp8 and (device == "cpu" or _block_scaled_emulated(cfg, device))),
        scaled_format=scaled_format_label(cfg) if has_fp8 else "",
    )


def trace_precision(
    model: torch.nn.Module,
    inputs,
    config: str | PrecisionConfig = "O1",
    loss_fn=None,
    half_dtype: torch.dtype | None = None,
) -> PrecisionTrace:
    """Run one forward and backward of a copy of ``model`` under ``config`` and explain every op.

    Args:
        model: an fp32 model (deep-copied; yours is not changed).
        inputs: a tensor, a tuple of positional inputs or a dict of keyword inputs (a
            ``transformers`` batch), on the model's device.
        config: a name of :data:`mpnb.core.precision_configs.PRECISION_CONFIGS` or such an
            object.
        loss_fn: ``output -> scalar loss`` (default: mean of the squared float32 logits, as
            :func:`mpnb.lab.profile`; the logits are found in a tuple, dict, dataclass or
            ``ModelOutput`` as :func:`mpnb.lab.compare` finds them).
        half_dtype: the O levels' half dtype (default: bf16 on CPU, fp16 on CUDA).

    Returns:
        A :class:`PrecisionTrace` ``(ops, summary)``: the op DataFrame (columns
        :data:`COLUMNS`, documented in this module) and a :class:`PrecisionSummary`.

    Example::

        >>> ops, summary = trace_precision(model, x, "O1")
        >>> ops[(ops.phase == "forward") & (ops.op == "addmm")][["module", "dtype", "reason"]]
    """

    cfg = get_config(config)
    p = next(model.parameters(), None)
    if p is None:
        raise ValueError(
            f"trace_precision: {type(model).__name__} has no parameters, so there are no "
            "weights for a precision configuration to cast, no gradients to scale and nothing "
            "for the backward to reach. Trace the module that owns the weights around it (the "
            "layer or block that calls it)."
        )
    device = p.device
    half = cfg.half_dtype(half_dtype, device)  # None: the configuration uses no half dtype
    with preserve_current_handle():  # amp.initialize on the copy keeps the user's handle
        facts, policies, op_policies = _trace(
            model, inputs, cfg, loss_fn or default_loss, half, device
        )
    half_name = torch_name(half) if half is not None else "-"
    ops = pd.DataFrame(_rows(facts, policies, op_policies, half_name, cfg), columns=COLUMNS)
    return PrecisionTrace(ops, _summary(ops, cfg, half_name, device.type))


def _trace(model, inputs, cfg, loss_fn, half, device):
    work = copy.deepcopy(model)
    # never stepped; the optimizer the configuration needs (bf16-pure+sr: a FusedSGD with
    # stochastic rounding), as compare builds it
    opt = cfg.make_optimizer("sgd", work.parameters(), 0.0)
    work, opt = cfg.apply(work, opt, half_dtype=half)
    # a peer's precision lives in its step (torch.amp's autocast): trace its forward in it
    context = cfg.train_step(work, opt, half).forward_context() if cfg.peer else nullcontext()
    tracker = ModuleTracker(work)
    api = ApiMode(device.type)
    mode = OpMode(tracker, api, (Float8Linear,))
    try:
        with mode, api:
            with context:
                out = forward(work, inputs)  # model(x), model(*tuple) or model(**dict)
                mode.phase = "loss"
                loss = loss_fn(out)
            if cfg.uses_amp:
                mode.phase = "loss-scaling"
                with amp.scale_loss(loss, opt) as scaled:
                    mode.loss_scale_nodes = _nodes_between(scaled, loss)
                    mode.phase = "backward"
                    scaled.backward()
                    mode.phase = "loss-scaling"
            else:
                mode.phase = "backward"
                loss.backward()
    finally:
        tracker.remove()
    half = half or default_half_dtype(device)  # the dtype autocast's rules are measured in
    used = {f.call.key for f in mode.ops if f.call is not None and f.call.autocast}
    policies = {
        k: autocast_policy(c, device.type, half) for k, c in api.samples.items() if k in used
    }
    op_policies = {k: autocast_policy(c, device.type, half) for k, c in mode.samples.items()}
    return mode.ops, policies, op_policies


def _nodes_between(scaled: torch.Tensor, loss: torch.Tensor) -> set:
    """The autograd nodes from ``scaled`` back to ``loss`` (excluded): amp's loss scaling."""
    stop, found, todo, reached = loss.grad_fn, set(), [scaled.grad_fn], False
    while todo:
        node = todo.pop()
        reached |= node is stop
        if node is None or node is stop or node in found:
            continue
        found.add(node)
        todo += [n for n, _ in node.next_functions]
    return found if reached else set()  # not through the loss: no way to tell them apart
