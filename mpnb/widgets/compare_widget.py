"""``CompareWidget``: the opt levels compared on your hardware, as an interactive view.

The widget turns its controls into **one** :func:`mpnb.lab.compare` call (every configuration
round-robin in one process, so the speed figure is the one ``compare`` computes; the peers,
``torch-amp``, ``tf32`` and ``torch-amp+compile``, are offered beside mpnb's) and draws
the DataFrame it returns, each row's code to train that way in its Code tab; it measures
nothing itself. With ``ranks`` of 2 or more the call is
``compare(..., ranks=, strategy=)``: the DDP and FSDP2 precision policies on that many local
ranks, drawn as memory per rank by role, bytes on the wire and loss against one fp32 process,
with the scale-out estimate beside them. Progress (configuration, step, ETA)
comes from ``compare``'s ``on_progress``; Stop is its ``should_stop``: the run ends after the
step in progress and the rows keep what was measured, marked ``interrupted``.
"""

from __future__ import annotations

import html
import threading

import ipywidgets as w
import pandas as pd
import traitlets as t

import mpnb.lab
from mpnb.lab import workloads
from mpnb.lab.config import DEFAULT_OPTIMIZER, configs_argument, resolve_device
from mpnb.lab.runner import DISTRIBUTED_OPTIMIZER
from mpnb.widgets._common import ErrorBox, hardware_html
from mpnb.widgets._compare_controls import DEFAULT_LEVELS, LEVELS, ControlsMixin, parse_sizes
from mpnb.widgets._compare_views import (
    ResultViews,
    code_html,
    errors_html,
    table_html,
    verdict_html,
)
from mpnb.widgets._distributed_views import (
    DistributedViews,
    dist_errors_html,
    dist_page_html,
    dist_table_html,
    dist_verdict_html,
    estimate_html,
)

__all__ = ["CompareWidget", "compare", "run_status"]


def _lab():
    return mpnb.lab


class CompareWidget(ControlsMixin, w.VBox):
    """The verdict, controls, Run/Stop, progress and result tabs over :func:`mpnb.lab.compare`.

    Args:
        workload: a built-in workload name, a :class:`mpnb.lab.workloads.Workload`, or your
            model factory (with ``data``).
        data, loss_fn, metric_fn, eval_data: with a model factory, as for
            :func:`mpnb.lab.compare`.
        configs, half_dtype, batch_sizes, steps, optimizer, device, size: the initial
            controls (``batch_sizes`` and ``steps`` None: the workload's own, shown in their
            boxes; choosing another workload puts its own batch size and steps there;
            ``optimizer`` None: ``fused_adam``, or ``adam`` with ``ranks``).
        loss_scale: None (each opt level's default), or what ``amp.initialize`` takes: a
            number (static), ``"dynamic"``, a :class:`~mpnb.amp.LossScaleRule` or a dict of its
            fields (the controls show ``init_scale``, ``growth_factor``, ``backoff_factor``,
            ``growth_interval``).
        threaded: run in a background thread when Run is clicked (tests pass False).
        threads: ``torch.set_num_threads`` for the runs (None: torch's default).
        opt_levels: the former name of ``configs`` (give one of the two).
        ranks: local processes (1: one process, the opt levels as before; 2 or more: the
            distributed precision policies of ``strategy``, one row each).
        strategy: ``"ddp"``, ``"fsdp2"`` or None/``"both"``, with ``ranks`` >= 2 (then
            ``configs`` names policies of
            :data:`mpnb.core.precision_configs.DISTRIBUTED_CONFIGS`; None: the strategy's).

    Attributes:
        df: the results (a :func:`mpnb.lab.compare` DataFrame with ``attrs``).
        running: True while a run is in progress.

    Example::

        >>> cw = CompareWidget("transformer", configs=("O0", "O2"), threaded=False)
        >>> cw.run_button.click()
        >>> cw.df[["configuration", "speed_label", "metric"]]
        >>> cw = CompareWidget("transformer", ranks=2, strategy="fsdp2", threaded=False)
        >>> cw.run_button.click()
        >>> cw.df[["policy", "mem_sharded_params_mib", "bytes_sent_per_step", "loss_vs_fp32"]]
    """

    #: bumped whenever :attr:`df` changes (a DataFrame cannot be a traitlet), observed to redraw
    version = t.Int(0).tag(sync=False)
    running = t.Bool(False).tag(sync=False)

    @property
    def df(self) -> pd.DataFrame | None:
        """The results of the last run (a :func:`mpnb.lab.compare` DataFrame), or None."""
        return self._df

    @df.setter
    def df(self, value: pd.DataFrame | None) -> None:
        self._df = value
        self.version += 1

    def __init__(
        self,
        workload="transformer",
        data=None,
        loss_fn=None,
        metric_fn=None,
        eval_data=None,
        configs=None,
        half_dtype="auto",
        batch_sizes=None,
        steps: int | None = None,
        optimizer: str | None = None,
        device: str = "auto",
        loss_scale=None,
        threaded: bool = True,
        threads: int | None = None,
        size: str = "auto",
        opt_levels=None,
        ranks: int = 1,
        strategy: str | None = None,
    ):
        if data is not None or not isinstance(workload, (str, workloads.Workload)):
            workload = workloads.custom(workload, data, loss_fn, metric_fn, eval_data)
        self.threaded = threaded
        self._df: pd.DataFrame | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._workload = workload
        # errors beside their cause: the run's under Run, the export's under the export row
        self.errors, self.export_errors = ErrorBox(), ErrorBox()
        self.config_errors = w.HTML()  # the configurations that failed in the last run
        self.views = ResultViews()
        self.dist_views = DistributedViews()
        default = workloads.get(workload, size, resolve_device(device))  # the device's sizes
        # refuses both names at once; none named: the device's defaults (tf32 on CUDA too)
        named = configs_argument(configs, opt_levels, device)
        # with several ranks, the configurations named are distributed policies (None: all)
        many = int(ranks or 1) > 1
        policies = (configs if configs is not None else opt_levels) if many else None
        self._build_controls(
            DEFAULT_LEVELS if policies is not None else named,
            half_dtype,
            batch_sizes or (default.batch_size,),
            steps or default.steps,
            optimizer or (DISTRIBUTED_OPTIMIZER if many else DEFAULT_OPTIMIZER),
            device,
            loss_scale,
            threads,
            size,
            ranks,
            strategy,
            policies,
        )
        self.table = w.HTML(table_html(None))
        self.code = w.HTML(code_html(None))  # each row's lines to train that way, to copy
        self.verdict = w.HTML(verdict_html(None))
        self.hardware = w.HTML(hardware_html(self._device()))
        self.estimate = w.HTML("<i>The scale-out estimate appears after a run on 2+ ranks.</i>")
        self.tabs = w.Tab()
        self._show_tabs(distributed=self.ranks.value > 1)
        super().__init__([self.verdict, self.controls, self.actions, self.tabs])
        self.observe(self.errors.guard(self._draw), names=["version"])
        self.observe(self._toggle_buttons, names=["running"])
        self.size.disabled = not isinstance(workload, str)  # a custom workload has one size
        self.workload.observe(self.errors.guard(self._workload_changed), names="value")
        self.size.observe(self.errors.guard(self._workload_changed), names="value")
        self.validate()

    def _show_tabs(self, distributed: bool) -> None:
        """The one-process tabs, or those of a run on several ranks (same Table, Hardware)."""
        o, d = self.views.outputs, self.dist_views.outputs
        if distributed:
            tabs = [
                ("Memory per rank", d["memory"]),
                ("Bytes on the wire", d["wire"]),
                ("Loss vs fp32", d["loss"]),
                ("Table", self.table),
                ("Scale-out estimate", self.estimate),
                ("Hardware", self.hardware),
            ]
        else:
            tabs = [
                ("Speed", o["speed"]),
                ("Memory", o["memory"]),
                ("Accuracy", o["accuracy"]),
                ("Loss", o["loss_curves"]),
                ("Loss scale", o["loss_scale"]),
                ("Table", self.table),
                ("Code", self.code),
                ("Hardware", self.hardware),
            ]
        self.tabs.children = [c for _, c in tabs]
        self.tabs.titles = tuple(title for title, _ in tabs)

    def _workload_changed(self, change=None):
        named = self.workload.value
        own = getattr(self._workload, "name", self._workload)
        wl = self._workload if named == own else named
        self.size.disabled = not isinstance(wl, str)
        new = workloads.get(wl, self.size.value, self._device())
        self.steps.value = new.steps
        self.batch_sizes.value = str(new.batch_size)  # each workload's own batch size

    # ---- running ----------------------------------------------------------------------------

    def request(self) -> dict:
        """The :func:`mpnb.lab.compare` arguments the controls stand for (ValueError if bad)."""
        errs = self.input_errors()
        if errs:
            raise ValueError("; ".join(errs.values()))
        named = self.workload.value
        own = getattr(self._workload, "name", self._workload)
        ranks = int(self.ranks.value)
        many = {}
        if ranks > 1:
            many = dict(ranks=ranks, strategy=self.strategy.value, configs=self.policy_names())
        return (
            dict(
                workload=self._workload if named == own else named,
                size=self.size.value,
                configs=tuple(name for name in LEVELS if name in self.opt_levels.value),
                half_dtype=self.half_dtype.value,
                batch_sizes=parse_sizes(self.batch_sizes.value) or None,
                steps=int(self.steps.value),
                optimizer=self.optimizer.value,
                device=self._device(),
                loss_scale=self.loss_scale(),
                threads=self.threads.value or None,
            )
            | many
        )

    def run(self, _keep_stop: bool = False) -> pd.DataFrame:
        """Run every configuration now, in this thread; returns (and keeps) the DataFrame."""
        kw = self.request()
        if not _keep_stop:
            self._stop.clear()
        self.running = True
        self.views.clear()
        self.dist_views.clear()
        self.config_errors.value = ""
        self.errors.clear()
        self.export_errors.clear()  # "nothing to export yet" and the like no longer hold
        self.status.value = "starting..."
        try:
            df = _lab().compare(
                **kw, progress=False, on_progress=self._on_progress, should_stop=self._stop.is_set
            )
            self.status.value = html.escape(run_status(df))
            self.df = df
        except Exception as e:
            self.status.value = f"failed: {type(e).__name__} (see the error below)"
            raise
        finally:
            self.running = False
        return self.df

    def _on_progress(self, p: dict) -> None:
        self.progress.max, self.progress.value = p["total"], p["done"]
        # a run on several ranks names its rows by policy
        name = p.get("configuration") or p.get("policy", "")
        self.status.value = (
            f"{name}: step {p['step']}/{p['steps']} - "
            f"{p['done']}/{p['total']} steps, ETA {p['eta_s']:.0f} s"
        )

    def _on_run(self):
        if self.running:
            return
        if not self.validate():
            raise ValueError(
                "; ".join(self.input_errors().values()) + " (fix it beside the control)"
            )
        if not self.threaded:
            self.run()
            return
        self.request()  # bad controls: the error shows now, nothing starts
        self._stop.clear()
        self.running = True  # disable Run at once, before the thread starts
        self._thread = threading.Thread(
            target=self.errors.guard(self._run_in_thread), name="mpnb-compare", daemon=True
        )
        self._thread.start()

    def _run_in_thread(self):
        try:
            self.run(_keep_stop=True)
        finally:
            self.running = False

    def stop(self) -> None:
        """End the run after the step in progress (the measured rows are kept)."""
        self._stop.set()
        self.status.value = "stopping after the step in progress..."

    def join(self, timeout: float | None = None) -> bool:
        """Wait for a threaded run; True when it has finished."""
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True

    def _toggle_buttons(self, change):
        self.stop_button.disabled = not change["new"]
        self.validate()

    # ---- drawing and export -----------------------------------------------------------------

    def _draw(self, change=None):
        df = self.df
        if df is not None and "distributed" in df.attrs:
            self._draw_distributed(df)
            return
        self._show_tabs(distributed=False)
        self.table.value = table_html(df)
        self.code.value = code_html(df)
        self.config_errors.value = errors_html(df)
        self.verdict.value = verdict_html(df)
        if df is None:
            return
        self.views.update(df)
        hw, load = df.attrs.get("hardware", {}), df.attrs.get("load", {})
        self.hardware.value = hardware_html(self._device()) + (
            f"<p><b>Measured on:</b> {hw.get('summary', '')}; method: "
            f"{df.attrs.get('method', '')}; load average {load.get('start')} at the start, "
            f"{load.get('end')} at the end.</p>"
        )

    def _draw_distributed(self, df: pd.DataFrame) -> None:
        self._show_tabs(distributed=True)
        self.table.value = dist_table_html(df)
        self.config_errors.value = dist_errors_html(df)
        self.verdict.value = dist_verdict_html(df)
        self.dist_views.update(df)
        self.estimate.value = estimate_html(df)
        meta = df.attrs["distributed"]
        self.hardware.value = hardware_html(self._device()) + (
            f"<p><b>Ranks:</b> {meta.get('ranks')} local processes, strategy "
            f"{meta.get('strategy')}, global batch {meta.get('global_batch')}.</p>"
        )

    def _require_df(self) -> pd.DataFrame:
        if self.df is None or self.df.empty:
            raise RuntimeError("nothing to export yet: press Run first.")
        return self.df

    def _export(self, path: str, write) -> str:
        """Run ``write(df, path)``; the status line says what happened, never "wrote" on error."""
        try:
            write(self._require_df(), path)
        except Exception as e:
            self.status.value = (
                f"export failed: {type(e).__name__} (see the error under the export buttons)"
            )
            raise
        self.export_errors.clear()  # an old error no longer describes the state
        bad = int((self.df["status"] == "error").sum())
        self.status.value = html.escape(
            f"wrote {path}"
            + (f" ({bad} configuration(s) failed: their rows hold the error)" if bad else "")
        )
        return path

    def export_csv(self, path: str | None = None) -> str:
        """Write the results as CSV (default ``<file stem>.csv``); returns the path."""
        path = path or f"{self.export_path.value}.csv"
        return self._export(path, lambda df, p: df.to_csv(p, index=False))

    def export_html(self, path: str | None = None) -> str:
        """Write the HTML report of :func:`mpnb.lab.report` (default ``<file stem>.html``); a
        run on several ranks writes its own figures, table and estimate."""
        path = path or f"{self.export_path.value}.html"
        return self._export(path, self._write_html)

    def _write_html(self, df: pd.DataFrame, path: str) -> None:
        if "distributed" not in df.attrs:
            _lab().report(df, path)
            return
        page = dist_page_html(df, self.dist_views, "mpnb compare on several ranks")
        with open(path, "w", encoding="utf-8") as f:
            f.write(page)


def run_status(df: pd.DataFrame) -> str:
    """The status line after a run: how many configurations finished, failed, were
    interrupted (and after how many steps) or never started.

    Example::

        >>> run_status(df)
        'stopped: 3 of 6 configurations interrupted at step 22-23 of 400, 3 not started; ...'
    """
    n = len(df)
    bad = int((df["status"] == "error").sum())
    failed = f", {bad} failed" if bad else ""
    if not df.attrs.get("stopped"):
        if "distributed" in df.attrs:
            ranks = df.attrs["distributed"].get("ranks")
            return f"done: {n} polic{'ies' if n != 1 else 'y'} on {ranks} ranks{failed}"
        return f"done: {n} configuration{'s' if n != 1 else ''}{failed}"
    cut = df[(df["status"] == "interrupted") & (df["steps_done"] > 0)]
    never = int(((df["status"] == "interrupted") & (df["steps_done"] == 0)).sum())
    parts = []
    if len(cut):
        lo, hi, of = cut["steps_done"].min(), cut["steps_done"].max(), cut["steps"].max()
        at = f"{lo}" if lo == hi else f"{lo}-{hi}"
        parts.append(f"{len(cut)} of {n} configurations interrupted at step {at} of {of}")
    if never:
        parts.append(f"{never} of {n} not started")
    done = int((df["status"] == "ok").sum())
    if done:
        parts.append(f"{done} finished")
    return f"stopped: {', '.join(parts)}{failed}; every finished step is kept"


def compare(workload="transformer", data=None, run: bool = False, **kwargs) -> CompareWidget:
    """Make a :class:`CompareWidget` (shown when it is a cell's last expression).

    Args:
        workload: a built-in name, a Workload, or your model factory (with ``data``).
        data: your training data (see :func:`mpnb.lab.compare`).
        run: start the run at once (in a thread unless ``threaded=False``).
        **kwargs: the other arguments of :class:`CompareWidget` (``loss_fn``, ``metric_fn``,
            ``configs``, ``half_dtype``, ``batch_sizes``, ``steps``, ``size``, ...).

    Example::

        >>> cw = mpnb.widgets.compare("transformer", configs=("O0", "O1", "O2"))
        >>> cw = mpnb.widgets.compare(lambda: MyCNN(), (x, y), metric_fn=mpnb.lab.accuracy)
    """
    cw = CompareWidget(workload, data, **kwargs)
    if run:
        cw.run_button.click()
    return cw
