"""``mpnb.widgets.profile(model, example_inputs)``: one call, the whole profile across opt levels.

It calls :func:`mpnb.lab.profile` once (phase times, per-module table, FLOPs and achieved
FLOP/s, op table, the ``torch.profiler`` trace of one step and, as asked, the memory breakdown
by role of one tracked step, the first layer that leaves the half dtype's range and which
precision each op ran in) and shows the results in tabs. Nothing is measured or orchestrated
here.

Like :class:`~mpnb.widgets.CompareWidget`, it says how busy the machine was (load average at
the start and end, threads used) and warns when other processes competed for the CPU: the
phase times of the levels are then not comparable.
"""

from __future__ import annotations

import html

import ipywidgets as w
import pandas as pd
import plotly.graph_objects as go
import torch

import mpnb.lab
from mpnb.core.dtype_names import short_name
from mpnb.core.opt_levels import OPT_LEVEL_NAMES
from mpnb.core.precision_configs import PRECISION_CONFIGS, get_config
from mpnb.widgets._common import ErrorBox, FigureOutput, hardware_html
from mpnb.widgets._compare_views import MEMORY_ROLES
from mpnb.widgets._precision_views import PrecisionPictures, ops_table, scaled_format

__all__ = ["ProfileWidget", "profile"]

_PHASE_NAMES = {
    "forward": "forward (model + loss)",
    "backward": "backward",
    "unscale_and_update": "unscale + scale update (amp)",
    "optimizer_step": "optimizer step",
}
_COLUMN_NAMES = {
    "opt_level": "opt level",
    "time_ms": "time (ms)",
    "output_mib": "output (MiB)",
    "output_dtype": "output dtype",
    "flops": "FLOPs (fwd + bwd)",
    "fwd_bwd_ms": "fwd + bwd (ms)",
    "flop_per_s": "FLOP/s",
    "self_cpu_ms": "self CPU (ms)",
    "cpu_total_ms": "total CPU (ms)",
    "peak_mem_mib": "peak memory (MiB)",
    "flops_share": "share of FLOPs",
    "bytes_share": "share of bytes",
}


# Tables no wider than the pane: the columns of long text (a reason, a module path, a list of
# dtypes) wrap, and may break a long name, so every column stays in view; the short columns
# (numbers, dtypes, op names) stay on one line.
_TABLE_STYLE = (
    "<style>.mpnb-table{font-size:12px;border-collapse:collapse}.mpnb-table td,"
    ".mpnb-table th{padding:2px 6px;border-bottom:1px solid #ddd;text-align:left;"
    "vertical-align:top;white-space:nowrap}.mpnb-table th{white-space:normal}"
    ".mpnb-table td.mpnb-long{white-space:normal;overflow-wrap:anywhere;min-width:8em}"
    ".mpnb-table td.mpnb-wide{white-space:normal;overflow-wrap:break-word}</style>"
)
_LONG = 24  # characters: a column with a longer cell wraps


def _num(v) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        if v != v:  # NaN
            return ""
        if abs(v) >= 1e6:
            return f"{v:.3g}"
        return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"
    return str(v)


def _html_table(
    df: pd.DataFrame | None,
    empty: str,
    max_rows: int = 200,
    wide: str | None = None,
    nowrap: tuple[str, ...] = (),
) -> w.HTML:
    """``df`` as a table that fits the pane; the column ``wide`` (a sentence per row) gets
    the room the others leave, so that it wraps to few lines; the columns ``nowrap`` stay on
    one line however long."""
    if df is None or df.empty:
        return w.HTML(f"<i>{html.escape(empty)}</i>")
    df = df.head(max_rows).rename(columns=lambda c: _COLUMN_NAMES.get(c, c.replace("_", " ")))
    cells = {
        c: [f"{v:.1%}" for v in df[c]] if c.startswith("share of") else [_num(v) for v in df[c]]
        for c in df.columns
    }
    keep = {_COLUMN_NAMES.get(c, c) for c in nowrap}
    long = {c for c, vs in cells.items() if max(map(len, vs), default=0) > _LONG} - keep
    wide = _COLUMN_NAMES.get(wide, wide)
    head = "".join(
        f"<th{' style=width:50%' if c == wide else ''}>{html.escape(str(c))}</th>"
        for c in df.columns
    )
    rows = "".join(
        "<tr>"
        + "".join(
            f"<td{_td_class(c, long, wide)}>{html.escape(cells[c][i])}</td>" for c in df.columns
        )
        + "</tr>"
        for i in range(len(df))
    )
    table = f"<table class='mpnb-table'><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>"
    return w.HTML(f"{_TABLE_STYLE}<div style='overflow:auto;max-height:420px'>{table}</div>")


def _td_class(column: str, long: set, wide: str | None) -> str:
    if column == wide:
        return " class=mpnb-wide"
    return " class=mpnb-long" if column in long else ""


def _bar_fig(title: str, y: str, stacked: bool = False) -> go.Figure:
    return go.Figure(
        layout=go.Layout(
            title=title,
            height=330,
            barmode="stack" if stacked else "group",
            margin=dict(t=45, b=45, l=60, r=20),
            xaxis=dict(title="opt level"),
            yaxis=dict(title=y),
        )
    )


def load_html(load: dict) -> str:
    """The "how busy was the machine" line, with CompareWidget's warning when others competed.

    Example::

        >>> load_html({"start": [0.5], "end": [1.4], "threads": 1, "cpus": 2, "note": ""})
    """
    if not load:
        return ""
    start, end = (load.get(k) or [float("nan")] for k in ("start", "end"))
    line = (
        f"Measured with {load.get('threads')} thread(s) on {load.get('cpus')} CPU(s); load "
        f"average {start[0]:.2f} at the start, {end[0]:.2f} at the end."
    )
    if load.get("competed"):
        return (
            f"<div style='color:#a05a00;border-left:4px solid #a05a00;padding:2px 8px'>"
            f"<b>{html.escape(load['note'])}</b><br>{html.escape(line)}</div>"
        )
    return f"<div style='color:#555'>{html.escape(line)}</div>"


class ProfileWidget(w.VBox):
    """Tabs over a :class:`mpnb.lab.profiling.ProfileResult`, a memory frame and the traces.

    Args:
        result: what :func:`mpnb.lab.profile` returned.
        memory: a :func:`mpnb.lab.compare` DataFrame (its ``mem_*_mib`` columns), or None.
        trace: what :func:`mpnb.lab.trace_overflow` returned, or None.
        device: for the hardware tab.
        errors: ``{what: message}`` of the extras that failed (shown in red above the tabs).
        precision: what :func:`mpnb.lab.trace_precision` returned, or None.
        model, example_inputs, loss_fn: kept to trace another configuration from the
            Precision tab (None: that tab shows only ``precision``).
        half_dtype: the O levels' half dtype for those traces (None: the device's default).
        stats: what :func:`mpnb.lab.quant_stats` returned for ``precision``'s configuration,
            or None (computed here when the model is given).

    The Precision tab puts two pictures above its tables: the module x phase map of the trace
    (the format each module ran in, per phase, with its share of FLOPs and bytes) and the
    per-layer quantization statistics (layers x tensors): an FP8/FP4 configuration's own, or
    for any other configuration those of the format chosen in "what if" on the same tensors.

    Every chart is a whole figure in an ``Output`` (:class:`~mpnb.widgets._common.FigureOutput`):
    it renders after Run All and after a page reload; a chart with nothing to draw says why.

    Attributes:
        phases_fig, flops_fig, memory_fig: the plotly figures (tests read them).
        pictures: the Precision tab's two maps and their choosers
            (:class:`~mpnb.widgets._precision_views.PrecisionPictures`).
        stats: the :class:`mpnb.fp8.QuantStats` the statistics map shows (None: none).
        load: the load banner (load average, threads, and the warning when others competed).
        trace_button: writes :meth:`export_chrome_trace` to the path in ``trace_path``.

    Example::

        >>> pw = mpnb.widgets.profile(model, torch.randn(64, 784))
        >>> pw.export_chrome_trace("step.json", "O2")   # open in https://ui.perfetto.dev
    """

    TABS = ("Phases", "Modules", "FLOPs", "Memory", "Ops", "Overflow", "Precision", "Hardware")

    def __init__(
        self,
        result,
        memory: pd.DataFrame | None = None,
        trace=None,
        device: str = "cpu",
        errors: dict | None = None,
        precision=None,
        model=None,
        example_inputs=None,
        loss_fn=None,
        half_dtype: torch.dtype | None = None,
        stats=None,
    ):
        self.result, self.memory, self.trace = result, memory, trace
        self.precision, self.stats = precision, stats
        self._traced = (model, example_inputs, loss_fn, half_dtype)
        self.errors = ErrorBox()
        self.phases_fig = _bar_fig(
            "time per phase of one training step (median)", "ms", stacked=True
        )
        self.flops_fig = _bar_fig("achieved throughput (forward + backward)", "GFLOP/s")
        self.memory_fig = _bar_fig("memory at one tracked step, by role", "MiB", stacked=True)
        self.views = {
            "phases": FigureOutput(self.phases_fig, "time per phase", "no level was profiled"),
            "flops": FigureOutput(self.flops_fig, "achieved throughput", "no level was profiled"),
            "memory": FigureOutput(
                self.memory_fig,
                "memory by role",
                "memory not measured (see the red lines above, or pass memory=True)",
            ),
        }
        self._draw()
        self.load = w.HTML(load_html(getattr(result, "load", {})))
        self.tabs = w.Tab()
        self.tabs.children = [
            w.VBox([self.views["phases"], self._phase_table()]),
            _html_table(self._module_table(), "no modules"),
            w.VBox([self.views["flops"], _html_table(result.flops, "no FLOPs")]),
            w.VBox(
                [self.views["memory"], _html_table(self._memory_table(), "memory not measured")]
            ),
            w.VBox([self._trace_export(), _html_table(result.ops, "no op table")]),
            self._overflow_pane(),
            self._precision_pane(),
            w.HTML(hardware_html(device)),
        ]
        for i, title in enumerate(self.TABS):
            self.tabs.set_title(i, title)
        failed = {**(result.errors or {}), **(errors or {})}
        self.failures = w.HTML(
            "".join(
                f"<div style='color:#b00020'><b>{html.escape(k)}</b> failed: {html.escape(v)}</div>"
                for k, v in failed.items()
            )
        )
        super().__init__([self.load, self.failures, self.tabs, self.errors])

    # ---- tables -------------------------------------------------------------------------------

    def _phase_table(self) -> w.HTML:
        ph = self.result.phases
        if ph.empty:
            return _html_table(None, "no phases")
        t = ph.pivot(index="phase", columns="opt_level", values="time_ms")
        t = t.reindex([p for p in _PHASE_NAMES if p in t.index])
        t.index = [_PHASE_NAMES[p] for p in t.index]
        t.columns.name = None
        t = t.rename_axis("phase (ms)").reset_index()
        # the levels that scale no loss (O0: plain fp32 training) have a blank unscale row
        known = [c for c in t.columns if c in PRECISION_CONFIGS]
        unscaled = [c for c in known if not get_config(c).loss_scaling]
        note = (
            f"<p style='color:#555;font-size:12px'>{', '.join(unscaled)}: no loss scaler "
            "runs, so no unscale row (blank).</p>"
            if unscaled
            else ""
        )
        table = _html_table(t, "no phases")
        return w.VBox([table, w.HTML(note)])

    def _module_table(self) -> pd.DataFrame | None:
        mods = self.result.modules
        if mods.empty:
            return None
        mods = mods.pivot_table(
            index=["module", "type"],
            columns="opt_level",
            values=["time_ms", "output_dtype"],
            aggfunc="first",
        )
        names = {"time_ms": "time (ms)", "output_dtype": "dtype"}
        mods.columns = [f"{b} {names[a]}" for a, b in mods.columns]
        return mods.reset_index()

    def _memory_table(self) -> pd.DataFrame | None:
        """One column per opt level, one row per role (a column per role did not fit)."""
        if self.memory is None or self.memory.empty:
            return None
        m = self.memory.set_index("opt_level")
        rows = {"precision": m["precision"], "peak (MiB)": m["peak_mem_mib"]}
        for r in MEMORY_ROLES:
            if f"mem_{r}_mib" in m and m[f"mem_{r}_mib"].fillna(0).any():
                rows[f"{r.replace('_', ' ')} (MiB)"] = m[f"mem_{r}_mib"]
        t = pd.DataFrame(rows).T
        t.columns.name = None
        return t.rename_axis("memory at the tracked step").reset_index()

    # ---- figures ------------------------------------------------------------------------------

    def _draw(self) -> None:
        ph, fl = self.result.phases, self.result.flops
        for phase, g in ph.groupby("phase", sort=False):
            self.phases_fig.add_bar(
                x=list(g["opt_level"]), y=list(g["time_ms"]), name=_PHASE_NAMES.get(phase, phase)
            )
        if not fl.empty:
            self.flops_fig.add_bar(
                x=list(fl["opt_level"]),
                y=list(fl["flop_per_s"] / 1e9),
                name="GFLOP/s",
                text=[f"{f / 1e6:.1f} MFLOP" for f in fl["flops"]],
            )
        if not ph.empty:
            self.views["phases"].render()
            self.views["flops"].render()
        m = self.memory
        if m is None:
            return
        ok = m[m["error"].fillna("") == ""]
        for role in MEMORY_ROLES:
            self.memory_fig.add_bar(
                x=list(ok["opt_level"]),
                y=list(ok[f"mem_{role}_mib"].fillna(0.0)),
                name=role.replace("_", " "),
            )
        if len(ok):
            self.views["memory"].render()

    # ---- panes --------------------------------------------------------------------------------

    def _trace_export(self) -> w.Widget:
        levels = list(getattr(self.result, "traces", {}) or {})
        self.trace_level = w.Dropdown(options=levels, description="level")
        self.trace_path = w.Text("mpnb-profile-trace.json", description="file")
        self.trace_button = w.Button(
            description="Export Chrome/Perfetto trace",
            icon="download",
            layout=w.Layout(width="auto"),
            disabled=not levels,
        )
        self.trace_status = w.Label(
            "the torch.profiler trace of one step; open it in https://ui.perfetto.dev"
        )
        self.trace_button.on_click(self.errors.guard(lambda _: self.export_chrome_trace()))
        return w.VBox(
            [w.HBox([self.trace_level, self.trace_path, self.trace_button]), self.trace_status]
        )

    def export_chrome_trace(self, path: str | None = None, opt_level: str | None = None) -> str:
        """Write one level's step trace (``torch.profiler``'s ``export_chrome_trace``).

        Args:
            path: default: the path in the Ops tab's "file" box.
            opt_level: default: the level chosen in the Ops tab.
        """
        path = path or self.trace_path.value
        out = self.result.export_chrome_trace(path, opt_level or self.trace_level.value)
        self.trace_status.value = f"wrote {out} (open it in https://ui.perfetto.dev)"
        return out

    def _overflow_pane(self) -> w.Widget:
        r = self.trace
        link = w.Button(
            description="Which precision did each op run in? (Precision tab)",
            icon="arrow-right",
            layout=w.Layout(width="auto"),
        )
        link.on_click(lambda _: self.show_precision())
        self.precision_link = link
        if r is None:
            return w.VBox([w.HTML("<i>overflow tracer not run</i>"), link])
        name = short_name(r.dtype)
        if r.module is None:
            head = f"<p>Every module's activations and gradients fit in <b>{name}</b>.</p>"
        else:
            head = (
                f"<p style='color:#b00020'>First to leave the {name} range: module "
                f"<b>{html.escape(str(r.module))}</b>, op <code>{html.escape(str(r.op))}"
                f"</code>, in the {html.escape(str(r.phase))}.</p>"
            )
        advice = f"<p>{html.escape(r.advice)}</p>" if r.advice else ""
        return w.VBox([w.HTML(head + advice), link, _html_table(r.table, "no table")])

    def show_precision(self) -> None:
        """Select the Precision tab (the overflow finder's link)."""
        self.tabs.selected_index = self.TABS.index("Precision")

    def _precision_pane(self) -> w.Widget:
        first = self.precision.summary.config if self.precision is not None else "O1"
        self.precision_config = w.Dropdown(
            options=list(PRECISION_CONFIGS),
            value=first,
            description="configuration",
            style={"description_width": "initial"},  # the default width cut it to "configurat..."
        )
        self.precision_button = w.Button(
            description="Trace", icon="search", disabled=self._traced[0] is None
        )
        self.precision_button.on_click(self.errors.guard(lambda _: self.retrace()))
        self.pictures = PrecisionPictures()
        self.pictures.what_if.observe(lambda _: self._stats_or_why(), names="value")
        self.precision_view = w.VBox()
        self._show_precision_trace()
        if self.stats is None and self.precision is not None and self._traced[0] is not None:
            self._stats_or_why()
        else:
            self.pictures.show_stats(self.stats, self._no_stats_why())
        return w.VBox(
            [
                w.HTML(
                    "<p>One forward and backward under a configuration, every aten op "
                    "recorded (<code>mpnb.lab.trace_precision</code>): the dtype it ran in, "
                    "and why.</p>"
                ),
                w.HBox([self.precision_config, self.precision_button]),
                self.precision_view,
            ]
        )

    def retrace(self, config: str | None = None) -> None:
        """Trace ``config`` (default: the one chosen in the Precision tab) and show it, with
        its quantization statistics."""

        model, x, loss_fn, half = self._traced
        if model is None:
            raise RuntimeError(
                "retrace: this widget was built without the model; use "
                "mpnb.widgets.profile(model, inputs) to trace other configurations."
            )
        self.precision = mpnb.lab.trace_precision(
            model, x, config or self.precision_config.value, loss_fn=loss_fn, half_dtype=half
        )
        self._show_precision_trace()
        self._stats_or_why()

    def refresh_stats(self) -> None:
        """Compute the per-layer quantization statistics of the traced configuration
        (:func:`mpnb.lab.quant_stats`) and draw their map: an FP8/FP4 configuration's own, or
        for any other those the "what if" choice would give on the same tensors."""
        import mpnb.lab  # the lab loads on first use, as in retrace and profile

        model, x, loss_fn, half = self._traced
        if model is None or self.precision is None:
            raise RuntimeError(
                "refresh_stats: there is no model or no trace to compute statistics for; use "
                "mpnb.widgets.profile(model, inputs) and press Trace first."
            )
        config = self.precision.summary.config
        # a configuration with no recipe of its own is measured in the what-if chooser's
        what_if = self.pictures.what_if.value if scaled_format(config) is None else None
        self.stats = mpnb.lab.quant_stats(
            model, x, config, what_if=what_if, loss_fn=loss_fn, half_dtype=half
        )
        self.pictures.show_stats(self.stats)

    def _stats_or_why(self) -> None:
        """:meth:`refresh_stats`, its failure shown in the map's place and in the error box
        (with its traceback); the trace above stays."""
        try:
            self.refresh_stats()
        except Exception as e:  # noqa: BLE001 - shown in the widget, never lost
            summary = self.errors.show(e, "quantization statistics: ")
            self.pictures.show_stats(None, f"not computed: {summary}")

    def _no_stats_why(self) -> str | None:
        if self._traced[0] is None and self.stats is None:
            return (
                "not computed: this widget was built without the model; "
                "mpnb.widgets.profile(model, inputs) computes them"
            )
        return None

    def _show_precision_trace(self) -> None:
        tr = self.precision
        if tr is None:
            self.precision_view.children = [
                w.HTML("<i>precision trace not run: choose a configuration and press Trace.</i>")
            ]
            return
        ops, s = tr
        recipe = scaled_format(s.config)
        self.pictures.use_what_if(recipe is None)
        self.pictures.show_trace(tr, recipe)
        name = recipe.name.upper() if recipe is not None else "FP8"
        head = (
            f"<p><b>{html.escape(s.config)}</b> ({html.escape(_precision_of(s))}): "
            f"{len(ops)} ops recorded."
            + (
                f" {name} is emulated on this device: {name} numerics, not {name} speed."
                if s.fp8_emulated
                else ""
            )
            + "</p>"
        )
        self.precision_view.children = [
            w.HTML(head),
            self.pictures,
            w.HTML("<b>Share of FLOPs and bytes per dtype</b>"),
            _html_table(s.by_dtype, "no compute ops"),
            w.HTML("<b>Compute ops that stayed float32, and why</b>"),
            _html_table(
                s.fp32_ops, "none: every compute op ran in the low precision", wide="detail"
            ),
            w.HTML("<b>Every op</b>"),
            _html_table(ops_table(ops), "no ops", wide="why", nowrap=("dtypes",)),
        ]


def _precision_of(summary) -> str:
    """``"bfloat16, cpu"``; for a configuration with no half dtype (O0, the FP8 recipes) its
    own description instead of a dash."""
    if summary.half_dtype not in ("", "-", None):
        return f"{summary.half_dtype}, {summary.device}"
    cfg = PRECISION_CONFIGS.get(summary.config)
    what = cfg.description.rstrip(".") if cfg is not None else "float32"
    return f"{summary.device}; {what}"


class _Progress:
    """A progress bar shown in the notebook while :func:`profile` measures (closed after)."""

    def __init__(self):
        self.bar = w.IntProgress(value=0, min=0, max=1, description="profiling")
        self.label = w.Label("starting...")
        self.box = w.HBox([self.bar, self.label])
        try:
            # optional: IPython, only inside a notebook (+180 ms)
            from IPython import get_ipython
            from IPython.display import display

            if get_ipython() is not None:
                display(self.box)
        except ImportError:  # no IPython: nothing to show the bar in
            pass

    def __call__(self, what: str | None, done: int, total: int) -> None:
        """:func:`mpnb.lab.profile`'s ``on_progress``."""
        self.bar.max, self.bar.value = total, done
        self.label.value = f"profiling {what}" if what else "profiled"

    def close(self) -> None:
        self.box.close()


def profile(
    model: torch.nn.Module,
    example_inputs,
    loss_fn=None,
    opt_levels=OPT_LEVEL_NAMES,  # as mpnb.lab.profile: Apex's levels
    half_dtype="auto",
    optimizer: str = "adam",
    lr: float = 1e-3,
    steps: int = 5,
    memory: bool = True,
    trace: bool = True,
    device: str | None = None,
    threads: int | None = None,
    precision: str | None = "auto",
) -> ProfileWidget:
    """Profile ``model`` under each opt level and show everything in one widget.

    Args:
        model, example_inputs, loss_fn, opt_levels, half_dtype, optimizer, lr, steps, device:
            as for :func:`mpnb.lab.profile` (``loss_fn``: ``output -> scalar loss``; it
            receives exactly what the model returned: a tensor, tuple, dict, dataclass or a
            ``transformers`` ``ModelOutput``; ``example_inputs`` may be a dict, called as
            ``model(**inputs)``: for a ``transformers`` model pass a batch with ``labels``
            and ``loss_fn=mpnb.lab.hf.hf_loss``).
        memory: also measure the memory breakdown (a 3-step :func:`mpnb.lab.compare` run).
        trace: also run :func:`mpnb.lab.trace_overflow` in the half dtype.
        threads: ``torch.set_num_threads`` while profiling (restored after; None: unchanged).
            The widget shows the threads and the machine's load, and warns when other
            processes competed for the CPU.
        precision: the configuration :func:`mpnb.lab.trace_precision` traces for the
            Precision tab (``"auto"``: the first half level profiled; None: not traced).

    A progress bar shows while it measures (in a notebook). Everything is measured by that one
    :func:`mpnb.lab.profile` call (its ``memory``, ``trace``, ``precision`` and ``threads``).

    Example::

        >>> mpnb.widgets.profile(model, torch.randn(64, 784), opt_levels=("O0", "O2"))
    """

    bar = _Progress()
    try:
        result = mpnb.lab.profile(
            model,
            example_inputs,
            loss_fn,
            opt_levels,
            half_dtype,
            optimizer,
            lr,
            steps,
            device=device,
            on_progress=bar,
            memory=memory,
            trace=trace,
            precision=precision,
            threads=threads,
        )
    finally:
        bar.close()
    return ProfileWidget(
        result,
        result.memory,
        result.overflow,
        device=result.device,
        precision=result.precision,
        model=model,
        example_inputs=example_inputs,
        loss_fn=loss_fn,
        half_dtype=result.half_dtype,
    )
