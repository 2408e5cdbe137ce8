"""``mpnb.widgets.profile(model, example_inputs)``: one call, the whole profile across opt levels.

It calls :func:`mpnb.lab.profile` (phase times, per-module table, FLOPs and achieved FLOP/s, op
table), :func:`mpnb.lab.compare` on a workload made of your model and inputs (the memory
breakdown by role of one tracked step) and :func:`mpnb.lab.trace_overflow` (the first layer
that leaves the half dtype's range), and shows the results in tabs. Nothing is measured here.
"""

from __future__ import annotations

import copy
import html

import ipywidgets as w
import pandas as pd
import plotly.graph_objects as go
import torch

from mpnb.lab.stats import torch_threads
from mpnb.widgets._common import ErrorBox, hardware_html
from mpnb.widgets._compare_views import MEMORY_ROLES

__all__ = ["ProfileWidget", "profile"]


def _html_table(df: pd.DataFrame | None, empty: str) -> w.HTML:
    if df is None or df.empty:
        return w.HTML(f"<i>{html.escape(empty)}</i>")
    fmt = {c: "{:.4g}".format for c in df.columns if pd.api.types.is_float_dtype(df[c])}
    body = df.to_html(index=False, formatters=fmt, na_rep="", border=0, classes="mpnb-table")
    return w.HTML(f"<div style='overflow:auto;max-height:420px'>{body}</div>")


def _bar_fig(title: str, y: str, stacked: bool = False) -> go.FigureWidget:
    return go.FigureWidget(
        layout=go.Layout(
            title=title,
            height=330,
            barmode="stack" if stacked else "group",
            margin=dict(t=45, b=45, l=60, r=20),
            xaxis=dict(title="opt level"),
            yaxis=dict(title=y),
        )
    )


class ProfileWidget(w.VBox):
    """Tabs over a :class:`mpnb.lab.profiling.ProfileResult`, a memory frame and a trace.

    Args:
        result: what :func:`mpnb.lab.profile` returned.
        memory: a :func:`mpnb.lab.compare` DataFrame (its ``mem_*_mib`` columns), or None.
        trace: what :func:`mpnb.lab.trace_overflow` returned, or None.
        device: for the hardware tab.

    Attributes:
        phases_fig, flops_fig, memory_fig: the plotly ``FigureWidget`` s (tests read them).
    """

    def __init__(
        self,
        result,
        memory: pd.DataFrame | None = None,
        trace=None,
        device: str = "cpu",
        errors: dict | None = None,
    ):
        self.result, self.memory, self.trace = result, memory, trace
        self.errors = ErrorBox()
        self.phases_fig = _bar_fig(
            "time per phase of one training step (median)", "ms", stacked=True
        )
        self.flops_fig = _bar_fig("achieved throughput (forward + backward)", "GFLOP/s")
        self.memory_fig = _bar_fig("memory at one tracked step, by role", "MiB", stacked=True)
        self._draw()
        ph = result.phases
        mods = result.modules
        if not mods.empty:
            mods = mods.pivot_table(
                index=["module", "type"],
                columns="opt_level",
                values=["time_ms", "output_dtype"],
                aggfunc="first",
            )
            mods.columns = [f"{a} {b}" for a, b in mods.columns]
            mods = mods.reset_index()
        self.tabs = w.Tab(
            children=[
                w.VBox(
                    [
                        self.phases_fig,
                        _html_table(
                            ph.pivot(
                                index="phase", columns="opt_level", values="time_ms"
                            ).reset_index()
                            if not ph.empty
                            else None,
                            "no phases",
                        ),
                    ]
                ),
                _html_table(mods, "no modules"),
                w.VBox([self.flops_fig, _html_table(result.flops, "no FLOPs")]),
                w.VBox([self.memory_fig, _html_table(self._memory_table(), "memory not measured")]),
                _html_table(result.ops, "no op table"),
                self._trace_pane(),
                w.HTML(hardware_html(device)),
            ]
        )
        for i, title in enumerate(
            ("Phases", "Modules", "FLOPs", "Memory", "Ops", "Overflow", "Hardware")
        ):
            self.tabs.set_title(i, title)
        failed = {**(result.errors or {}), **(errors or {})}
        self.failures = w.HTML(
            "".join(
                f"<div style='color:#b00020'><b>{html.escape(k)}</b> failed: {html.escape(v)}</div>"
                for k, v in failed.items()
            )
        )
        super().__init__([self.failures, self.tabs, self.errors])

    def _memory_table(self) -> pd.DataFrame | None:
        if self.memory is None:
            return None
        cols = ["opt_level", "precision", "peak_mem_mib"] + [f"mem_{r}_mib" for r in MEMORY_ROLES]
        return self.memory[[c for c in cols if c in self.memory.columns]]

    def _draw(self) -> None:
        ph, fl = self.result.phases, self.result.flops
        with self.phases_fig.batch_update():
            for phase, g in ph.groupby("phase", sort=False):
                self.phases_fig.add_bar(
                    x=list(g["opt_level"]), y=list(g["time_ms"]), name=str(phase)
                )
        with self.flops_fig.batch_update():
            self.flops_fig.add_bar(
                x=list(fl["opt_level"]),
                y=list(fl["flop_per_s"] / 1e9),
                name="GFLOP/s",
                text=[f"{f / 1e6:.1f} MFLOP" for f in fl["flops"]],
            )
        m = self.memory
        if m is None:
            return
        ok = m[m["error"].fillna("") == ""]
        with self.memory_fig.batch_update():
            for role in MEMORY_ROLES:
                self.memory_fig.add_bar(
                    x=list(ok["opt_level"]),
                    y=list(ok[f"mem_{role}_mib"].fillna(0.0)),
                    name=role.replace("_", " "),
                )

    def _trace_pane(self) -> w.Widget:
        r = self.trace
        if r is None:
            return w.HTML("<i>overflow tracer not run</i>")
        name = "fp16" if r.dtype == torch.float16 else "bf16"
        if r.module is None:
            head = f"<p>Every module's activations and gradients fit in <b>{name}</b>.</p>"
        else:
            head = (
                f"<p style='color:#b00020'>First to leave the {name} range: module "
                f"<b>{html.escape(str(r.module))}</b>, op <code>{html.escape(str(r.op))}"
                f"</code>, in the {html.escape(str(r.phase))}.</p>"
            )
        advice = f"<p>{html.escape(r.advice)}</p>" if r.advice else ""
        return w.VBox([w.HTML(head + advice), _html_table(r.table, "no table")])


def _memory_frame(model, x, loss_fn, opt_levels, half_dtype, optimizer, lr, device):
    import mpnb.lab
    from mpnb.lab import workloads

    if not isinstance(x, torch.Tensor):
        return None, "memory: needs a single input tensor (batch first)"
    fn = loss_fn or (lambda out: out.float().pow(2).mean())  # mpnb.lab.profile's default
    wl = workloads.custom(
        lambda: copy.deepcopy(model),
        (x, torch.zeros(len(x))),
        lambda out, _target: fn(out),
        lr=lr,
        batch_size=len(x),
        steps=3,
        name="profiled model",
    )
    levels = tuple(dict.fromkeys(("O0", *opt_levels)))  # compare needs its O0 baseline
    df = mpnb.lab.compare(
        wl,
        opt_levels=levels,
        half_dtype=half_dtype,
        steps=3,
        optimizer=optimizer,
        device=device,
        progress=False,
    )
    return df[df["opt_level"].isin(opt_levels)].reset_index(drop=True), None


def profile(
    model: torch.nn.Module,
    example_inputs,
    loss_fn=None,
    opt_levels=("O0", "O1", "O2", "O3"),
    half_dtype="auto",
    optimizer: str = "adam",
    lr: float = 1e-3,
    steps: int = 5,
    memory: bool = True,
    trace: bool = True,
    device: str | None = None,
    threads: int | None = None,
) -> ProfileWidget:
    """Profile ``model`` under each opt level and show everything in one widget.

    Args:
        model, example_inputs, loss_fn, opt_levels, half_dtype, optimizer, lr, steps, device:
            as for :func:`mpnb.lab.profile` (``loss_fn``: ``output -> scalar loss``).
        memory: also measure the memory breakdown (a 3-step :func:`mpnb.lab.compare` run).
        trace: also run :func:`mpnb.lab.trace_overflow` in the half dtype.
        threads: ``torch.set_num_threads`` while profiling (restored after; None: unchanged).

    Example::

        >>> mpnb.widgets.profile(model, torch.randn(64, 784), opt_levels=("O0", "O2"))
    """
    import mpnb.lab
    from mpnb.core.hardware import default_half_dtype
    from mpnb.lab.config import resolve_device

    p = next(model.parameters(), None)
    dev = resolve_device(device or (p.device if p is not None else "cpu"))
    if half_dtype in (None, "auto"):
        half = "bf16" if default_half_dtype(dev) == torch.bfloat16 else "fp16"
    else:
        half = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(half_dtype, half_dtype)
    with torch_threads(threads):
        result = mpnb.lab.profile(
            model, example_inputs, loss_fn, opt_levels, half, optimizer, lr, steps, device=dev
        )
        mem, tr, errors = _extras(
            model, example_inputs, loss_fn, opt_levels, half, optimizer, lr, dev, memory, trace
        )
    return ProfileWidget(result, mem, tr, device=dev, errors=errors)


def _extras(model, example_inputs, loss_fn, opt_levels, half, optimizer, lr, dev, memory, trace):
    import mpnb.lab
    from mpnb.core.amp import HALF_DTYPES

    errors, mem, tr = {}, None, None
    if memory:
        try:
            mem, why = _memory_frame(
                model, example_inputs, loss_fn, opt_levels, half, optimizer, lr, dev
            )
            if why:
                errors["memory"] = why
            for r in mem.itertuples() if mem is not None else ():
                if r.error:
                    errors[f"memory ({r.configuration})"] = r.error
        except Exception as e:  # noqa: BLE001 - shown in the widget
            errors["memory"] = f"{type(e).__name__}: {e}"
    if trace:
        try:
            tr = mpnb.lab.trace_overflow(model, example_inputs, loss_fn, dtype=HALF_DTYPES[half])
        except Exception as e:  # noqa: BLE001 - shown in the widget
            errors["overflow tracer"] = f"{type(e).__name__}: {e}"
    return mem, tr, errors
