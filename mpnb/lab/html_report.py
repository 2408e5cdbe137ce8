"""``report``: one self-contained HTML page from a ``compare`` DataFrame (works offline).

The page inlines plotly.js once (``plotly.offline.get_plotlyjs()``) and draws only what the
DataFrame holds: the verdict, speed (the ``speedup_vs_O0`` figure, its interval and its
``speed_label``), memory breakdown, quality metric, loss curves and loss scale per step
(from ``df.attrs["history"]``), the hardware summary and the table. Nothing is measured here.
"""

from __future__ import annotations

import html
import math
import textwrap
from pathlib import Path

import pandas as pd

from mpnb.lab.memory import ROLES

__all__ = ["report", "figures", "speed_bar", "chart_title", "CHARTS", "CHART_TEXT"]

CHARTS = ("speed", "memory", "accuracy", "loss", "loss_scale")

#: per chart: title, x-axis title, y-axis title (with units), and one line on how to read it.
#: The widget's figures use the same texts.
CHART_TEXT = {
    "speed": (
        "Speed vs O0 (median of per-round step-time ratios)",
        "configuration",
        "speed vs O0 (x; >1 is faster)",
        "How to read: a bar above the 1.0 line ran faster than O0, below it slower; whiskers are "
        "the 95% interval, and a label says 'no measurable difference' when it spans 1.0.",
    ),
    "memory": (
        "Peak tensor memory by role",
        "configuration",
        "memory (MiB)",
        "How to read: each bar is the memory live at the step's peak, split by what holds it; "
        "half precision shrinks params, grads and activations, O2 adds fp32 master weights.",
    ),
    "accuracy": (
        "Held-out quality after training",
        "configuration",
        "metric (0-1, higher is better)",
        "How to read: bars of equal height mean mixed precision cost no accuracy; the dashed "
        "line is chance (a random guess).",
    ),
    "loss": (
        "Training loss per step",
        "step",
        "loss (cross-entropy, nats)",
        "How to read: curves that overlap trained alike; a curve that stops or jumps up diverged.",
    ),
    "loss_scale": (
        "Loss scale per step",
        "step",
        "loss scale (log scale)",
        "How to read: the dynamic scale halves on each skipped step (x markers) and doubles "
        "after a run of clean steps; a flat line means no overflow.",
    ),
}

_TABLE_COLS = (
    "configuration",
    "precision",
    "status",
    "speed_label",
    "speedup_vs_O0",
    "speedup_lo",
    "speedup_hi",
    "step_time_ms",
    "samples_per_s",
    "peak_mem_mib",
    "mem_saving_vs_O0",
    "final_loss",
    "metric",
    "metric_vs_O0",
    "output_diff_vs_O0",
    "skipped_steps",
    "final_loss_scale",
    "warnings",
    "error",
)


def _ok(df: pd.DataFrame) -> pd.DataFrame:
    return df[df["error"].fillna("") == ""]


def chart_title(name: str, width: int = 100) -> str:
    """The chart's title with its "how to read" line below, wrapped to ``width`` characters."""
    title, _, _, how = CHART_TEXT[name]
    lines = "<br>".join(html.escape(line) for line in textwrap.wrap(how, width))
    return f"{title}<br><sup>{lines}</sup>"


def _layout(fig, name: str, **kw):
    _, x, y, _ = CHART_TEXT[name]
    fig.update_layout(
        title_text=chart_title(name), xaxis_title=x, yaxis_title=y, margin=dict(t=110), **kw
    )
    return fig


def speed_bar(df: pd.DataFrame) -> dict:
    """The speed bar's data from ``df``: x, y (speed-up), asymmetric whiskers and labels.

    The widget and the report both draw exactly this.
    """
    ok = _ok(df)
    y = [float(v) for v in ok["speedup_vs_O0"]]
    lo = [float(v) for v in ok["speedup_lo"]]
    hi = [float(v) for v in ok["speedup_hi"]]
    return dict(
        x=list(ok["configuration"]),
        y=y,
        plus=[max(h - v, 0.0) if math.isfinite(h) else 0.0 for v, h in zip(y, hi, strict=True)],
        minus=[max(v - a, 0.0) if math.isfinite(a) else 0.0 for v, a in zip(y, lo, strict=True)],
        text=list(ok["speed_label"]),
    )


def _speed(go, df):
    d = speed_bar(df)
    fig = go.Figure(
        go.Bar(
            x=d["x"],
            y=d["y"],
            error_y=dict(type="data", symmetric=False, array=d["plus"], arrayminus=d["minus"]),
            text=d["text"],
            textposition="outside",
        )
    )
    fig.add_hline(y=1.0, line_dash="dash", line_color="gray")
    return _layout(fig, "speed")


def _memory(go, df):
    ok = _ok(df)
    fig = go.Figure(
        [go.Bar(name=r.replace("_", " "), x=ok.configuration, y=ok[f"mem_{r}_mib"]) for r in ROLES]
    )
    return _layout(fig, "memory", barmode="stack")


def _accuracy(go, df):
    ok = _ok(df)
    name = str(df.metric_name.iloc[0]) if len(df) else "metric"
    fig = go.Figure(
        go.Bar(
            x=ok.configuration,
            y=ok.metric,
            text=[f"{m:.3f}" for m in ok.metric],
            textposition="outside",
        )
    )
    _layout(fig, "accuracy")
    fig.update_layout(yaxis_title=f"{name} (0-1, higher is better)")
    chance = df.attrs.get("workload", {}).get("chance")
    if chance:
        fig.add_hline(y=chance, line_dash="dash", line_color="gray", annotation_text="chance")
    return fig


def _history_lines(go, df, column: str, name: str, log: bool):
    hist = df.attrs.get("history", pd.DataFrame(columns=["configuration", "step", column]))
    fig = go.Figure()
    dashes = ("solid", "dash", "dot", "dashdot", "longdash", "longdashdot")
    for i, (cfg, h) in enumerate(hist.groupby("configuration", sort=False)):
        fig.add_trace(
            go.Scatter(
                x=h.step,
                y=h[column],
                mode="lines+markers",
                marker=dict(size=4),
                line=dict(dash=dashes[i % len(dashes)]),
                name=str(cfg),
            )
        )
    return _layout(fig, name, yaxis_type="log" if log else "linear")


def figures(df: pd.DataFrame) -> dict:
    """The report's plotly figures by name (:data:`CHARTS`), e.g. for a notebook to show."""
    import plotly.graph_objects as go

    return {
        "speed": _speed(go, df),
        "memory": _memory(go, df),
        "accuracy": _accuracy(go, df),
        "loss": _history_lines(go, df, "loss", "loss", log=False),
        "loss_scale": _history_lines(go, df, "loss_scale", "loss_scale", log=True),
    }


def _verdict_html(df: pd.DataFrame) -> str:
    v = df.attrs.get("verdict")
    if not v:
        return ""
    first, *rest = v["text"].splitlines()
    items = "".join(f"<li>{html.escape(line)}</li>" for line in rest)
    return f'<div id="verdict"><p><b>{html.escape(first)}</b></p><ul>{items}</ul></div>'


def _hardware_html(df: pd.DataFrame) -> str:
    hw = df.attrs.get("hardware", {})
    items = "".join(
        f"<li><b>{html.escape(str(k))}</b>: {html.escape(str(v))}</li>"
        for k, v in hw.items()
        if k != "summary"
    )
    load = df.attrs.get("load", {})
    if load:
        items += (
            f"<li><b>load average</b>: {html.escape(str(load.get('start')))} at the start, "
            f"{html.escape(str(load.get('end')))} at the end</li>"
        )
    method = html.escape(str(df.attrs.get("method", "")))
    return (
        f"<p>{html.escape(str(hw.get('summary', '')))}</p><ul>{items}</ul>"
        f"<p>Timing: {method}; speed = median of the per-round ratios of O0's step time to "
        "the configuration's (torch.utils.benchmark.timer, after warm-up), with a 95% "
        "bootstrap interval.</p>"
    )


def report(df: pd.DataFrame, path: str | Path, title: str = "mpnb compare") -> Path:
    """Write ``df`` (from :func:`mpnb.lab.compare`) as one self-contained HTML page.

    Args:
        df: the DataFrame ``compare`` returned (with its ``attrs``).
        path: where to write (parent directories are created).
        title: the page title.

    Returns:
        The path written.

    Example::

        >>> mpnb.lab.report(mpnb.lab.compare("mlp", steps=60), "report.html")
    """
    try:
        from plotly.offline import get_plotlyjs
    except ImportError as e:
        raise ImportError("mpnb.lab.report needs plotly: pip install plotly") from e
    missing = [c for c in ("configuration", "error", "metric_name") if c not in df.columns]
    if missing:
        raise ValueError(f"report: the DataFrame lacks {missing}; pass what compare() returned.")
    charts = "".join(
        f'<section id="chart-{name}">'
        + fig.to_html(full_html=False, include_plotlyjs=False, div_id=f"plot-{name}")
        + "</section>"
        for name, fig in figures(df).items()
    )
    cols = [c for c in _TABLE_COLS if c in df.columns]
    table = df[cols].to_html(
        index=False, float_format=lambda v: f"{v:.4g}", na_rep="-", border=0, classes="rows"
    )
    page = f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:1200px}}
table.rows{{border-collapse:collapse;font-size:12px}}
table.rows td,table.rows th{{padding:3px 6px;border-bottom:1px solid #ddd}}</style>
<script type="text/javascript">{get_plotlyjs()}</script></head>
<body><h1>{html.escape(title)}: {html.escape(str(df.workload.iloc[0]) if len(df) else "")}</h1>
<h2>Verdict</h2>{_verdict_html(df)}
<h2>Hardware</h2>{_hardware_html(df)}
<h2>Results</h2>{table}
<h2>Charts</h2>{charts}
</body></html>"""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page, encoding="utf-8")
    return out
