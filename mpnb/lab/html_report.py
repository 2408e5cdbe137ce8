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

from mpnb.lab._rows import split_warnings
from mpnb.lab.memory import ROLES

__all__ = [
    "report",
    "figures",
    "speed_bar",
    "chart_title",
    "results_table",
    "warnings_banner",
    "glossary_html",
    "format_value",
    "curve_style",
    "CHARTS",
    "CHART_TEXT",
    "TABLE_COLUMNS",
]

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

#: the results table's columns and their headers (with units); the widget shows the same.
#: Warnings are not a column: they are gathered once in :func:`warnings_banner`.
TABLE_COLUMNS = {
    "configuration": "configuration",
    "precision": "precision",
    "status": "status",
    "speed_label": "speed vs O0",
    "speedup_vs_O0": "speed-up (x O0)",
    "speedup_lo": "95% low (x)",
    "speedup_hi": "95% high (x)",
    "step_time_ms": "step time (ms)",
    "samples_per_step": "samples per step",
    "samples_per_s": "throughput (samples/s)",
    "peak_mem_mib": "peak memory (MiB)",
    "mem_saving_vs_O0": "memory saved vs O0 (%)",
    "final_loss": "final loss",
    "metric": "metric (0-1)",
    "metric_vs_O0": "metric vs O0",
    "output_diff_vs_O0": "output difference vs O0 (rel.)",
    "skipped_steps": "skipped steps",
    "final_loss_scale": "final loss scale",
    "error": "error",
}


def format_value(col: str, v) -> str:
    """A number as a reader wants it: ``66,340`` samples/s, ``+18%``, ``1.25``, ``65536``.

    Example::

        >>> format_value("samples_per_s", 66340.2), format_value("mem_saving_vs_O0", -3.4e-5)
        ('66,340', '0%')
    """
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if isinstance(v, str):
        return v
    v = float(v)
    if col == "mem_saving_vs_O0":
        pct = round(v * 100)
        return f"{pct:+d}%" if pct else "0%"
    if col in ("speedup_vs_O0", "speedup_lo", "speedup_hi"):
        return f"{v:.2f}"
    if col in ("samples_per_s", "samples_per_step", "skipped_steps"):
        return f"{v:,.0f}"
    if col == "final_loss_scale":
        return f"{v:,.0f}" if v >= 1 and v == int(v) else f"{v:g}"
    if col == "metric_vs_O0":
        return f"{v:+.3f}"
    if col == "output_diff_vs_O0":
        return f"{v:.1e}" if v and abs(v) < 1e-3 else f"{v:.3f}"
    if abs(v) >= 1000:
        return f"{v:,.0f}"
    return f"{v:.3g}"


def warnings_banner(df: pd.DataFrame) -> list[str]:
    """Each distinct warning of the rows once, naming the configurations it concerns."""
    seen: dict[str, list[str]] = {}
    for r in df.itertuples():
        for w in split_warnings(r.warnings):
            seen.setdefault(w, []).append(str(r.configuration))
    n = len(df)
    return [
        f"{w} ({'all configurations' if len(c) == n and n > 1 else ', '.join(c)})"
        for w, c in seen.items()
    ]


def results_table(df: pd.DataFrame, classes: str = "rows") -> str:
    """The results as an HTML table: readable headers with units, formatted numbers.

    Failed rows say ``failed`` in their status and keep a one-line error; the full messages
    and every warning are listed once, outside the table (compact rows).
    """
    cols = [c for c in TABLE_COLUMNS if c in df.columns]
    head = "".join(f"<th>{html.escape(TABLE_COLUMNS[c])}</th>" for c in cols)
    rows = []
    for _, r in df.iterrows():
        cells = []
        for c in cols:
            text = format_value(c, r[c])
            if c == "error" and len(text) > 80:
                text = text[:77] + "..."
            cells.append(f"<td>{html.escape(text)}</td>")
        rows.append("<tr>" + "".join(cells) + "</tr>")
    return (
        f"<div style='overflow-x:auto'><table class='{classes}'><thead><tr>{head}</tr></thead>"
        f"<tbody>{''.join(rows)}</tbody></table></div>"
    )


def glossary_html(names=None) -> str:
    """What each configuration is: :data:`mpnb.core.precision.PRECISION_CONFIGS` descriptions.

    Args:
        names: the configurations to list first (those in the report); every other
            configuration follows.
    """
    from mpnb.core.precision import PRECISION_CONFIGS

    first = [n for n in dict.fromkeys(names or ()) if n in PRECISION_CONFIGS]
    order = first + [n for n in PRECISION_CONFIGS if n not in first]
    items = "".join(
        f"<dt><b>{html.escape(n)}</b></dt><dd>{html.escape(PRECISION_CONFIGS[n].description)}</dd>"
        for n in order
    )
    return f"<dl class='glossary'>{items}</dl>"


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
    for i, (cfg, h) in enumerate(hist.groupby("configuration", sort=False)):
        fig.add_trace(go.Scatter(x=h.step, y=h[column], name=str(cfg), **curve_style(i)))
    return _layout(fig, name, yaxis_type="log" if log else "linear")


_DASHES = ("solid", "dash", "dot", "dashdot", "longdash", "longdashdot")
_SYMBOLS = ("circle", "square", "diamond", "triangle-up", "cross", "star")


def curve_style(i: int) -> dict:
    """The ``i``-th curve's markers and dashes: overlapping curves stay distinguishable."""
    return dict(
        mode="lines+markers",
        marker=dict(size=6, symbol=_SYMBOLS[i % len(_SYMBOLS)]),
        line=dict(dash=_DASHES[i % len(_DASHES)], width=2),
    )


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
    table = results_table(df)
    notes = warnings_banner(df) if "warnings" in df.columns else []
    banner = (
        "<div class='warnings'><b>Warnings</b><ul>"
        + "".join(f"<li>{html.escape(n)}</li>" for n in notes)
        + "</ul></div>"
        if notes
        else ""
    )
    bad = df[df["error"].fillna("") != ""]
    failures = "".join(
        f"<li><b>{html.escape(str(r.configuration))}</b>: {html.escape(str(r.error))}</li>"
        for r in bad.itertuples()
    )
    failures = f"<h2>Failures</h2><ul>{failures}</ul>" if failures else ""
    names = list(df["opt_level"]) if "opt_level" in df.columns else []
    page = f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:1200px}}
table.rows{{border-collapse:collapse;font-size:12px}}
table.rows td,table.rows th{{padding:3px 6px;border-bottom:1px solid #ddd;white-space:nowrap}}
.warnings{{border-left:4px solid #a05a00;background:#fff8ec;padding:4px 12px;margin:1em 0}}
dl.glossary dt{{float:left;clear:left;width:9em}} dl.glossary dd{{margin:0 0 4px 9.5em}}</style>
<script type="text/javascript">{get_plotlyjs()}</script></head>
<body><h1>{html.escape(title)}: {html.escape(str(df.workload.iloc[0]) if len(df) else "")}</h1>
<h2>Verdict</h2>{_verdict_html(df)}
<h2>Hardware</h2>{_hardware_html(df)}
<h2>Results</h2>{banner}{table}{failures}
<h2>Charts</h2>{charts}
<h2>Glossary: the configurations</h2>{glossary_html(names)}
</body></html>"""
    from mpnb.lab._files import write_atomic  # whole or not at all: the old report survives

    return write_atomic(path, page)
