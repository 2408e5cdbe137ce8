"""Per-layer quantization statistics, as TransformerEngine's debug tools log them.

:func:`collect_quant_stats` is a context manager; while forward and backward passes run
inside it, every operand a layer quantizes is measured against the high-precision tensor the
recipe quantized, and the measures accumulate per layer, tensor (``"input"``, ``"weight"``,
``"grad_output"``) and GEMM. Two modes:

* on a converted model (:class:`~mpnb.core.fp8.linear.Float8Linear` layers), each operand
  exactly as the layer's recipe produced it (the layer shows it to its
  :attr:`~mpnb.core.fp8.linear.Float8Linear.quant_observer`; with no collector open nothing
  extra runs and nothing is read on the host);
* ``what_if=<recipe>`` on a model whose ``nn.Linear`` layers are not converted: forward hooks
  and hooks on the outputs' gradients quantize a detached copy of each layer's input, weight
  and output gradient with that recipe, for the same GEMMs as ``Float8Linear`` (so the
  statistics are those the converted layer would log on these tensors); no value of the step
  changes.

The metrics (:data:`METRICS`), with ``x`` the high-precision tensor as the recipe quantized it
(padded to whole blocks and, for the Wgrad operands of a recipe with the RHT, transformed)
and ``q`` the operand's dequantized values:

* ``underflow_pct``: nonzero ``x`` whose ``q`` is 0, in % of the elements (TE's
  ``underflows%``);
* ``overflow_pct``: ``|x|`` beyond ``c * scale_inv`` of its block (a block whose scale inverse
  is 0 has underflows only), in % of the elements, where
  ``c`` is the midpoint between the element format's max and the next step above it (464 for
  E4M3, 61440 for E5M2, 7 for E2M1): the values saturation, not rounding, brought down to the
  max (TE's ``fp8_max * scale_inv`` also counts the amax itself whenever the float32 scale
  rounds a hair low);
* ``mse``: ``sum((q - x)**2) / numel``; ``rel_err``: ``||q - x|| / ||x||`` (Frobenius norms);
* ``scale_inv_min``, ``scale_inv_max``, ``scale_inv_std``: of the scale inverses (the full
  decode factor of each block: ``dequant_scale``, or ``block_scale * tensor_scale /
  tensor_divisor`` for four bits; one per block, a 16x16 tile counted once; std over all);
* ``dynamic_range``: ``log2(max|x| / min nonzero |x|)`` in binades, over everything seen;
  ``worst_block_range``: the same within one scaling block, the largest over all blocks
  (a block of zeros counts 0).

Accumulation over steps and GEMMs: counts and sums add up and the ratios are taken at the end
(``underflow_pct`` is all underflows over all elements, not a mean of per-step percentages);
minima, maxima and the binade ranges are the extremes over everything seen. The accumulators
are a few scalars per layer, tensor and GEMM, kept on the tensors' device; they reach the host
only when :meth:`QuantStats.rows` (or :meth:`~QuantStats.heatmap`, :meth:`~QuantStats.worst`)
is called, in one read. Elements that are inf or NaN make the error statistics of their
tensor inf or NaN (an overflowing step shows as such).

Example::

    >>> with collect_quant_stats(converted_model) as stats:
    ...     model(x).square().mean().backward()
    >>> stats.worst("rel_err")["layer"]
    >>> with collect_quant_stats(fp32_model, what_if="nvfp4") as stats:   # nothing converted
    ...     fp32_model(x).square().mean().backward()
    >>> layers, tensors, values = stats.heatmap("underflow_pct")
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

import torch
from torch import nn

from mpnb.core.fp8._recipe import ROLES, Float8Recipe
from mpnb.core.fp8.formats import fp8_max
from mpnb.core.fp8.fp4 import E2M1_MAX
from mpnb.core.fp8.fp4_gemm import FP4Operand
from mpnb.core.fp8.fp4_recipes import FP4Recipe
from mpnb.core.fp8.linear import Float8Linear, _no_autocast
from mpnb.core.fp8.quantize import MX_BLOCK
from mpnb.core.fp8.recipes import RECIPES, recipe

__all__ = ["METRICS", "GEMMS", "QuantStats", "collect_quant_stats"]

METRICS = (
    "underflow_pct",
    "overflow_pct",
    "mse",
    "rel_err",
    "scale_inv_min",
    "scale_inv_max",
    "scale_inv_std",
    "dynamic_range",
    "worst_block_range",
)
GEMMS = ("forward", "grad_input", "grad_weight")
_E2M1_STEP = 0.5  # E2M1's mantissa step (one mantissa bit)


def _clip_at(fmt_max: float, eps: float) -> float:
    """The midpoint between ``fmt_max`` and the next step above it on the format's grid."""
    return fmt_max + 2.0 ** math.floor(math.log2(fmt_max)) * eps / 2


def _source(rec: Float8Recipe, t: torch.Tensor, role: str, gemm: str) -> torch.Tensor:
    """The float32 tensor ``rec.quantize(.., t, role, .., gemm)`` quantized: ``t``; for the
    four-bit recipes padded to whole blocks and, with the RHT, transformed (Wgrad operands).
    (:meth:`FP4Recipe.source`, which :meth:`FP4Recipe.quantize` shares its rule with)."""
    if isinstance(rec, FP4Recipe):
        t = rec.source(t, role, gemm)
    return t.detach().float()


def _layout(op, rec: Float8Recipe, role: str, shape) -> tuple[torch.Tensor, int, int, float]:
    """``(scale inverse per block (Rb, Cb), block rows, block cols, clip constant)``."""
    rows, k = shape
    if isinstance(op, FP4Operand):
        tile = rec.tile_rows(role)
        return op.block_decode()[::tile], tile, op.block, _clip_at(E2M1_MAX, _E2M1_STEP)
    dtype = op.data.dtype
    clip = _clip_at(fp8_max(dtype), torch.finfo(dtype).eps)
    d = op.dequant_scale.float()
    if op.granularity == "tensorwise":
        return d.reshape(1, 1), rows, k, clip
    if op.granularity == "rowwise":
        return d.reshape(rows, 1), 1, k, clip
    return d, 1, MX_BLOCK, clip


def _measure(x: torch.Tensor, q: torch.Tensor, layout, real: tuple[int, int]) -> dict:
    """One quantization's sums, scale statistics and extremes (device tensors, no host read)."""
    decode, tile, block, clip = layout
    pad = (0, (-x.shape[1]) % block, 0, (-x.shape[0]) % tile)
    x, q = nn.functional.pad(x, pad), nn.functional.pad(q, pad)
    rb, cb = x.shape[0] // tile, x.shape[1] // block
    xb, qb = x.reshape(rb, tile, cb, block), q.reshape(rb, tile, cb, block)
    ax = xb.abs()
    # a block whose scale inverse is 0 decodes to 0: its values underflow, none clips
    limit = torch.where(decode > 0, clip * decode, math.inf)[:, None, :, None]
    b_max = ax.amax(dim=(1, 3))
    b_min = torch.where(ax > 0, ax, math.inf).amin(dim=(1, 3))
    b_range = torch.where(b_max > 0, torch.log2(b_max) - torch.log2(b_min), 0.0)
    used = decode[: -(-real[0] // tile), : -(-real[1] // block)].double()  # not padding
    mean = used.mean()
    sums = torch.stack(
        [
            ((xb != 0) & (qb == 0)).sum().double(),
            (ax > limit).sum().double(),
            (qb.double() - xb.double()).square().sum(),
            xb.double().square().sum(),
        ]
    )
    lo = torch.stack([used.amin(), torch.log2(b_min.amin()).double()])
    hi = torch.stack([used.amax(), torch.log2(b_max.amax()).double(), b_range.amax().double()])
    return dict(
        sums=sums, lo=lo, hi=hi, mean=mean, m2=(used - mean).square().sum(),
        numel=real[0] * real[1], blocks=used.numel(),
    )  # fmt: skip


@dataclass
class _Acc:
    """The running statistics of one (layer, tensor, GEMM): device scalars plus host counts."""

    numel: int = 0
    blocks: int = 0
    quantizations: int = 0
    t: dict = field(default_factory=dict)

    def add(self, m: dict) -> None:
        self.quantizations += 1
        n_a, n_b = self.blocks, m["blocks"]
        self.numel, self.blocks = self.numel + m["numel"], n_a + n_b
        if not self.t:
            self.t = {k: m[k] for k in ("sums", "lo", "hi", "mean", "m2")}
            return
        t = self.t  # Chan's merge of (count, mean, M2): exact where sums of squares cancel
        delta = m["mean"] - t["mean"]
        t["mean"] = t["mean"] + delta * (n_b / self.blocks)
        t["m2"] = t["m2"] + m["m2"] + delta.square() * (n_a * n_b / self.blocks)
        t["sums"] = t["sums"] + m["sums"]
        t["lo"], t["hi"] = torch.minimum(t["lo"], m["lo"]), torch.maximum(t["hi"], m["hi"])

    def flat(self) -> torch.Tensor:
        t = self.t
        return torch.cat([t["sums"], t["lo"], t["hi"], t["mean"].view(1), t["m2"].view(1)])


def _merge(parts: list[tuple[_Acc, list[float]]]) -> dict:
    """The metrics of several accumulators read on the host (pooled: sums add, extremes)."""
    numel = sum(a.numel for a, _ in parts)
    blocks = sum(a.blocks for a, _ in parts)
    under, over, err, sq = (sum(v[i] for _, v in parts) for i in range(4))
    s_min, bottom = min(v[4] for _, v in parts), min(v[5] for _, v in parts)
    s_max, top, worst = (max(v[i] for _, v in parts) for i in (6, 7, 8))
    mean = sum(v[9] * a.blocks for a, v in parts) / blocks
    m2 = sum(v[10] + a.blocks * (v[9] - mean) ** 2 for a, v in parts)
    rel = math.sqrt(err / sq) if sq > 0 else (0.0 if err == 0 else math.inf)
    return dict(
        numel=numel,
        underflow_pct=100.0 * under / numel,
        overflow_pct=100.0 * over / numel,
        mse=err / numel,
        rel_err=rel,
        scale_inv_min=s_min,
        scale_inv_max=s_max,
        scale_inv_std=math.sqrt(max(m2, 0.0) / blocks),
        dynamic_range=top - bottom if math.isfinite(bottom) else 0.0,
        worst_block_range=worst,
    )


class QuantStats:
    """The statistics :func:`collect_quant_stats` fills (see :mod:`mpnb.core.fp8.stats`).

    Attributes:
        format: the recipe's label (``"nvfp4 (TE v2.14, 2d, rht, sr)"``); several recipes'
            labels joined by ``", "`` in a model that mixes them.
        what_if: True when the statistics are another format's on tensors that did not train
            in it (``collect_quant_stats(model, what_if=...)``).
        layers: the layers' names, in model order.
    """

    def __init__(self, layers: list[str], fmt: str, what_if: bool, labels: dict[str, str]):
        self.layers, self.format, self.what_if = layers, fmt, what_if
        self._labels = labels
        self._acc: dict[tuple[str, str, str], _Acc] = {}

    def __repr__(self) -> str:
        kind = "what-if " if self.what_if else ""
        return f"QuantStats({kind}{self.format!r}, {len(self.layers)} layers)"

    def _record(self, layer: str, role: str, gemm: str, m: dict) -> None:
        self._acc.setdefault((layer, role, gemm), _Acc()).add(m)

    def _read(self) -> dict:
        keys = [k for k in self._acc if self._acc[k].quantizations]
        if not keys:
            return {}
        flat = [self._acc[k].flat() for k in keys]
        values = torch.stack([f.to(flat[0].device) for f in flat]).tolist()  # one host read
        return dict(zip(keys, values, strict=True))

    def rows(self, by_gemm: bool = False):
        """A DataFrame: ``layer, tensor, format, numel`` and :data:`METRICS`, one row per
        layer and tensor (layers in model order, tensors as :data:`ROLES`) pooling every GEMM
        the tensor was quantized for; with ``by_gemm`` one row per GEMM (a ``gemm`` column
        after ``tensor``: what the RHT does shows on ``grad_weight`` alone). ``numel`` counts
        the elements measured, over all steps and GEMMs. Reads the accumulators on the host."""
        import pandas as pd  # only for the table: collecting needs no pandas

        read = self._read()
        rows = []
        for layer in self.layers:
            for role in ROLES:
                groups = [[g] for g in GEMMS] if by_gemm else [list(GEMMS)]
                for gemms in groups:
                    parts = [
                        (self._acc[k], read[k]) for g in gemms if (k := (layer, role, g)) in read
                    ]
                    if not parts:
                        continue
                    head = dict(layer=layer, tensor=role)
                    if by_gemm:
                        head["gemm"] = gemms[0]
                    rows.append({**head, "format": self._labels[layer], **_merge(parts)})
        lead = ["layer", "tensor", *(["gemm"] if by_gemm else []), "format", "numel"]
        return pd.DataFrame(rows, columns=[*lead, *METRICS])

    def heatmap(self, metric: str = "rel_err"):
        """``(layers, tensors, values)``: ``values[i][j]`` is ``metric`` of layer ``i`` and
        tensor ``j`` (:data:`ROLES`), None where nothing was recorded or it is not finite."""
        _check_metric(metric)
        df = self.rows()
        layers = [n for n in self.layers if (df["layer"] == n).any()]
        found = {(r.layer, r.tensor): getattr(r, metric) for r in df.itertuples()}
        values = [
            [
                v if (v := found.get((n, t))) is not None and math.isfinite(v) else None
                for t in ROLES
            ]
            for n in layers
        ]
        return layers, list(ROLES), values

    def worst(self, metric: str = "rel_err") -> dict:
        """The row (as a dict) with the largest finite ``metric``."""
        _check_metric(metric)
        df = self.rows()
        df = df[df[metric].map(math.isfinite)]
        if df.empty:
            raise ValueError(
                "QuantStats.worst: no statistics were recorded; run the model's forward (and "
                "backward) inside `with collect_quant_stats(model) as stats:` first."
            )
        return df.loc[df[metric].idxmax()].to_dict()


def _check_metric(metric: str) -> None:
    if metric not in METRICS:
        raise ValueError(f"unknown metric {metric!r}; choose one of {', '.join(METRICS)}.")


class _Shadow(nn.Module):
    """What a recipe keeps per layer (a delayed history, a rounding counter), for what-if:
    the user's ``nn.Linear`` gets no buffer and no attribute."""

    def __init__(self, rec: Float8Recipe, device: torch.device) -> None:
        super().__init__()
        self.register_buffer("weight", torch.empty(0, device=device))
        rec.init_state(self)


def _what_if_recipe(spec) -> Float8Recipe:
    if isinstance(spec, Float8Recipe):
        return spec
    if isinstance(spec, str) and spec in RECIPES:
        return recipe(spec)
    raise ValueError(
        f"what_if={spec!r} is not a recipe; pass one of {', '.join(RECIPES)} or a recipe "
        "object (mpnb.fp8.recipe('nvfp4', rht=False))."
    )


def _names(model: nn.Module, keep) -> dict[nn.Module, str]:
    return {m: n or "(root)" for n, m in model.named_modules() if keep(m)}


def _measure_operand(stats, name, rec, t, role, gemm, op) -> None:
    with torch.no_grad(), _no_autocast(t.device.type):
        x = _source(rec, t, role, gemm)
        q = op.dequantize()
        stats._record(name, role, gemm, _measure(x, q, _layout(op, rec, role, x.shape), t.shape))


@contextlib.contextmanager
def _observing(model: nn.Module):
    layers = _names(model, lambda m: isinstance(m, Float8Linear))
    if not layers:
        raise ValueError(
            f"collect_quant_stats: {type(model).__name__} has no Float8Linear layer, so nothing "
            "is quantized. Convert it first (mpnb.fp8.convert_to_float8_training(model, "
            "'nvfp4')), or pass what_if='nvfp4' to see what a format would do to its tensors."
        )
    labels = {n: m.recipe.label for m, n in layers.items()}
    stats = QuantStats(
        list(layers.values()), ", ".join(dict.fromkeys(labels.values())), False, labels
    )

    def observe(layer, t, role, gemm, op):
        _measure_operand(stats, layers[layer], layer.recipe, t, role, gemm, op)

    busy = [n for m, n in layers.items() if "quant_observer" in vars(m)]
    if busy:
        raise RuntimeError(
            f"collect_quant_stats: layer {busy[0]!r} is already observed by another open "
            "collect_quant_stats; close that one first (collectors do not nest)."
        )
    try:
        for m in layers:
            m.quant_observer = observe
        yield stats
    finally:
        for m in layers:
            vars(m).pop("quant_observer", None)


class _WhatIf:
    """The hooks of what-if mode: the GEMM operands of a ``Float8Linear`` under ``rec``,
    quantized from detached copies of the plain layer's tensors."""

    def __init__(self, stats: QuantStats, rec: Float8Recipe, layers: dict) -> None:
        self.stats, self.rec, self.layers, self.open = stats, rec, layers, True
        self.shadows = {m: _Shadow(rec, m.weight.device) for m in layers}

    def _quantize(self, module, t, role, update, gemm) -> None:
        if self.open:
            op = self.rec.quantize(self.shadows[module], t, role, update, gemm=gemm)
            _measure_operand(self.stats, self.layers[module], self.rec, t, role, gemm, op)

    def forward(self, module, args, kwargs, out) -> None:
        x = args[0] if args else kwargs["input"]
        x2, w, update = (
            x.detach().reshape(-1, module.in_features),
            module.weight.detach(),
            module.training,
        )
        if x2.shape[0] == 0 or not self.open:
            return
        with torch.no_grad(), _no_autocast(x.device.type):
            self._quantize(module, x2, "input", update, "forward")
            self._quantize(module, w, "weight", update, "forward")
            if not self.rec.per_tensor:
                self._quantize(module, x2.t(), "input", False, "grad_weight")
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(lambda g: self._backward(module, w, update, g))

    def _backward(self, module, w, update, grad) -> None:
        gy = grad.detach().reshape(-1, module.out_features).contiguous()
        with torch.no_grad(), _no_autocast(gy.device.type):
            self._quantize(module, gy, "grad_output", update, "grad_input")
            if not self.rec.per_tensor:
                self._quantize(module, w.t(), "weight", False, "grad_input")
                self._quantize(module, gy.t(), "grad_output", False, "grad_weight")


@contextlib.contextmanager
def _what_if(model: nn.Module, spec):
    rec = _what_if_recipe(spec)
    converted = _names(model, lambda m: isinstance(m, Float8Linear))
    if converted:
        name, layer = next((n, m) for m, n in converted.items())
        raise ValueError(
            f"collect_quant_stats(what_if={spec!r}): layer {name!r} already trains in "
            f"{layer.recipe.label}. Collect without what_if to see its own statistics, or run "
            "the what-if on the unconverted model (mpnb.fp8.convert_from_float8_training)."
        )
    layers = _names(model, lambda m: type(m) is nn.Linear)
    if not layers:
        raise ValueError(
            f"collect_quant_stats(what_if={spec!r}): {type(model).__name__} has no nn.Linear "
            "layer, the only layers a recipe quantizes; pass a model with linear layers."
        )
    names = list(layers.values())
    stats = QuantStats(names, rec.label, True, dict.fromkeys(names, rec.label))
    hooks = _WhatIf(stats, rec, layers)
    handles = [m.register_forward_hook(hooks.forward, with_kwargs=True) for m in layers]
    try:
        yield stats
    finally:
        hooks.open = False  # a backward after the block records nothing
        for h in handles:
            h.remove()


def collect_quant_stats(model: nn.Module, what_if=None):
    """A context manager yielding a :class:`QuantStats` filled by the passes run inside it.

    Args:
        model: a converted model (its :class:`Float8Linear` layers are observed), or, with
            ``what_if``, a model whose ``nn.Linear`` layers are not converted.
        what_if: None, or a recipe name (``"nvfp4"``, ``"mxfp4"``, ``"mxfp8"``, ...) or a
            :class:`~mpnb.core.fp8.recipes.Float8Recipe`: measure what it would do to the
            inputs, weights and output gradients of every ``nn.Linear``, changing no value
            of the step (the recipe's state, a delayed history or a rounding counter, lives
            in the collector).

    Raises:
        ValueError: a model with nothing to observe, ``what_if`` on a converted model, or an
            unknown recipe (each names the fix). RuntimeError: a second collector on the same
            layers.

    Every quantization inside the block counts (training and eval forwards, every step);
    a backward must run inside the block to be recorded.

    Example::

        >>> with collect_quant_stats(model, what_if="nvfp4") as stats:
        ...     loss_fn(model(x)).backward()
        >>> stats.rows()[["layer", "tensor", "rel_err", "underflow_pct"]]
    """
    return _what_if(model, what_if) if what_if is not None else _observing(model)
