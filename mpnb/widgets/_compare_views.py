"""The result views of :class:`~mpnb.widgets.CompareWidget`: figures built once, updated in place.

Every function here only draws a :func:`mpnb.lab.compare` DataFrame (and its
``attrs["history"]``); nothing is measured.
"""

from __future__ import annotations

import html
import math

import pandas as pd
import plotly.graph_objects as go

__all__ = ["ResultViews", "MEMORY_ROLES", "table_html", "errors_html"]

MEMORY_ROLES = ("params", "grads", "master_weights", "optimizer_state", "activations")
_TABLE_COLUMNS = [
    "configuration",
    "precision",
    "step_time_ms",
    "speedup_vs_O0",
    "samples_per_s",
    "peak_mem_mib",
    "mem_saving_vs_O0",
    "metric",
    "final_loss",
    "skipped_steps",
    "final_loss_scale",
    "warnings",
    "error",
]


def _fig(title: str, x: str, y: str, **layout) -> go.FigureWidget:
    return go.FigureWidget(
        layout=go.Layout(
            title=title,
            height=330,
            margin=dict(t=45, b=45, l=60, r=20),
            xaxis=dict(title=x),
            yaxis=dict(title=y),
            **layout,
        )
    )


def _num(v) -> float | None:
    return None if v is None or (isinstance(v, float) and math.isnan(v)) else float(v)


class ResultViews:
    """The figures and HTML panes of the result tabs; :meth:`update` redraws them from a frame.

    Attributes:
        speed, memory, accuracy, loss_curves, loss_scale: plotly ``FigureWidget`` s, created
            once; their traces are updated inside ``batch_update()``.
    """

    def __init__(self):
        self.speed = _fig(
            "step time: bars = median ms/step (lower is faster)<br><sup>labels = speed vs an O0 "
            "run trained side by side (median of per-step ratios)</sup>",
            "configuration",
            "ms / step",
        )
        self.speed.add_bar(x=[], y=[], name="step time", text=[], textposition="outside")
        self.memory = _fig(
            "memory at the tracked step, by role", "configuration", "MiB", barmode="stack"
        )
        for role in MEMORY_ROLES:
            self.memory.add_bar(x=[], y=[], name=role.replace("_", " "))
        self.accuracy = _fig("final metric", "configuration", "metric")
        self.accuracy.add_bar(x=[], y=[], name="metric", text=[], textposition="outside")
        self.loss_curves = _fig("training loss", "step", "loss")
        self.loss_scale = _fig(
            "loss scale (x: skipped steps)", "step", "loss scale", yaxis_type="log"
        )

    def clear(self) -> None:
        """Empty every figure (kept as the same objects) before a new run."""
        for fig in (self.speed, self.memory, self.accuracy):
            with fig.batch_update():
                for tr in fig.data:
                    tr.x, tr.y = [], []
        for fig in (self.loss_curves, self.loss_scale):
            with fig.batch_update():
                for tr in fig.data:
                    tr.x, tr.y, tr.visible = [], [], False

    def update(self, df: pd.DataFrame) -> None:
        """Redraw all figures from ``df`` (the rows finished so far)."""
        ok = df[df["error"].fillna("") == ""]
        names = list(ok["configuration"])
        with self.speed.batch_update():
            bar = self.speed.data[0]
            bar.x, bar.y = names, list(ok["step_time_ms"])
            bar.text = [f"{s:.2f}x O0" if _num(s) is not None else "" for s in ok["speedup_vs_O0"]]
        with self.memory.batch_update():
            for tr, role in zip(self.memory.data, MEMORY_ROLES, strict=True):
                tr.x, tr.y = names, [_num(v) or 0.0 for v in ok[f"mem_{role}_mib"]]
        with self.accuracy.batch_update():
            bar = self.accuracy.data[0]
            bar.x, bar.y = names, list(ok["metric"])
            bar.text = [f"{m:.3f}" for m in ok["metric"]]
            if len(ok):
                self.accuracy.layout.yaxis.title = str(ok["metric_name"].iloc[0])
        self._curves(df.attrs.get("history"), names)

    def _trace(self, fig: go.FigureWidget, name: str, **kw):
        for tr in fig.data:
            if tr.name == name:
                return tr
        fig.add_scatter(x=[], y=[], name=name, **kw)
        return fig.data[-1]

    def _curves(self, hist: pd.DataFrame | None, names: list[str]) -> None:
        if hist is None or hist.empty:
            return
        with self.loss_curves.batch_update(), self.loss_scale.batch_update():
            for name in names:
                h = hist[hist["configuration"] == name]
                tr = self._trace(self.loss_curves, name, mode="lines")
                tr.x, tr.y, tr.visible = list(h["step"]), list(h["loss"]), True
                tr = self._trace(self.loss_scale, name, mode="lines")
                tr.x, tr.y, tr.visible = list(h["step"]), list(h["loss_scale"]), True
                sk = h[h["skipped"].astype(bool)]
                tr = self._trace(
                    self.loss_scale,
                    f"{name} skipped",
                    mode="markers",
                    marker=dict(symbol="x", size=9, color="#d62728"),
                )
                tr.x, tr.y, tr.visible = list(sk["step"]), list(sk["loss_scale"]), len(sk) > 0


def table_html(df: pd.DataFrame) -> str:
    """The results as an HTML table (errors included, in red)."""
    if df is None or df.empty:
        return "<i>No results yet: choose the configurations and press Run.</i>"
    cols = [c for c in _TABLE_COLUMNS if c in df.columns]
    fmt = {c: "{:.3g}".format for c in cols if pd.api.types.is_float_dtype(df[c])}
    body = df[cols].to_html(
        index=False, formatters=fmt, na_rep="", escape=True, classes="mpnb-table", border=0
    )
    return f"<div style='overflow-x:auto'>{body}</div>"


def errors_html(df: pd.DataFrame) -> str:
    """One red line per configuration that failed, with its error; empty when none did."""
    if df is None or df.empty:
        return ""
    bad = df[df["error"].fillna("") != ""]
    return "".join(
        f"<div style='color:#b00020'><b>{html.escape(r.configuration)}</b> failed: "
        f"{html.escape(str(r.error))}</div>"
        for r in bad.itertuples()
    )
