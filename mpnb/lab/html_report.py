"""``report``: one self-contained HTML page from a ``compare`` DataFrame (works offline).

The page inlines plotly.js once (``plotly.offline.get_plotlyjs()``) and draws only what the
DataFrame holds: speed, memory breakdown, quality metric, loss curves and loss scale per
step (from ``df.attrs["history"]``), the hardware summary and the table. Nothing is
measured here.
"""

from __future__ import annotations

import html
import math
from pathlib import Path

import pandas as pd

from mpnb.lab.memory import ROLES

__all__ = ["report", "figures", "CHARTS"]

CHARTS = ("speed", "memory", "accuracy", "loss", "loss_scale")

_TABLE_COLS = (
    "configuration",
    "precision",
    "step_time_ms",
    "step_time_iqr_ms",
    "samples_per_s",
    "speedup_vs_O0",
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


def _speed(go, df):
    ok = _ok(df)
    fig = go.Figure(
        go.Bar(
            x=ok.configuration,
            y=ok.step_time_ms,
            error_y=dict(type="data", array=(ok.step_time_iqr_ms / 2).tolist()),
            text=[f"{s:.2f}x vs O0" if not math.isnan(s) else "" for s in ok.speedup_vs_O0],
            textposition="outside",
        )
    )
    fig.update_layout(
        title="Step time (median; error bar: IQR/2). Lower is faster", yaxis_title="ms per step"
    )
    return fig


def _memory(go, df):
    ok = _ok(df)
    fig = go.Figure(
        [go.Bar(name=r.replace("_", " "), x=ok.configuration, y=ok[f"mem_{r}_mib"]) for r in ROLES]
    )
    fig.update_layout(barmode="stack", title="Peak tensor memory by role", yaxis_title="MiB")
    return fig


def _accuracy(go, df):
    ok = _ok(df)
    name = str(df.metric_name.iloc[0]) if len(df) else "metric"
    fig = go.Figure(
        go.Bar(
            x=ok.configuration,
            y=ok.metric,
            text=[f"{m:.4f}" for m in ok.metric],
            textposition="outside",
        )
    )
    fig.update_layout(title=f"Held-out {name}", yaxis_title=name)
    return fig


def _history_lines(go, df, column: str, title: str, log: bool):
    hist = df.attrs.get("history", pd.DataFrame(columns=["configuration", "step", column]))
    fig = go.Figure()
    for cfg, h in hist.groupby("configuration", sort=False):
        fig.add_trace(go.Scatter(x=h.step, y=h[column], mode="lines", name=str(cfg)))
    fig.update_layout(title=title, xaxis_title="step", yaxis_type="log" if log else "linear")
    return fig


def figures(df: pd.DataFrame) -> dict:
    """The report's plotly figures by name (:data:`CHARTS`), e.g. for a notebook to show."""
    import plotly.graph_objects as go

    return {
        "speed": _speed(go, df),
        "memory": _memory(go, df),
        "accuracy": _accuracy(go, df),
        "loss": _history_lines(go, df, "loss", "Training loss per step", log=False),
        "loss_scale": _history_lines(
            go, df, "loss_scale", "Loss scale per step (drops mark skipped steps)", log=True
        ),
    }


def _hardware_html(df: pd.DataFrame) -> str:
    hw = df.attrs.get("hardware", {})
    items = "".join(
        f"<li><b>{html.escape(str(k))}</b>: {html.escape(str(v))}</li>"
        for k, v in hw.items()
        if k != "summary"
    )
    method = html.escape(str(df.attrs.get("method", "")))
    return (
        f"<p>{html.escape(str(hw.get('summary', '')))}</p><ul>{items}</ul>"
        f"<p>Timing: {method}; medians of per-step times after warm-up "
        "(torch.utils.benchmark.timer); speed-up = median of per-step ratios vs O0.</p>"
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
<h2>Hardware</h2>{_hardware_html(df)}
<h2>Results</h2>{table}
<h2>Charts</h2>{charts}
</body></html>"""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page, encoding="utf-8")
    return out
