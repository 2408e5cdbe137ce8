"""The result views of :class:`~mpnb.widgets.CompareWidget` for a run on several ranks.

They draw the distributed columns of ``mpnb.lab.compare(..., ranks=N)`` (one row per policy;
see ``mpnb.lab.distributed.DIST_COLUMNS``): memory per rank by role, bytes on the wire per
step by collective, the loss against the single-process fp32 run with its tolerance, the table,
and the scale-out ESTIMATE of :func:`mpnb.lab.distributed.estimate.scale_estimate`. Nothing is
measured here.
"""

from __future__ import annotations

import html
import math
import textwrap

import pandas as pd
import plotly.graph_objects as go

from mpnb.widgets._common import FigureOutput

__all__ = ["DIST_MEMORY_ROLES", "DistributedViews", "dist_table_html", "dist_verdict_html"]

#: the per-rank memory roles of the distributed rows (``mem_<role>_mib``), bottom to top
DIST_MEMORY_ROLES = (
    "sharded_params",
    "unsharded_params",
    "grads",
    "optimizer",
    "activations",
)
#: the columns the distributed table shows, in order, with their headers (units included)
TABLE_COLUMNS = {
    "policy": "policy",
    "strategy": "strategy",
    "param_dtype": "param dtype",
    "reduce_dtype": "reduce dtype",
    "mem_sharded_params_mib": "sharded params (MiB/rank)",
    "mem_unsharded_params_mib": "unsharded params (MiB/rank)",
    "mem_grads_mib": "grads (MiB/rank)",
    "mem_optimizer_mib": "optimizer (MiB/rank)",
    "mem_activations_mib": "activations (MiB/rank)",
    "mem_peak_mib": "peak (MiB/rank)",
    "bytes_sent_per_step": "sent (bytes/step/rank)",
    "bytes_recv_per_step": "received (bytes/step/rank)",
    "step_ms": "step (ms)",
    "loss_final": "final loss",
    "loss_vs_fp32": "loss vs 1-process fp32 (max |diff|)",
    "tolerance": "tolerance",
    "within_tolerance": "within tolerance",
    "status": "status",
}
CHARTS = {
    "memory": (
        "Memory per rank by role",
        "policy",
        "memory per rank (MiB, the largest rank)",
        "How to read: FSDP2 keeps about 1/N of the parameters and optimizer state on each rank "
        "(sharded params) and gathers the rest only while a layer runs (unsharded params).",
    ),
    "wire": (
        "Bytes on the wire per step, by collective",
        "policy",
        "bytes sent per rank per step",
        "How to read: DDP all-reduces the gradients; FSDP2 all-gathers parameters and "
        "reduce-scatters gradients; a bf16 reduction halves the reduced bytes.",
    ),
    "loss": (
        "Loss against single-process fp32 on the same global batch",
        "policy",
        "max |loss - fp32 loss| over the curve",
        "How to read: a bar under its tolerance marker trained like one fp32 process; "
        "lower precision on the wire or in the parameters moves the curve a little.",
    ),
}


def _title(name: str) -> str:
    title, _, _, how = CHARTS[name]
    lines = "<br>".join(html.escape(line) for line in textwrap.wrap(how, 90))
    return f"{title}<br><sup>{lines}</sup>"


def _fig(name: str, **layout) -> go.Figure:
    _, x, y, _ = CHARTS[name]
    return go.Figure(
        layout=go.Layout(
            title=_title(name),
            height=400,
            margin=dict(t=110, b=50, l=80, r=20),
            xaxis=dict(title=x),
            yaxis=dict(title=y),
            **layout,
        )
    )


def _num(v) -> float:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return 0.0
    return 0.0 if math.isnan(f) else f


def _ok(df: pd.DataFrame) -> pd.DataFrame:
    # a failed, hung or skipped policy has no whole step to draw (its error is listed)
    return df[df["status"] == "ok"] if "status" in df.columns else df


class DistributedViews:
    """The figures of a run on several ranks; :meth:`update` redraws them from a frame.

    Attributes:
        memory, wire, loss: plotly ``Figure`` s (tests read their traces).
        outputs: ``{"memory", "wire", "loss"}`` -> :class:`~mpnb.widgets._common.FigureOutput`.
    """

    NAMES = ("memory", "wire", "loss")

    def __init__(self):
        self.memory = _fig("memory", barmode="stack")
        for role in DIST_MEMORY_ROLES:
            self.memory.add_bar(x=[], y=[], name=role.replace("_", " "))
        self.wire = _fig("wire", barmode="stack")
        self.loss = _fig("loss")
        self.loss.add_bar(x=[], y=[], name="loss vs fp32", text=[], textposition="outside")
        self.loss.add_scatter(
            x=[],
            y=[],
            name="tolerance",
            mode="markers",
            marker=dict(symbol="line-ew-open", size=30),
        )
        hint = "set ranks to 2 or more and press Run"
        self.outputs = {
            n: FigureOutput(getattr(self, n), CHARTS[n][0], hint, min_height="420px")
            for n in self.NAMES
        }

    def clear(self) -> None:
        """Show the placeholders again before a new run."""
        for out in self.outputs.values():
            out.placeholder()

    def update(self, df: pd.DataFrame) -> None:
        """Redraw the figures from the rows of a distributed comparison."""
        ok = _ok(df)
        names = list(ok["policy"])
        with self.memory.batch_update():
            for tr, role in zip(self.memory.data, DIST_MEMORY_ROLES, strict=True):
                col = f"mem_{role}_mib"
                tr.x = names
                tr.y = [_num(v) for v in ok[col]] if col in ok.columns else [0.0] * len(ok)
        self._wire(ok, names)
        with self.loss.batch_update():
            bar, tol = self.loss.data
            bar.x, bar.y = names, [_num(v) for v in ok["loss_vs_fp32"]]
            bar.text = [f"{_num(v):.2g}" for v in ok["loss_vs_fp32"]]
            tol.x, tol.y = names, [_num(v) for v in ok["tolerance"]]
        for out in self.outputs.values():
            out.render()

    def _wire(self, ok: pd.DataFrame, names: list[str]) -> None:
        by_op = [r if isinstance(r, dict) else {} for r in ok["bytes_by_op"]]
        ops = list(dict.fromkeys(op for r in by_op for op in r))
        with self.wire.batch_update():
            self.wire.data = ()
            for op in ops:
                self.wire.add_bar(x=names, y=[float(r.get(op, 0)) for r in by_op], name=op)


def _cell(v) -> str:
    if isinstance(v, float):
        return "" if math.isnan(v) else f"{v:.4g}"
    if isinstance(v, (int,)) and not isinstance(v, bool) and abs(v) >= 10_000:
        return f"{v:,}"
    return html.escape(str(v))


def dist_table_html(df: pd.DataFrame) -> str:
    """The distributed rows as an HTML table (per-rank figures, headers with units)."""
    cols = [c for c in TABLE_COLUMNS if c in df.columns]
    head = "".join(f"<th>{html.escape(TABLE_COLUMNS[c])}</th>" for c in cols)
    body = "".join(
        "<tr>" + "".join(f"<td>{_cell(r[c])}</td>" for c in cols) + "</tr>"
        for r in df.to_dict("records")
    )
    meta = df.attrs.get("distributed", {})
    note = (
        f"<p style='font-size:12px;color:#444'>{meta.get('ranks', '?')} ranks, global batch "
        f"{meta.get('global_batch', '?')}; memory is the largest rank's, bytes the mean over "
        "ranks.</p>"
    )
    return (
        note + "<table class='mpnb-table mpnb-dist-table' style='font-size:12px'>"
        f"<tr>{head}</tr>{body}</table>"
    )


def dist_verdict_html(df: pd.DataFrame) -> str:
    """The verdict box for a distributed run: least memory per rank, fewest bytes on the
    wire, and which policies stayed within the loss tolerance (all from the rows)."""
    ok = _ok(df)
    lines = []
    if len(ok):
        least = ok.loc[ok["mem_peak_mib"].astype(float).idxmin()]
        fewest = ok.loc[ok["bytes_sent_per_step"].astype(float).idxmin()]
        lines.append(f"Least memory per rank: {least['policy']}, {least['mem_peak_mib']:.1f} MiB.")
        lines.append(
            f"Fewest bytes on the wire: {fewest['policy']}, "
            f"{int(fewest['bytes_sent_per_step']):,} bytes sent per rank per step."
        )
        within = ok[ok["within_tolerance"].astype(bool)]
        outside = [p for p in ok["policy"] if p not in set(within["policy"])]
        lines.append(
            f"Within the loss tolerance of single-process fp32: {len(within)} of {len(ok)}"
            + (f" (not: {', '.join(outside)})" if outside else "")
            + "."
        )
    ranks = df.attrs.get("distributed", {}).get("ranks", "?")
    items = "".join(f"<li>{html.escape(line)}</li>" for line in lines)
    return (
        "<div class='mpnb-verdict' style='border-left:4px solid #1f77b4;padding:4px 10px;"
        f"background:#f4f8fc'><b>Precision policies on {html.escape(str(ranks))} ranks</b>"
        f"<ul style='margin:4px 0'>{items}</ul></div>"
    )


def dist_errors_html(df: pd.DataFrame) -> str:
    """One red line per policy that failed (its rank and error as the row says); empty if none."""
    if "error" not in df.columns:
        return ""
    bad = df[df["error"].fillna("").astype(str) != ""]
    return "".join(
        f"<div style='color:#b00020'><b>{html.escape(str(r['policy']))}</b> failed: "
        f"{html.escape(str(r['error']))}</div>"
        for r in bad.to_dict("records")
    )


def estimate_html(df: pd.DataFrame) -> str:
    """The scale-out ESTIMATE of the rows: per policy and interconnect, the number of GPUs
    from which communication exceeds compute, under its label and the figures it assumed."""
    # the scaling estimate when the ranks view opens: +700 ms to importing the widgets
    from mpnb.lab.distributed.estimate import crossovers, scale_estimate

    est = scale_estimate(df)
    if est.empty:
        return "<i>No policy finished: nothing to scale.</i>"
    table = crossovers(est).astype("object").where(lambda t: t.notna(), "not within reach")
    links = est.attrs["assumptions"]["interconnects"]
    figures = "; ".join(
        f"{name}: {v['gbytes_s']:g} GB/s per GPU and direction, {v['hop_us']:g} us per hop"
        for name, v in links.items()
    )
    return (
        "<div class='mpnb-estimate' style='border-left:4px solid #a05a00;padding:4px 10px;"
        f"background:#fff8ec;font-size:12px'><b>{html.escape(est.attrs['label'])}</b><br>"
        "Number of GPUs from which communication time exceeds compute time per step:</div>"
        + table.to_html(classes="mpnb-table mpnb-estimate-table", border=0)
        + f"<p style='font-size:12px;color:#444'>{html.escape(figures)}.</p>"
    )


def dist_page_html(df: pd.DataFrame, views: DistributedViews, title: str) -> str:
    """One self-contained HTML page of a distributed run: the verdict, the three figures (with
    plotly inlined once), the table and the scale-out estimate."""
    figs = "".join(
        getattr(views, name).to_html(full_html=False, include_plotlyjs=(i == 0))
        for i, name in enumerate(views.NAMES)
    )
    return (
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        f"</head><body><h1>{html.escape(title)}</h1>{dist_verdict_html(df)}{figs}"
        f"{dist_table_html(df)}{dist_errors_html(df)}<h2>Scale-out estimate</h2>"
        f"{estimate_html(df)}</body></html>"
    )
