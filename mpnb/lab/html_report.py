"""``report``: one self-contained HTML page from a ``compare`` DataFrame (works offline).

The page inlines plotly.js once (``plotly.offline.get_plotlyjs()``) and draws only what the
DataFrame holds: the verdict, speed (the ``speedup_vs_O0`` figure, its interval and its
``speed_label``), memory breakdown, quality metric, loss curves and loss scale per step
(from ``df.attrs["history"]``), the hardware summary, the table and each row's ``snippet``
(the lines to train that way in your own loop, as copyable code). Nothing is measured here.
"""

from __future__ import annotations

import html
import math
import textwrap
from pathlib import Path

import pandas as pd

from mpnb.lab._files import check_writable, write_atomic
from mpnb.lab._report_table import (
    TABLE_COLUMNS,
    TABLE_GROUPS,
    drawn_rows,
    format_value,
    results_table,
    snippets_html,
    speed_note,
    status_text,
    warnings_banner,
)
from mpnb.lab.memory import ROLES

__all__ = [
    "report",
    "figures",
    "speed_bar",
    "speed_labels",
    "chart_title",
    "results_table",
    "speed_note",
    "status_text",
    "drawn_rows",
    "warnings_banner",
    "snippets_html",
    "glossary_html",
    "missing_metric",
    "format_value",
    "run_line",
    "curve_style",
    "CHARTS",
    "CHART_TEXT",
    "TABLE_COLUMNS",
    "TABLE_GROUPS",
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
        "How to read: bars of equal height mean mixed precision cost no accuracy.",
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


def glossary_html(names=None) -> str:
    """What each configuration is: its
    :data:`mpnb.core.precision_configs.PRECISION_CONFIGS` description.

    Args:
        names: the configurations to list first (those in the report); every other
            configuration follows.
    """
    from mpnb.core.precision_configs import PRECISION_CONFIGS, get_config

    first = {}
    for n in dict.fromkeys(names or ()):
        try:  # a name with a keep-list ("nvfp4:keep-last=2") is described with it
            first[n] = get_config(n).description
        except (ValueError, KeyError):
            continue  # not a configuration's name (a row label of the user's own)
    every = {**first, **{n: c.description for n, c in PRECISION_CONFIGS.items() if n not in first}}
    items = "".join(
        f"<dt><b>{html.escape(n)}</b></dt><dd>{html.escape(d)}</dd>" for n, d in every.items()
    )
    return f"<dl class='glossary'>{items}</dl>"


_ok = drawn_rows


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
    """The speed bar's data from ``df``: x, y (speed-up), asymmetric whiskers, labels, and
    where each label sits (``label_y``: the top of its whisker, so no whisker crosses it) and
    the y range that keeps the labels inside the plot (``y_max``).

    The widget and the report both draw exactly this.
    """
    ok = _ok(df)
    y = [float(v) for v in ok["speedup_vs_O0"]]
    lo = [float(v) for v in ok["speedup_lo"]]
    hi = [float(v) for v in ok["speedup_hi"]]
    tops = [
        max(v, h) if math.isfinite(h) else v for v, h in zip(y, hi, strict=True) if math.isfinite(v)
    ]
    return dict(
        x=list(ok["configuration"]),
        y=y,
        plus=[max(h - v, 0.0) if math.isfinite(h) else 0.0 for v, h in zip(y, hi, strict=True)],
        minus=[max(v - a, 0.0) if math.isfinite(a) else 0.0 for v, a in zip(y, lo, strict=True)],
        text=list(ok["speed_label"]),
        label_y=[max(v, h) if math.isfinite(h) else v for v, h in zip(y, hi, strict=True)],
        y_max=1.25 * max([1.0, *tops]),
    )


def speed_labels(d: dict) -> list[dict]:
    """The speed labels as plotly annotations above each whisker (never across one)."""
    return [
        dict(x=x, y=y, text=html.escape(t), showarrow=False, yanchor="bottom", yshift=3)
        for x, y, t in zip(d["x"], d["label_y"], d["text"], strict=True)
        if math.isfinite(y)
    ]


def _speed(go, df):
    d = speed_bar(df)
    fig = go.Figure(
        go.Bar(
            x=d["x"],
            y=d["y"],
            error_y=dict(type="data", symmetric=False, array=d["plus"], arrayminus=d["minus"]),
            text=d["text"],
            textposition="none",  # shown as annotations above the whiskers instead
        )
    )
    fig.add_hline(y=1.0, line_dash="dash", line_color="gray")
    _layout(fig, "speed")
    fig.update_layout(annotations=speed_labels(d), yaxis_range=[0, d["y_max"]])
    return fig


def _memory(go, df):
    ok = _ok(df)
    fig = go.Figure(
        [go.Bar(name=r.replace("_", " "), x=ok.configuration, y=ok[f"mem_{r}_mib"]) for r in ROLES]
    )
    return _layout(fig, "memory", barmode="stack")


def missing_metric(df: pd.DataFrame) -> str:
    """Why the accuracy chart has nothing to draw ("" when some row has a metric).

    Example::

        >>> missing_metric(stopped_df)
        'No held-out metric: the run was interrupted before the evaluation ...'
    """
    ok = _ok(df)
    if len(ok) and ok["metric"].notna().any():
        return ""
    if len(df) and str(df["metric_name"].iloc[0]) == "-":
        return (
            "No metric: this workload has no metric_fn (pass metric_fn=mpnb.lab.accuracy, or "
            "a function of your own, to measure held-out quality)."
        )
    if len(df) and "status" in df and (df["status"] == "interrupted").any():
        return (
            "No held-out metric: the run was interrupted before the evaluation (it runs after "
            "the last step); the training loss chart shows the steps that ran."
        )
    return "No metric was measured (every configuration failed)."


def _accuracy(go, df):
    ok = _ok(df)
    name = str(df.metric_name.iloc[0]) if len(df) else "metric"
    fig = go.Figure(
        go.Bar(
            x=ok.configuration,
            y=ok.metric,
            text=[format_value("metric", m) for m in ok.metric],
            textposition="outside",
        )
    )
    _layout(fig, "accuracy")
    fig.update_layout(yaxis_title=f"{name} (0-1, higher is better)")
    why = missing_metric(df)
    if why:
        fig.add_annotation(
            text="<br>".join(textwrap.wrap(html.escape(why), 80)),
            xref="paper",
            yref="paper",
            x=0.5,
            y=0.5,
            showarrow=False,
        )
    chance = df.attrs.get("workload", {}).get("chance")
    if chance:
        fig.add_hline(
            y=chance, line_dash="dash", line_color="gray", annotation_text="chance (random guess)"
        )
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


def run_line(df: pd.DataFrame) -> str:
    """What ran, from the rows: the workload, batch sizes and the steps asked (and done).

    Example::

        >>> run_line(df)
        'MLP (hidden 128) on 8x8 digits (small); batch 64; 6 steps per configuration'
    """
    if not len(df):
        return ""
    wl = df.attrs.get("workload", {})
    what = wl.get("description") or str(df["workload"].iloc[0])
    size = f" ({wl['size']})" if wl.get("size") else ""
    sizes = ", ".join(str(int(b)) for b in dict.fromkeys(df["batch_size"]))
    steps = ", ".join(str(int(n)) for n in dict.fromkeys(df["steps"]))
    line = f"{what}{size}; batch {sizes}; {steps} steps per configuration"
    if df.attrs.get("stopped"):
        line += f" (stopped by {df.attrs.get('stopped_by') or 'Stop'}: see each row's status)"
    return line


def report(df: pd.DataFrame, path: str | Path, title: str = "mpnb compare") -> Path:
    """Write ``df`` (from :func:`mpnb.lab.compare`) as one self-contained HTML page.

    Args:
        df: the DataFrame ``compare`` returned (with its ``attrs``).
        path: where to write: a file in an existing, writable directory (checked first,
            before the page is built).
        title: the page title.

    Returns:
        The path written.

    Raises:
        ValueError: ``path`` cannot be written (a directory, a missing or read-only
            directory), naming it; or ``df`` is not what ``compare`` returned.
        OSError: the write failed part-way (a full disk); the previous file is kept.

    Example::

        >>> mpnb.lab.report(mpnb.lab.compare("mlp", steps=60), "report.html")
    """
    check_writable(path, "report: path")  # before any work: the message names the path
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
    table = results_table(df) + f"<p class='note'>{html.escape(speed_note(df))}</p>"
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
    code = snippets_html(df)
    if code:
        code = f"<section id='snippets'><h2>Train this way in your own loop</h2>{code}</section>"
    names = list(df["opt_level"]) if "opt_level" in df.columns else []
    page = f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:1200px}}
table.rows{{border-collapse:collapse;font-size:12px}}
table.rows td,table.rows th{{padding:3px 6px;border-bottom:1px solid #ddd;white-space:nowrap}}
table.rows th{{white-space:normal;vertical-align:bottom}} p.note{{font-size:13px;color:#444}}
.warnings{{border-left:4px solid #a05a00;background:#fff8ec;padding:4px 12px;margin:1em 0}}
div.snippet pre{{background:#f6f8fa;padding:8px;border:1px solid #ddd;overflow-x:auto}}
dl.glossary dt{{float:left;clear:left;width:9em}} dl.glossary dd{{margin:0 0 4px 9.5em}}</style>
<script type="text/javascript">{get_plotlyjs()}</script></head>
<body><h1>{html.escape(title)}: {html.escape(str(df.workload.iloc[0]) if len(df) else "")}</h1>
<p class="run">{html.escape(run_line(df))}</p>
<h2>Verdict</h2>{_verdict_html(df)}
<h2>Hardware</h2>{_hardware_html(df)}
<section id="results"><h2>Results</h2>{banner}{table}{failures}</section>
{code}
<h2>Charts</h2>{charts}
<h2>Glossary: the configurations</h2>{glossary_html(names)}
</body></html>"""
    return write_atomic(path, page)  # whole or not at all: the old report survives
