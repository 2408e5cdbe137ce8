"""``ScalerExplorer``: gradients against the fp16/bf16 ranges, and a real loss scaler to step.

The view shows a histogram of ``log2|g|`` of a model's gradients, shifted by the chosen loss
scale, over the bands fp16 and bf16 can represent, with the fractions that would underflow to
zero or overflow to inf. Stepping runs a real :class:`mpnb.amp.LossScaler`, built from a
:class:`mpnb.amp.LossScaleRule` of the controls' values (validated by that rule, so the
controls accept exactly what amp accepts): each step unscales the scaled, half-cast gradients
with the scaler (which flags inf/NaN) and applies :meth:`~mpnb.amp.LossScaler.update`, the
rule amp applies: growth after ``growth_interval`` clean steps, backoff on inf/NaN, the clamp
to ``[floor, max_scale]``.
"""

from __future__ import annotations

import html
import math
from collections.abc import Iterable

import ipywidgets as w
import plotly.graph_objects as go
import torch
import traitlets as t

from mpnb.core.amp import LossScaler, LossScaleRule
from mpnb.core.dtype_names import HALF_NAMES, parse_half_dtype
from mpnb.widgets._common import ErrorBox, FigureOutput, half_status_label

__all__ = ["ScalerExplorer", "format_range"]

_BINS = torch.arange(-100.0, 61.0)  # log2|g| bin edges shown on the x axis


def format_range(name: str) -> tuple[float, float, float]:
    """``(log2 smallest subnormal, log2 smallest normal, log2 max)`` of ``"fp16"``/``"bf16"``."""
    fi = torch.finfo(parse_half_dtype(name))
    return math.log2(fi.smallest_normal * fi.eps), math.log2(fi.smallest_normal), math.log2(fi.max)


def _band(x0: float, x1: float, color: str) -> dict:
    """A full-height shaded rectangle from ``x0`` to ``x1`` (plotly shape)."""
    return dict(
        type="rect",
        xref="x",
        yref="paper",
        x0=x0,
        x1=x1,
        y0=0,
        y1=1,
        fillcolor=color,
        opacity=0.35,
        line_width=0,
        layer="below",
    )


def _flat_grads(grads) -> torch.Tensor:
    if isinstance(grads, torch.nn.Module):
        grads = [p.grad for p in grads.parameters() if p.grad is not None]
        if not grads:
            raise ValueError(
                "ScalerExplorer: the model has no gradients; run loss.backward() "
                "first, or pass grads=[...]."
            )
    if isinstance(grads, torch.Tensor):
        grads = [grads]
    flat = torch.cat([g.detach().float().flatten().cpu() for g in grads])
    if flat.numel() == 0:
        raise ValueError("ScalerExplorer: no gradient values given.")
    return flat


class ScalerExplorer(w.VBox):
    """Gradient distribution vs the fp16/bf16 ranges, with a simulated dynamic loss scaler.

    Args:
        grads: an ``nn.Module`` whose ``.grad`` are filled (after ``loss.backward()`` in fp32),
            a tensor, or an iterable of tensors: the *unscaled* gradients.
        init_scale: the loss scale to start from (the slider is in powers of two).
        growth_factor, backoff_factor, growth_interval: the dynamic scaler's parameters
            (``torch.amp.GradScaler``'s names; the :class:`~mpnb.amp.LossScaleRule`'s fields).
        dtype: ``"fp16"`` or ``"bf16"``, the half dtype the gradients are cast to.
        max_scale: the scale never grows past this (the rule's ``max_loss_scale``).

    The charts are whole figures in ``Output`` s (:class:`~mpnb.widgets._common.FigureOutput`):
    they render after Run All and after a page reload, with the bands and history the kernel
    holds; the timeline shows "press Step" until the first step.

    Attributes:
        hist_fig, timeline_fig: the plotly figures (tests read them); hist_view,
            timeline_view: the ``Output`` s that show them.
        scaler: the :class:`~mpnb.amp.LossScaler` that :meth:`step` steps (a new one on
            :meth:`reset`).

    Example::

        >>> loss.backward()
        >>> ex = ScalerExplorer(model, init_scale=2.0**20, growth_interval=4)
        >>> ex.step(20)               # or click "Step"
        >>> ex.history[-1]  # {"step": 20, "scale": used, "skipped": False, "next_scale": ...}
    """

    scale = t.Float(2.0**16).tag(sync=False)
    dtype = t.Unicode("fp16").tag(sync=False)
    history = t.List().tag(sync=False)

    def __init__(
        self,
        grads: torch.nn.Module | torch.Tensor | Iterable[torch.Tensor],
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 4,
        dtype: str = "fp16",
        max_scale: float = 2.0**24,
    ):
        flat = _flat_grads(grads)
        nz = flat[(flat != 0) & torch.isfinite(flat)].abs()
        self._log2 = torch.log2(nz).double()
        self._zero_frac = 1.0 - nz.numel() / flat.numel()
        self._extremes = torch.stack([nz.max(), nz.min()]) if nz.numel() else flat[:1].abs()
        self._counts = torch.histogram(self._log2.float(), _BINS).hist.tolist()
        self.max_scale = float(max_scale)
        self.errors = ErrorBox()
        self._controls(init_scale, growth_factor, backoff_factor, growth_interval, dtype)
        self._figures()
        super().__init__(
            [self._control_box, self.stats, self.hist_view, self.timeline_view, self.errors]
        )
        self.dtype = dtype
        self.reset()
        self.observe(self.errors.guard(self._redraw), names=["scale", "dtype"])
        self.observe(self.errors.guard(self._redraw_timeline), names=["history"])
        self._redraw()

    # ---- controls and figures (built once) -------------------------------------------------

    def _controls(self, init_scale, growth_factor, backoff_factor, growth_interval, dtype):
        self.scale_slider = w.FloatLogSlider(
            value=init_scale,
            base=2,
            min=0,
            max=40,
            step=1,
            description="loss scale",
            readout_format=".3g",
        )
        self.dtype_toggle = w.ToggleButtons(
            # fp16 first: the format loss scaling exists for
            options=[(half_status_label(n), n) for n in reversed(HALF_NAMES)],
            value=dtype,
            description="half dtype",
        )
        # plain text boxes: a bad value is refused beside the controls, never clamped
        self.growth = w.FloatText(value=growth_factor, step=0.5, description="growth")
        self.backoff = w.FloatText(value=backoff_factor, step=0.05, description="backoff")
        self.interval = w.IntText(value=growth_interval, description="interval")
        self.n_steps = w.IntText(value=10, description="steps")
        self.control_error = w.HTML()
        self.step_button = w.Button(description="Step", icon="forward")
        self.spike_button = w.Button(
            description="Overflow step",
            icon="bolt",
            tooltip="simulate one batch with inf/NaN gradients",
        )
        self.reset_button = w.Button(description="Reset", icon="undo")
        self.step_button.on_click(self.errors.guard(lambda _: self.step(self.n_steps.value)))
        for c in (self.growth, self.backoff, self.interval, self.n_steps):
            c.observe(lambda _: self.validate(), names="value")
        self.spike_button.on_click(self.errors.guard(lambda _: self.step(1, force_inf=True)))
        self.reset_button.on_click(self.errors.guard(lambda _: self.reset()))
        t.link((self.scale_slider, "value"), (self, "scale"))
        t.link((self.dtype_toggle, "value"), (self, "dtype"))
        self._init_scale = init_scale
        self.stats = w.HTML()
        self._control_box = w.VBox(
            [
                w.HBox([self.scale_slider, self.dtype_toggle]),
                w.HBox([self.growth, self.backoff, self.interval]),
                w.HBox([self.n_steps, self.step_button, self.spike_button, self.reset_button]),
                self.control_error,
            ]
        )
        self.validate()

    def _fields(self) -> dict:
        """The rule's fields the controls set (the scale itself comes from the slider)."""
        return dict(
            growth_factor=self.growth.value,
            backoff_factor=self.backoff.value,
            growth_interval=self.interval.value,
        )

    def rule(self) -> LossScaleRule:
        """The :class:`~mpnb.amp.LossScaleRule` of the controls (ValueError if one is bad).

        Hysteresis 1 (PyTorch's GradScaler rule), ``max_scale`` as ``max_loss_scale``, and no
        collapse error: a simulation may sit at the floor as long as you like.
        """
        return self._base_rule().replace(**self._fields())

    def _base_rule(self) -> LossScaleRule:
        return LossScaleRule(
            init_scale=self._init_scale, max_loss_scale=self.max_scale, max_skips_at_min=None
        )

    def input_errors(self) -> list[str]:
        """What is wrong with the scaler controls now (empty: all valid).

        The loss-scale fields are checked by :class:`~mpnb.amp.LossScaleRule` itself
        (:meth:`~mpnb.amp.LossScaleRule.field_errors`), so they accept what amp accepts.
        """
        labels = {
            "growth_factor": "growth",
            "backoff_factor": "backoff",
            "growth_interval": "interval",
        }
        errs = [
            f"{labels[k]}: {msg.rstrip('.')}"
            for k, msg in LossScaleRule.field_errors(**self._fields()).items()
        ]
        if self.n_steps.value < 1:
            errs.append(f"steps {self.n_steps.value}: need at least 1")
        return errs

    def validate(self) -> bool:
        """Show the invalid controls' messages under them; Step is disabled until fixed."""
        errs = self.input_errors()
        self.control_error.value = "".join(
            f"<div style='color:#b00020'>&#9888; {html.escape(e)}; refused, not clamped</div>"
            for e in errs
        )
        self.step_button.disabled = self.spike_button.disabled = bool(errs)
        return not errs

    def _figures(self):
        lo, hi = float(_BINS[0]), float(_BINS[-1])
        centers = (_BINS[:-1] + 0.5).tolist()
        self.hist_fig = go.Figure(
            data=[
                go.Bar(x=centers, y=self._counts, name="unscaled", opacity=0.35),
                go.Bar(x=centers, y=self._counts, name="scaled"),
            ],
            layout=go.Layout(
                barmode="overlay",
                height=320,
                margin=dict(t=40, b=40),
                title="log2 |gradient| vs the half dtype's range",
                xaxis=dict(title="log2 |g|", range=[lo, hi]),
                yaxis=dict(title="count"),
            ),
        )
        self.timeline_fig = go.Figure(
            data=[
                go.Scatter(x=[], y=[], mode="lines+markers", name="loss scale"),
                go.Scatter(
                    x=[],
                    y=[],
                    mode="markers",
                    name="skipped (inf/NaN)",
                    marker=dict(color="#d62728", symbol="x", size=10),
                ),
            ],
            layout=go.Layout(
                height=260,
                margin=dict(t=40, b=40),
                title="simulated scaler",
                xaxis=dict(title="step"),
                yaxis=dict(title="loss scale", type="log", exponentformat="power"),
            ),
        )
        self.hist_view = FigureOutput(self.hist_fig, "gradient histogram", "computing...")
        self.timeline_view = FigureOutput(
            self.timeline_fig,
            "simulated scaler",
            "No steps yet: press Step (or Overflow step) to run the dynamic scaler.",
            min_height="280px",
        )

    # ---- state ------------------------------------------------------------------------------

    def fractions(self, scale: float | None = None, dtype: str | None = None) -> dict:
        """Fractions of all gradient values lost to zero / sent to inf at ``scale`` in ``dtype``.

        Values below half the smallest subnormal round to zero; above the largest finite value
        plus half an ulp they round to inf.
        """
        s = math.log2(self.scale if scale is None else scale)
        sub, _, top = format_range(dtype or self.dtype)
        eps = torch.finfo(parse_half_dtype(dtype or self.dtype)).eps
        shifted = self._log2 + s
        n = self._log2.numel() / max(1e-300, 1.0 - self._zero_frac)
        under = (shifted < sub - 1).sum().item() / n
        over = (shifted >= top + math.log2(1 + eps / 2)).sum().item() / n
        return {"underflow": under, "overflow": over, "zero_before": self._zero_frac}

    def reset(self) -> None:
        """Back to the initial scale with a new scaler and an empty history."""
        self.scaler = LossScaler(self._base_rule())  # step() applies the controls' rule
        self.scale = self.scaler.loss_scale()
        self.history = []

    def step(self, n: int = 1, force_inf: bool = False) -> list[dict]:
        """Run ``n`` steps of :attr:`scaler`; returns the new history entries.

        Each entry is ``{"step", "scale" (the scale the step used), "skipped", "next_scale"}``.

        Each step casts the scaled extreme gradients to the half dtype, unscales them with
        :meth:`LossScaler.unscale` (which flags inf/NaN, as in amp) and applies
        :meth:`LossScaler.update` with the controls' :meth:`rule`. A scale set with the slider
        since the last step is loaded into the scaler first (clamped by the rule, as a
        checkpoint's would be). ``force_inf`` simulates a batch whose gradients are non-finite
        whatever the scale.
        """
        if not self.validate():
            raise ValueError("; ".join(self.input_errors()) + " (fix it beside the control)")
        s = self.scaler
        s.rule = self.rule()  # the controls may have changed since the last step
        if self.scale != s.loss_scale():  # the slider moved: the scaler starts from there
            s.load_state_dict({**s.state_dict(), "loss_scale": float(self.scale)})
        half = parse_half_dtype(self.dtype)
        new = []
        for _ in range(int(n)):
            s.clear_overflow()
            scaled = (self._extremes * s.scale).to(half)
            if force_inf:
                scaled = scaled.clone().fill_(float("inf"))
            used = s.loss_scale()
            s.unscale([scaled], [torch.empty_like(scaled, dtype=torch.float32)])
            s.update()
            new.append(
                {
                    "step": len(self.history) + len(new) + 1,
                    "scale": used,
                    "skipped": bool(s.found_inf.item() > 0),
                    "next_scale": s.loss_scale(),
                }
            )
        self.history = [*self.history, *new]
        if new:
            self.scale = new[-1]["next_scale"]
        return new

    # ---- drawing ----------------------------------------------------------------------------

    def _redraw(self, change=None) -> None:
        ls = math.log2(self.scale)
        sub, normal, top = format_range(self.dtype)
        f = self.fractions()
        with self.hist_fig.batch_update():
            self.hist_fig.data[1].x = [c + ls for c in self.hist_fig.data[0].x]
            self.hist_fig.data[1].name = f"scaled x 2^{ls:.0f}"
            self.hist_fig.layout.shapes = [
                _band(sub, normal, "#ffd580"),  # subnormal: representable, fewer bits
                _band(normal, top, "#9fd89f"),  # normal range
            ]
            self.hist_fig.layout.title = (
                f"log2 |gradient| vs the {self.dtype} range (green: normal, orange: subnormal)"
            )
        self.stats.value = (
            f"<b>{half_status_label(self.dtype)}</b> at scale 2^{ls:.1f}: "
            f"<b>{f['underflow']:.2%}</b> of the gradient values underflow to zero, "
            f"<b>{f['overflow']:.2%}</b> overflow to inf "
            f"({f['zero_before']:.2%} were exactly zero already)."
        )
        self.hist_view.render()

    def _redraw_timeline(self, change=None) -> None:
        h = self.history
        with self.timeline_fig.batch_update():
            self.timeline_fig.data[0].x = [e["step"] for e in h]
            self.timeline_fig.data[0].y = [e["scale"] for e in h]
            self.timeline_fig.data[1].x = [e["step"] for e in h if e["skipped"]]
            self.timeline_fig.data[1].y = [e["scale"] for e in h if e["skipped"]]
        if h:
            self.timeline_view.render()
        else:
            self.timeline_view.placeholder()
