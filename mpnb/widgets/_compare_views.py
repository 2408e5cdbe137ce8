"""The result views of :class:`~mpnb.widgets.CompareWidget`: figures built once, updated in place.

Every function here only draws a :func:`mpnb.lab.compare` DataFrame (and its ``attrs``);
nothing is measured. Titles, axis units and the "how to read" lines come from
:data:`mpnb.lab.html_report.CHART_TEXT`, and the speed bar from
:func:`mpnb.lab.html_report.speed_bar`, so the widget and the report show the same figure.

Each figure is a plain ``go.Figure`` shown in an ``ipywidgets.Output`` as plotly's own
mime bundle (rendered by JupyterLab's plotly extension): the Output's state holds the whole
figure, so the chart renders whenever and however often a view attaches (after Run All, a
reload, or an update made from the run's thread). ``FigureWidget`` views created early in a
kernel were seen to render blank axes in JupyterLab and to drop later updates.
"""

from __future__ import annotations

import html
import math

import ipywidgets as w
import pandas as pd
import plotly.graph_objects as go
import plotly.io as pio

from mpnb.lab.html_report import (
    CHART_TEXT,
    chart_title,
    curve_style,
    drawn_rows,
    missing_metric,
    results_table,
    snippets_html,
    speed_bar,
    speed_labels,
    speed_note,
    warnings_banner,
)
from mpnb.lab.memory import ROLES

__all__ = [
    "ResultViews",
    "MEMORY_ROLES",
    "table_html",
    "errors_html",
    "verdict_html",
    "code_html",
]

# The widget draws the memory tracker's own roles (FP8 scales and Kahan buffers included).
MEMORY_ROLES = ROLES
_PLACEHOLDER = (
    "<div style='padding:40px;color:#555'><b>{title}</b><br><i>No results yet: choose the "
    "configurations and press Run.</i></div>"
)
_MESSAGE = "<div style='padding:40px;color:#555'><b>{title}</b><br>{text}</div>"


def _fig(name: str, **layout) -> go.Figure:
    _, x, y, _ = CHART_TEXT[name]
    return go.Figure(
        layout=go.Layout(
            title=chart_title(name, 90),
            height=400,
            margin=dict(t=110, b=50, l=70, r=20),
            xaxis=dict(title=x),
            yaxis=dict(title=y),
            **layout,
        )
    )


def _num(v) -> float | None:
    return None if v is None or (isinstance(v, float) and math.isnan(v)) else float(v)


class ResultViews:
    """The figures of the result tabs; :meth:`update` redraws them from a frame.

    Attributes:
        speed, memory, accuracy, loss_curves, loss_scale: plotly ``Figure`` s, created once;
            their traces are updated inside ``batch_update()`` (tests read them).
        outputs: one ``ipywidgets.Output`` per figure (the tab contents); a "press Run"
            placeholder until the first :meth:`update`.
    """

    NAMES = ("speed", "memory", "accuracy", "loss_curves", "loss_scale")

    def __init__(self):
        self.speed = _fig("speed")
        # the labels show as annotations above each whisker (text on the bar was crossed by
        # it); the bar keeps them as its (hidden) text, for hover and for readers of the data
        self.speed.add_bar(
            x=[],
            y=[],
            name="speed vs O0",
            text=[],
            textposition="none",
            error_y=dict(type="data", symmetric=False, array=[], arrayminus=[]),
        )
        self.speed.add_hline(y=1.0, line_dash="dash", line_color="gray")
        self.memory = _fig("memory", barmode="stack")
        for role in MEMORY_ROLES:
            self.memory.add_bar(x=[], y=[], name=role.replace("_", " "))
        self.accuracy = _fig("accuracy")
        self.accuracy.add_bar(x=[], y=[], name="metric", text=[], textposition="outside")
        self.loss_curves = _fig("loss")
        self.loss_scale = _fig("loss_scale", yaxis_type="log")
        self.outputs = {n: w.Output(layout=w.Layout(min_height="420px")) for n in self.NAMES}
        self._placeholders()

    def _placeholders(self) -> None:
        for name, out in self.outputs.items():
            title = CHART_TEXT["loss" if name == "loss_curves" else name][0]
            out.outputs = (
                dict(
                    output_type="display_data",
                    data={"text/html": _PLACEHOLDER.format(title=html.escape(title))},
                    metadata={},
                ),
            )

    def render(self) -> None:
        """Show every figure in its Output (the whole figure: no earlier state is needed)."""
        mime = pio.renderers["plotly_mimetype"]
        for name, out in self.outputs.items():
            fig = getattr(self, name)
            out.outputs = (
                dict(
                    output_type="display_data",
                    data=mime.to_mimebundle(fig.to_plotly_json()),
                    metadata={},
                ),
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
        self._placeholders()

    def update(self, df: pd.DataFrame) -> None:
        """Redraw all figures from ``df`` (the rows that ran; not those Stop came before)."""
        ok = drawn_rows(df)
        names = list(ok["configuration"])
        d = speed_bar(df)
        with self.speed.batch_update():
            bar = self.speed.data[0]
            bar.x, bar.y, bar.text = d["x"], d["y"], d["text"]
            bar.error_y.array, bar.error_y.arrayminus = d["plus"], d["minus"]
            self.speed.layout.annotations = speed_labels(d)
            self.speed.layout.yaxis.range = [0, d["y_max"]]
        with self.memory.batch_update():
            for tr, role in zip(self.memory.data, MEMORY_ROLES, strict=True):
                tr.x, tr.y = names, [_num(v) or 0.0 for v in ok[f"mem_{role}_mib"]]
        self._accuracy(df, ok)
        self._curves(df.attrs.get("history"), names)
        self.render()
        why = missing_metric(df)
        if why:  # a sentence, not empty axes
            title = CHART_TEXT["accuracy"][0]
            self.outputs["accuracy"].outputs = (
                dict(
                    output_type="display_data",
                    data={"text/html": _MESSAGE.format(title=html.escape(title), text=why)},
                    metadata={},
                ),
            )

    def _accuracy(self, df: pd.DataFrame, ok: pd.DataFrame) -> None:
        chance = (df.attrs.get("workload") or {}).get("chance")
        with self.accuracy.batch_update():
            bar = self.accuracy.data[0]
            bar.x, bar.y = list(ok["configuration"]), list(ok["metric"])
            bar.text = [f"{m:.3f}" if _num(m) is not None else "" for m in ok["metric"]]
            if len(ok):
                name = str(ok["metric_name"].iloc[0])
                self.accuracy.layout.yaxis.title = f"{name} (0-1, higher is better)"
            # the workload's chance level, drawn (and named) only where it is known
            line = dict(
                type="line",
                xref="paper",
                x0=0,
                x1=1,
                yref="y",
                y0=chance,
                y1=chance,
                line=dict(dash="dash", color="gray"),
            )
            label = dict(
                xref="paper",
                x=1,
                xanchor="right",
                yref="y",
                y=chance,
                yanchor="bottom",
                text="chance (random guess)",
                showarrow=False,
            )
            self.accuracy.layout.shapes = [line] if chance else []
            self.accuracy.layout.annotations = [label] if chance else []

    def _trace(self, fig: go.Figure, name: str, **kw):
        for tr in fig.data:
            if tr.name == name:
                return tr
        fig.add_scatter(x=[], y=[], name=name, **kw)
        return fig.data[-1]

    def _curves(self, hist: pd.DataFrame | None, names: list[str]) -> None:
        if hist is None or hist.empty:
            return
        with self.loss_curves.batch_update(), self.loss_scale.batch_update():
            for i, name in enumerate(names):
                h = hist[hist["configuration"] == name]
                style = curve_style(i)  # markers and dashes: overlapping curves stay apart
                tr = self._trace(self.loss_curves, name, **style)
                tr.x, tr.y, tr.visible = list(h["step"]), list(h["loss"]), True
                tr = self._trace(self.loss_scale, name, **style)
                tr.x, tr.y, tr.visible = list(h["step"]), list(h["loss_scale"]), True
                sk = h[h["skipped"].astype(bool)]
                tr = self._trace(
                    self.loss_scale,
                    f"{name} skipped",
                    mode="markers",
                    marker=dict(symbol="x", size=9, color="#d62728"),
                )
                tr.x, tr.y, tr.visible = list(sk["step"]), list(sk["loss_scale"]), len(sk) > 0


def table_html(df: pd.DataFrame | None) -> str:
    """The results as an HTML table (the report's: headers with units, readable numbers),
    under one banner that lists each warning once."""
    if df is None or df.empty:
        return "<i>No results yet: choose the configurations and press Run.</i>"
    notes = warnings_banner(df) if "warnings" in df.columns else []
    banner = (
        "<div class='mpnb-warnings' style='border-left:4px solid #a05a00;background:#fff8ec;"
        "padding:2px 10px;margin-bottom:6px;font-size:12px'><b>Warnings</b><ul "
        "style='margin:2px 0'>"
        + "".join(f"<li>{html.escape(n)}</li>" for n in notes)
        + "</ul></div>"
        if notes
        else ""
    )
    style = (
        "<style>.mpnb-table{font-size:12px;border-collapse:collapse}.mpnb-table td,"
        ".mpnb-table th{padding:2px 6px;white-space:nowrap;border-bottom:1px solid #ddd}"
        ".mpnb-table th{white-space:normal;vertical-align:bottom}</style>"
    )
    note = (
        "<p class='mpnb-speed-note' style='font-size:12px;color:#444;max-width:900px;"
        f"line-height:1.4'>{html.escape(speed_note(df))}</p>"
    )
    return style + banner + note + results_table(df, classes="mpnb-table")


def code_html(df: pd.DataFrame | None) -> str:
    """Each row's snippet (:func:`mpnb.lab.html_report.snippets_html`): the lines to train that
    way in your own loop, as ``<pre>`` blocks to copy."""
    code = "" if df is None or df.empty else snippets_html(df, classes="mpnb-snippet")
    if not code:
        return "<i>After a run, each row's code to train that way in your own loop shows here.</i>"
    style = (
        "<style>.mpnb-snippet pre{background:#f6f8fa;padding:6px;border:1px solid #ddd;"
        "font-size:12px;white-space:pre;overflow-x:auto;user-select:text}</style>"
    )
    return style + code


def errors_html(df: pd.DataFrame | None) -> str:
    """One red line per configuration that failed, with its error (and one grey line per
    configuration this device cannot run, with the reason); empty when none did."""
    if df is None or df.empty:
        return ""
    bad = df[df["error"].fillna("") != ""]
    out = []
    for r in bad.itertuples():
        name = html.escape(r.configuration)
        text = html.escape(str(r.error).removeprefix(f"{r.configuration}: "))
        if getattr(r, "status", "") == "unsupported":  # not a failure: this device lacks it
            out.append(f"<div style='color:#555'><b>{name}</b> not run: {text}</div>")
        else:
            out.append(f"<div style='color:#b00020'><b>{name}</b> failed: {text}</div>")
    return "".join(out)


def verdict_html(df: pd.DataFrame | None) -> str:
    """The verdict box shown at the top of the widget (a placeholder before the first run)."""
    if df is None or "verdict" not in df.attrs:
        return (
            "<div class='mpnb-verdict' style='color:#555'><i>The verdict appears here after "
            "a run: press Run.</i></div>"
        )
    first, *rest = df.attrs["verdict"]["text"].splitlines()
    items = "".join(f"<li>{html.escape(line)}</li>" for line in rest)
    return (
        "<div class='mpnb-verdict' style='border-left:4px solid #1f77b4;padding:4px 10px;"
        f"background:#f4f8fc'><b>{html.escape(first)}</b><ul style='margin:4px 0'>{items}"
        "</ul></div>"
    )
