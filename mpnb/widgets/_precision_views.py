"""The pictures of the profile widget's Precision tab: a trace or statistics in, a figure out.

Two maps sit above the Precision tab's tables:

* the **module x phase map** of a :func:`mpnb.lab.trace_precision` trace
  (:func:`module_phase_map`, drawn by :func:`module_phase_figure`): one cell per module and
  phase, coloured by the number format its ops ran in, with its share of the step's FLOPs
  and bytes;
* the **statistics map** of a :func:`mpnb.lab.quant_stats` result (:func:`stats_figure`):
  layers x tensors (input, weight, grad_output), coloured by one of the statistics.

The data -> matrix steps are plain functions, tested without a browser. Formats come from
:mod:`mpnb.core.number_formats` (:func:`~mpnb.core.number_formats.format_of`): nothing here
reads a dtype's name. The ops of an mpnb.fp8 layer (``reason == "fp8-recipe"``: scaling,
quantization, the GEMM and the dequantization) ran for the configuration's scaled format
(NVFP4 even where the emulated GEMM multiplies in float32), so they count in that format.

Example::

    >>> trace = mpnb.lab.trace_precision(model, x, "nvfp4")
    >>> m = module_phase_map(trace.ops, scaled_format("nvfp4"))
    >>> m.matrix("format")                # [module][phase] -> "nvfp4", "fp32", ... or None
    >>> module_phase_figure(m, "nvfp4").show()
"""

from __future__ import annotations

import html
import math
from dataclasses import dataclass

import ipywidgets as w
import pandas as pd
import plotly.graph_objects as go

from mpnb.core.fp8.stats import METRICS
from mpnb.core.number_formats import FORMATS, NumberFormat, format_of
from mpnb.core.precision_configs import PRECISION_CONFIGS, get_config
from mpnb.widgets._common import FigureOutput

__all__ = [
    "PrecisionPictures",
    "PHASES",
    "OTHER",
    "ModulePhaseMap",
    "module_phase_map",
    "module_phase_figure",
    "stats_figure",
    "stats_title",
    "metric_label",
    "ops_table",
    "op_formats",
    "format_color",
    "worst_html",
    "scaled_format",
    "what_if_choices",
    "default_what_if",
]

#: the phases of a trace, in the order they run (columns of the map)
PHASES = ("forward", "loss", "backward", "loss-scaling")
#: the "format" of ops on no floating data (indices, masks, bit packing)
OTHER = "other"
_OUTSIDE = "(no module)"  # the map's row for ops outside every module (trace: "-")
_RECIPE = "fp8-recipe"  # the trace's reason for the ops inside an mpnb.fp8 layer
# one colour per row of FORMATS, by position (a registered format takes the next one)
_PALETTE = (
    "#BAB0AC",  # the table's first row: float32, the baseline, in grey
    "#9ECAE9",
    "#4C78A8",
    "#72B7B2",
    "#F58518",
    "#EECA3B",
    "#E45756",
    "#B279A2",
    "#54A24B",
    "#FF9DA6",
    "#9D755D",
)
_OTHER_COLOR = "#EEEEEE"
_ROW_PX = 36  # height of one row of a map, for its two lines of text


def scaled_format(config) -> NumberFormat | None:
    """The scaled format (FP8, MX, NVFP4...) ``config`` trains its linear layers in, or None
    for a configuration that has none (the O levels, bf16-pure, tf32).

    Args:
        config: a name of :data:`~mpnb.core.precision_configs.PRECISION_CONFIGS` (or a spec
            :func:`~mpnb.core.precision_configs.get_config` takes) or a configuration.

    Example::

        >>> scaled_format("nvfp4").name, scaled_format("O1")
        ('nvfp4', None)
    """
    cfg = get_config(config)
    return next((f for f in map(cfg.number_format, cfg.halves(())) if f.scaled), None)


def what_if_choices() -> list[str]:
    """The configurations whose recipe the what-if statistics can apply: every one of
    :data:`~mpnb.core.precision_configs.PRECISION_CONFIGS` with a scaled format, in table
    order (``fp8-tensorwise`` ... ``mxfp8``, ``nvfp4``, ``mxfp4`` and their variants)."""
    return [name for name in PRECISION_CONFIGS if scaled_format(name) is not None]


def default_what_if() -> str:
    """The what-if choice shown first: the narrowest format's first configuration (NVFP4's
    ``nvfp4``), where the statistics have the most to say."""
    return min(what_if_choices(), key=lambda name: scaled_format(name).element_max)


@dataclass(frozen=True)
class ModulePhaseMap:
    """A trace folded into one cell per (module, phase).

    Attributes:
        modules: the rows, in the order the modules first ran (``"(no module)"``: the ops
            outside every module, as the loss).
        phases: the columns, in :data:`PHASES` order (only those with ops).
        formats: the formats present, in :data:`~mpnb.core.number_formats.FORMATS` order,
            :data:`OTHER` last: the legend.
        cells: one row per cell with ops: ``module, phase, format`` (the format carrying the
            most FLOPs, or bytes where none), ``ops, flops, bytes``, ``flops_share,
            bytes_share`` (of the whole step, 0..1), ``mix`` (each format's share of the
            cell, in words) and ``dtypes`` (the dtypes its ops computed in).
    """

    modules: tuple[str, ...]
    phases: tuple[str, ...]
    formats: tuple[str, ...]
    cells: pd.DataFrame

    def matrix(self, column: str) -> list[list]:
        """``values[module][phase]`` of a column of :attr:`cells` (``"format_index"``: the
        format's position in :attr:`formats`); None where the module ran no op in a phase."""
        grid = [[None] * len(self.phases) for _ in self.modules]
        row, col = (
            {m: i for i, m in enumerate(self.modules)},
            {p: j for j, p in enumerate(self.phases)},
        )
        for c in self.cells.itertuples(index=False):
            value = self.formats.index(c.format) if column == "format_index" else getattr(c, column)
            grid[row[c.module]][col[c.phase]] = value
        return grid


def op_formats(ops: pd.DataFrame, recipe: NumberFormat | None) -> pd.Series:
    """The format each op of a trace ran in: ``recipe`` for the ops of an mpnb.fp8 layer,
    else the format of its dtype (:data:`OTHER` for a dtype that is none)."""

    def of(dtype) -> str:
        f = format_of(dtype)
        return f.name if f is not None else OTHER

    names = ops["dtype"].map(of)
    if recipe is not None:
        names = names.where(ops["reason"] != _RECIPE, recipe.name)
    return names


def _order(names, known) -> tuple[str, ...]:
    present = set(names)
    return tuple(n for n in known if n in present) + tuple(sorted(present - set(known)))


def module_phase_map(ops: pd.DataFrame, recipe: NumberFormat | None = None) -> ModulePhaseMap:
    """Fold a :func:`mpnb.lab.trace_precision` op frame into a :class:`ModulePhaseMap`.

    Args:
        ops: the trace's ``ops`` (columns ``seq, phase, module, kind, dtype, reason, flops,
            bytes``); views are left out (they move no data).
        recipe: the configuration's scaled format (:func:`scaled_format`): what the ops of its
            mpnb.fp8 layers count in (None: no such layers).

    Raises:
        ValueError: ``ops`` lacks one of those columns.
    """
    need = ["seq", "phase", "module", "kind", "dtype", "reason", "flops", "bytes"]
    missing = [c for c in need if c not in ops.columns]
    if missing:
        raise ValueError(
            f"module_phase_map: the op frame has no {', '.join(missing)} column(s); pass "
            "the ops of mpnb.lab.trace_precision (trace.ops), whose columns are "
            "mpnb.lab.precision_trace.COLUMNS."
        )
    work = ops[ops["kind"] != "view"].sort_values("seq")
    work = work.assign(
        format=op_formats(work, recipe), module=work["module"].replace("-", _OUTSIDE)
    )
    totals = {c: float(work[c].sum()) for c in ("flops", "bytes")}
    rows = [_cell(m, p, g, totals) for (m, p), g in work.groupby(["module", "phase"], sort=False)]
    cells = pd.DataFrame(
        rows,
        columns=["module", "phase", "format", "ops", "flops", "bytes"]
        + ["flops_share", "bytes_share", "mix", "dtypes"],
    )
    return ModulePhaseMap(
        modules=tuple(dict.fromkeys(work["module"])),
        phases=_order(work["phase"], PHASES),
        formats=_order(cells["format"], [*FORMATS, OTHER]),
        cells=cells,
    )


def _cell(module: str, phase: str, g: pd.DataFrame, totals: dict) -> dict:
    flops, nbytes = float(g["flops"].sum()), float(g["bytes"].sum())
    weight = "flops" if flops > 0 else "bytes"  # a cell with no FLOPs is judged by its bytes
    by = g.groupby("format", sort=False)[weight].sum()
    # the heaviest first; between equals, the table's order
    by = by.sort_index(key=lambda names: names.map(_rank)).sort_values(
        ascending=False, kind="stable"
    )
    whole = float(by.sum())
    mix = ", ".join(f"{n} {v / whole:.0%}" for n, v in by.items() if v) if whole else by.index[0]
    return dict(
        module=module,
        phase=phase,
        format=by.index[0],
        ops=len(g),
        flops=flops,
        bytes=nbytes,
        flops_share=flops / totals["flops"] if totals["flops"] else 0.0,
        bytes_share=nbytes / totals["bytes"] if totals["bytes"] else 0.0,
        mix=f"{mix} of its {'FLOPs' if weight == 'flops' else 'bytes'}",
        dtypes=", ".join(d for d in dict.fromkeys(g["dtype"]) if d != "-") or "no dtype",
    )


def _rank(name: str) -> int:
    order = [*FORMATS, OTHER]
    return order.index(name) if name in order else len(order)


def ops_table(ops: pd.DataFrame) -> pd.DataFrame:
    """The "Every op" table of a trace, a line or two per op: ``phase, module, op``,
    ``dtypes`` (its inputs' distinct dtypes -> the dtype it computes in: a cast shows as one,
    a view keeps its dtype) and ``why`` (the trace's detail). The eight columns of the trace
    (``kind``, ``in_dtypes``, ``dtype``, the reason's code and its words) left the words a
    sliver of the pane, four lines and more an op; the codes stay in ``trace.ops``."""

    def dtypes(r) -> str:
        ins = ", ".join(dict.fromkeys(d for d in str(r.in_dtypes).split(",") if d))
        return f"{ins}\u00a0\u2192 {r.dtype}" if ins else f"\u2192 {r.dtype}"

    return pd.DataFrame(
        dict(
            phase=ops["phase"],
            module=ops["module"],
            op=ops["op"],
            dtypes=[dtypes(r) for r in ops.itertuples(index=False)],
            why=ops["detail"],
        )
    )


def format_color(name: str) -> str:
    """The map colour of format ``name``: one per row of :data:`FORMATS`, by position."""
    if name in FORMATS:
        return _PALETTE[list(FORMATS).index(name) % len(_PALETTE)]
    return _OTHER_COLOR


def _discrete_scale(colors: list[str]) -> list:
    """A colourscale of equal steps, one flat colour per integer 0..n-1 (zmin -0.5, zmax n-0.5)."""
    n = len(colors)
    return [s for i, c in enumerate(colors) for s in ((i / n, c), ((i + 1) / n, c))]


def module_phase_figure(m: ModulePhaseMap, title: str) -> go.Figure:
    """The map as a plotly heatmap: modules down, phases across, a colour per format (the
    colour bar is the legend); each cell says its format and its shares of the step's FLOPs
    and bytes, and its hover the ops, dtypes and the formats' mix."""
    fig = go.Figure(layout=_layout(title, len(m.modules)))
    if not len(m.cells):
        return fig
    shares = m.matrix("flops_share"), m.matrix("bytes_share")
    formats = m.matrix("format")
    text = [
        [
            "" if f is None else f"{f}<br>{fl:.0%} · {by:.0%}"
            for f, fl, by in zip(fr, flr, byr, strict=True)
        ]
        for fr, flr, byr in zip(formats, *shares, strict=True)
    ]
    extra = [m.matrix(c) for c in ("ops", "mix", "dtypes", "flops", "bytes")]
    custom = [list(zip(*cols, strict=True)) for cols in zip(*extra, strict=True)]
    n = len(m.formats)
    fig.add_heatmap(
        z=m.matrix("format_index"),
        x=list(m.phases),
        y=list(m.modules),
        zmin=-0.5,
        zmax=n - 0.5,
        colorscale=_discrete_scale([format_color(f) for f in m.formats]),
        colorbar=dict(
            title="format", tickvals=list(range(n)), ticktext=list(m.formats), len=0.9, thickness=14
        ),
        text=text,
        texttemplate="%{text}",
        textfont=dict(size=11),
        customdata=custom,
        hovertemplate="<b>%{y}</b>, %{x}<br>%{customdata[0]} ops: %{customdata[1]}<br>"
        "computed in %{customdata[2]}<br>%{customdata[3]:,.0f} FLOPs, %{customdata[4]:,.0f} "
        "bytes<extra></extra>",
        hoverongaps=False,
        xgap=2,
        ygap=2,
    )
    return fig


def _layout(title: str, rows: int) -> go.Layout:
    return go.Layout(
        # two lines in the middle of the top margin, clear of the column labels below them
        title=dict(text=title, font=dict(size=14), x=0.01, xanchor="left"),
        height=170 + _ROW_PX * max(rows, 3),
        margin=dict(t=100, b=20, l=10, r=10),
        xaxis=dict(side="top", automargin=True),
        yaxis=dict(autorange="reversed", automargin=True),
        plot_bgcolor="white",
    )


_METRIC_LABELS = {
    "underflow_pct": "underflow (% of elements)",
    "overflow_pct": "overflow (% of elements)",
    "mse": "MSE",
    "rel_err": "relative error",
    "scale_inv_min": "min scale inverse",
    "scale_inv_max": "max scale inverse",
    "scale_inv_std": "std of scale inverses",
    "dynamic_range": "dynamic range (binades)",
    "worst_block_range": "worst block's range (binades)",
}


def metric_label(metric: str) -> str:
    """How a statistic of :data:`mpnb.core.fp8.stats.METRICS` reads on an axis."""
    return _METRIC_LABELS.get(metric, metric.replace("_", " "))


def stats_title(stats, metric: str) -> str:
    """The statistics map's title: the statistic, then what it is of (a what-if says that
    nothing trained in that format)."""
    what = (
        f"what-if {stats.format}: on this step's tensors, nothing trained in it"
        if stats.what_if
        else f"{stats.format}: as this step quantized them"
    )
    what = html.escape(what, quote=False)
    return f"{metric_label(metric)} per layer and tensor<br><sub>{what}</sub>"


def _short(v) -> str | None:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return None
    return f"{v:.3g}"


def stats_figure(stats, metric: str = "rel_err") -> go.Figure:
    """The layers x tensors heat map of ``stats`` (a :class:`mpnb.fp8.QuantStats`): its
    :meth:`heatmap` of ``metric``, each cell with its value; a tensor a layer did not
    quantize is a gap."""
    layers, tensors, values = stats.heatmap(metric)
    fig = go.Figure(layout=_layout(stats_title(stats, metric), len(layers)))
    if not layers:
        return fig
    fig.add_heatmap(
        z=values,
        x=list(tensors),
        y=list(layers),
        colorscale="YlOrRd",
        colorbar=dict(title=metric_label(metric).split(" (")[0], len=0.9, thickness=14),
        text=[[_short(v) or "" for v in row] for row in values],
        texttemplate="%{text}",
        textfont=dict(size=11),
        hovertemplate=f"<b>%{{y}}</b>, %{{x}}<br>{metric_label(metric)}: %{{z:.4g}}<extra></extra>",
        hoverongaps=False,
        xgap=2,
        ygap=2,
    )
    return fig


# ---- the view -----------------------------------------------------------------------------------

_NO_STATS = "no statistics yet: press Trace (the widget needs the model: mpnb.widgets.profile)"
_HALF = dict(flex="1 1 440px", min_width="360px")  # side by side; one under the other if narrow
_WIDE = {"description_width": "initial"}  # a description as wide as its text: never cut


class PrecisionPictures(w.HBox):
    """The two maps above the Precision tab's tables, side by side, and their choosers.

    It only draws: the owner (:class:`~mpnb.widgets.ProfileWidget`) traces and computes the
    statistics, then calls :meth:`show_trace` and :meth:`show_stats`.

    Attributes:
        map_view: the module x phase map (a :class:`~mpnb.widgets._common.FigureOutput`).
        stats_view: the statistics map.
        what_if: the format the statistics of a configuration with no scaled format are
            computed for (shown only for such a configuration, see :meth:`use_what_if`).
        metric: the statistic the map is coloured by (:data:`mpnb.core.fp8.stats.METRICS`).
        stats_note: the worst cell of the statistics map, in words.
        stats: the :class:`mpnb.fp8.QuantStats` shown (None: none yet).

    Example::

        >>> pics = PrecisionPictures()
        >>> pics.show_trace(trace, scaled_format(trace.summary.config))
        >>> pics.show_stats(mpnb.lab.quant_stats(model, x, "O1", what_if="nvfp4"))
    """

    def __init__(self):
        self.map_view = FigureOutput(go.Figure(), "module x phase map", "press Trace", "260px")
        self.stats_view = FigureOutput(go.Figure(), "quantization statistics", _NO_STATS, "260px")
        self.what_if = w.Dropdown(
            options=what_if_choices(), value=default_what_if(), description="what if", style=_WIDE
        )
        self.metric = w.Dropdown(
            options=list(METRICS), value="rel_err", description="statistic", style=_WIDE
        )
        self.metric.observe(lambda _: self.show_stats(self.stats), names="value")
        self.stats_note = w.HTML()
        self.stats = None
        choosers = w.HBox([self.what_if, self.metric], layout=w.Layout(flex_flow="row wrap"))
        super().__init__(
            [
                w.VBox([self.map_view], layout=w.Layout(**_HALF)),
                w.VBox([choosers, self.stats_view, self.stats_note], layout=w.Layout(**_HALF)),
            ],
            layout=w.Layout(flex_flow="row wrap", width="100%"),
        )

    def show_trace(self, trace, recipe: NumberFormat | None) -> None:
        """Draw the module x phase map of ``trace`` (:func:`mpnb.lab.trace_precision`'s),
        the ops of its mpnb.fp8 layers counted in ``recipe`` (:func:`scaled_format`)."""
        s = trace.summary
        emulated = " (emulated)" if s.fp8_emulated else ""
        title = f"{s.config}{emulated}: format per module and phase<br>" + (
            "<sub>cell: its format, its share of the step's FLOPs · of its bytes</sub>"
        )
        _redraw(self.map_view, module_phase_figure(module_phase_map(trace.ops, recipe), title))

    def use_what_if(self, on: bool) -> None:
        """Show the what-if chooser (``on``: the configuration has no scaled format of its
        own), or hide it (the statistics are then the configuration's own)."""
        self.what_if.layout.display = None if on else "none"

    def show_stats(self, stats, why: str | None = None) -> None:
        """Draw ``stats`` (a :class:`mpnb.fp8.QuantStats`) in the chosen metric; None shows
        ``why`` (or what to press) instead of an empty map."""
        self.stats = stats
        if stats is None:
            self.stats_view.placeholder(why)
            self.stats_note.value = ""
            return
        layers, _, _ = stats.heatmap(self.metric.value)
        if not layers:
            self.stats_view.placeholder(
                "no layer was quantized: the model has no nn.Linear layer for a recipe to convert"
            )
            self.stats_note.value = ""
            return
        _redraw(self.stats_view, stats_figure(stats, self.metric.value))
        self.stats_note.value = worst_html(stats, self.metric.value)


def worst_html(stats, metric: str) -> str:
    """``"Worst: layer 2's grad_output, relative error 0.31."``: the statistics' worst cell
    (``""`` where no value is finite)."""
    _, _, values = stats.heatmap(metric)
    if all(v is None for row in values for v in row):
        return ""
    row = stats.worst(metric)
    value = _short(row.get(metric))
    return (
        f"<p style='font-size:12px;color:#444'>Worst: layer <b>{html.escape(str(row['layer']))}"
        f"</b>'s {html.escape(str(row['tensor']))}, {html.escape(metric_label(metric))} "
        f"{value}.</p>"
    )


def _redraw(out: FigureOutput, new: go.Figure) -> None:
    """Replace the figure of ``out`` by ``new``, in place, and render it."""
    out.fig.data = ()
    out.fig.layout = new.layout
    out.fig.add_traces(new.data)
    out.render()
