"""The results tables of the report and the widget: which columns, how each value reads, how
the step times relate to the speed figure, and each row's snippet as copyable code. Nothing is
measured here."""

from __future__ import annotations

import html
import math

import pandas as pd

from mpnb.core.precision_configs import BASELINE
from mpnb.lab._rows import split_warnings

__all__ = [
    "TABLE_COLUMNS",
    "TABLE_GROUPS",
    "format_value",
    "warnings_banner",
    "status_text",
    "results_table",
    "speed_note",
    "drawn_rows",
    "snippets_html",
]


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
    "compile_s": "compile time (s, apart from the steps)",
    "host_syncs_per_step": "host syncs per step",
    "gpu_busy": "GPU busy (share of the step)",
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

#: columns a table shows only when some row has a value (only a compiling row has a compile time)
WHEN_SET = ("compile_s", "gpu_busy")

#: the results as two tables that each fit a page (or a notebook) without sideways scrolling:
#: what it cost (speed, memory) and what it did (loss, metric, numerics). The 95% interval is
#: shown beside the speed-up, in its cell.
TABLE_GROUPS = {
    "Speed and memory": (
        "configuration",
        "precision",
        "status",
        "speed_label",
        "speedup_vs_O0",
        "step_time_ms",
        "compile_s",
        "host_syncs_per_step",
        "gpu_busy",
        "samples_per_s",
        "peak_mem_mib",
        "mem_saving_vs_O0",
    ),
    "Accuracy and numerics": (
        "configuration",
        "final_loss",
        "metric",
        "metric_vs_O0",
        "output_diff_vs_O0",
        "skipped_steps",
        "final_loss_scale",
        "error",
    ),
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
    if col in ("samples_per_s", "samples_per_step", "skipped_steps", "host_syncs_per_step"):
        return f"{v:,.0f}"
    if col == "final_loss_scale":
        return f"{v:,.0f}" if v >= 1 and v == int(v) else f"{v:g}"
    if col == "compile_s":
        return f"{v:.1f}"
    if col == "gpu_busy":
        return f"{v:.0%}"
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


def status_text(row) -> str:
    """A row's status as a reader wants it: ``ok``, ``failed``, ``interrupted at 22 of 400
    steps`` or ``not started`` (Stop or Ctrl-C came first)."""
    status = str(row.get("status", "") or "")
    done = row.get("steps_done")
    if status == "error":
        return "failed"
    if status != "interrupted" or done is None or done != done:  # NaN: an older frame
        return status or "-"
    if int(done) == 0:
        return "not started"
    return f"interrupted at {int(done)} of {int(row['steps'])} steps"


def _cell(c: str, r) -> str:
    if c == "status":
        return status_text(r)
    text = format_value(c, r[c])
    if c == "speedup_vs_O0" and "speedup_lo" in r and format_value(c, r["speedup_lo"]) != "-":
        lo, hi = format_value(c, r["speedup_lo"]), format_value(c, r["speedup_hi"])
        text = f"{text} [{lo}-{hi}]"
    if c == "error" and len(text) > 80:
        text = text[:77] + "..."
    return text


def _header(c: str) -> str:
    if c == "speedup_vs_O0":
        return "speed-up (x O0) [95% interval]"
    return TABLE_COLUMNS[c]


def results_table(df: pd.DataFrame, classes: str = "rows") -> str:
    """The results as HTML tables (:data:`TABLE_GROUPS`): readable headers with units,
    formatted numbers, each table narrow enough to read without scrolling sideways.

    Failed rows say ``failed`` in their status and keep a one-line error; interrupted rows say
    where they stopped; the full messages and every warning are listed once, outside.
    """
    out = []
    for title, group in TABLE_GROUPS.items():
        cols = [c for c in group if c in df.columns and (c not in WHEN_SET or df[c].notna().any())]
        head = "".join(f"<th>{html.escape(_header(c))}</th>" for c in cols)
        rows = "".join(
            "<tr>" + "".join(f"<td>{html.escape(_cell(c, r))}</td>" for c in cols) + "</tr>"
            for _, r in df.iterrows()
        )
        out.append(
            f"<div style='overflow-x:auto;margin-bottom:8px'><table class='{classes}'>"
            f"<caption style='text-align:left;font-weight:bold'>{html.escape(title)}</caption>"
            f"<thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table></div>"
        )
    return "".join(out)


def speed_note(df: pd.DataFrame) -> str:
    """How the table's step times relate to the speed figure, and each row where they disagree.

    The speed figure is the median of per-round ratios (each configuration's step against
    O0's step in the same round); a step time is one configuration's own median. On a quiet
    machine ``O0's step time / the configuration's`` lands inside the figure's interval; when
    the load changes between rounds it may not, and the note names those rows with both
    readings.

    Example::

        >>> speed_note(df)
        'Speed vs O0 is the median of the per-round ratios ...'
    """
    note = (
        "Speed vs O0 is the median of the per-round ratios (O0's step time divided by the "
        "configuration's, measured in the same round); a step time is the configuration's own "
        "median over its timed steps. On a quiet machine the two readings agree."
    )
    worse = []
    rows = drawn_rows(df)
    for _, r in rows.iterrows():
        base = rows[(rows["opt_level"] == BASELINE) & (rows["batch_size"] == r["batch_size"])]
        if r["opt_level"] == BASELINE or base.empty:
            continue
        t0, t = float(base["step_time_ms"].iloc[0]), float(r["step_time_ms"])
        fig, lo, hi = (float(r[c]) for c in ("speedup_vs_O0", "speedup_lo", "speedup_hi"))
        if not (t > 0 and t0 > 0 and math.isfinite(fig)):
            continue
        ratio = t0 / t
        inside = lo <= ratio <= hi if math.isfinite(lo) and math.isfinite(hi) else True
        if not inside:
            worse.append(
                f"{r['configuration']}: its step time gives {ratio:.2f}x "
                f"({format_value('step_time_ms', t0)} / {format_value('step_time_ms', t)} ms), "
                f"the rounds {fig:.2f}x"
            )
    if worse:
        note += (
            " Here they disagree: " + "; ".join(worse) + ". The machine's load changed between "
            "rounds; the per-round figure compares steps run at the same moment, so it is the "
            "one to read."
        )
    return note


def drawn_rows(df: pd.DataFrame) -> pd.DataFrame:
    """The rows the charts draw: every configuration that ran at least one step and did not
    fail (a configuration Stop came before has nothing to draw)."""
    ok = df[df["error"].fillna("") == ""]
    if "steps_done" in ok:
        ok = ok[ok["steps_done"].fillna(1) > 0]
    return ok


def snippets_html(df: pd.DataFrame, classes: str = "snippet") -> str:
    """Each row's ``snippet`` (the lines to train its way in your own loop) as a ``<pre>``
    block under the rows it serves (rows that differ only in batch size share one), so the
    comparison ends in code to copy; ``""`` when the frame has none."""
    if "snippet" not in df.columns:
        return ""
    shared: dict[str, list[str]] = {}
    for r in df.itertuples():
        if isinstance(r.snippet, str) and r.snippet:
            shared.setdefault(r.snippet, []).append(str(r.configuration))
    blocks = "".join(
        f"<div class='{classes}'><b>{html.escape(', '.join(names))}</b>"
        f"<pre><code>{html.escape(code)}</code></pre></div>"
        for code, names in shared.items()
    )
    return blocks and (
        "<p class='note'>The lines each row trains with, to copy into your own loop ("
        "<code>model</code>, <code>batches</code> and <code>loss_fn</code> are yours).</p>" + blocks
    )
