"""``CompareWidget``: the opt levels compared on your hardware, as an interactive view.

The widget turns its controls into :func:`mpnb.lab.compare` calls and draws the DataFrames
they return; it measures nothing itself. So that results appear as each configuration
finishes (and Stop can end a run between configurations), it runs one call per
configuration: the O0 baseline first, then each other configuration paired with a fresh O0
run (round-robin in one process, so ``speedup_vs_O0`` is the median of per-step ratios
against a baseline that ran at the same time). Only the requested configuration's row of
each call is kept.
"""

from __future__ import annotations

import threading

import ipywidgets as w
import pandas as pd
import traitlets as t

from mpnb.widgets._common import ErrorBox, hardware_html
from mpnb.widgets._compare_controls import LEVELS, ControlsMixin, parse_sizes
from mpnb.widgets._compare_views import ResultViews, errors_html, table_html

__all__ = ["CompareWidget", "compare"]


def _lab():
    import mpnb.lab

    return mpnb.lab


class CompareWidget(ControlsMixin, w.VBox):
    """Controls, a Run/Stop pair, a progress bar and result tabs over :func:`mpnb.lab.compare`.

    Args:
        workload: a built-in workload name or a :class:`mpnb.lab.workloads.Workload`.
        opt_levels, half_dtype, batch_sizes, steps, optimizer, device: the initial controls.
        loss_scale: None (each opt level's default), a number (static) or a dict of
            ``init_scale``, ``growth_factor``, ``backoff_factor``, ``growth_interval``.
        threaded: run in a background thread when Run is clicked (tests pass False).
        threads: ``torch.set_num_threads`` for the runs (None: torch's default); on a shared
            machine with few cores, 1 avoids threads waiting on each other.

    Attributes:
        df: the results so far (a :func:`mpnb.lab.compare` DataFrame with ``attrs``).
        running: True while a run is in progress.

    Example::

        >>> cw = CompareWidget("mlp", opt_levels=("O0", "O2"), steps=20, threaded=False)
        >>> cw.run_button.click()
        >>> cw.df[["configuration", "step_time_ms", "metric"]]
    """

    #: bumped whenever :attr:`df` changes (a DataFrame cannot be a traitlet: ``==`` is
    #: element-wise), observed to redraw
    version = t.Int(0).tag(sync=False)
    running = t.Bool(False).tag(sync=False)

    @property
    def df(self) -> pd.DataFrame | None:
        """The results so far (a :func:`mpnb.lab.compare` DataFrame), or None."""
        return self._df

    @df.setter
    def df(self, value: pd.DataFrame | None) -> None:
        self._df = value
        self.version += 1

    def __init__(
        self,
        workload="mlp",
        opt_levels=LEVELS,
        half_dtype="auto",
        batch_sizes=(32,),
        steps: int = 30,
        optimizer: str = "adam",
        device: str = "auto",
        loss_scale=None,
        threaded: bool = True,
        threads: int | None = None,
    ):
        self.threaded = threaded
        self._df: pd.DataFrame | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._workload = workload
        self.errors = ErrorBox()
        self.views = ResultViews()
        self._build_controls(
            opt_levels, half_dtype, batch_sizes, steps, optimizer, device, loss_scale, threads
        )
        self.table, self.config_errors = w.HTML(table_html(None)), w.HTML()
        self.hardware = w.HTML(hardware_html(self._device()))
        v = self.views
        self.tabs = w.Tab(
            children=[
                v.speed,
                v.memory,
                w.VBox([v.accuracy, v.loss_curves]),
                v.loss_scale,
                self.table,
                self.hardware,
            ]
        )
        for i, title in enumerate(
            ("Speed", "Memory", "Accuracy", "Loss scale", "Table", "Hardware")
        ):
            self.tabs.set_title(i, title)
        super().__init__([self.controls, self.actions, self.config_errors, self.tabs, self.errors])
        self.observe(self.errors.guard(self._draw), names=["version"])
        self.observe(self._toggle_buttons, names=["running"])

    # ---- running ----------------------------------------------------------------------------

    def plan(self) -> list[tuple[tuple[str, ...], int]]:
        """The :func:`mpnb.lab.compare` calls a run makes: ``(opt_levels, batch_size)`` each."""
        levels = [lvl for lvl in LEVELS if lvl in self.opt_levels.value]
        if not levels:
            raise ValueError("choose at least one opt level.")
        calls = []
        for b in parse_sizes(self.batch_sizes.value):
            calls += [(("O0",), b)] if "O0" in levels else []
            calls += [(("O0", lvl), b) for lvl in levels if lvl != "O0"]
        return calls

    def run(self, _keep_stop: bool = False) -> pd.DataFrame:
        """Run every configuration now, in this thread; returns (and keeps) the DataFrame."""
        calls = self.plan()
        if not _keep_stop:
            self._stop.clear()
        workload = (
            self._workload
            if self.workload.value == getattr(self._workload, "name", self._workload)
            else self.workload.value
        )
        kw = dict(
            half_dtype=self.half_dtype.value,
            steps=int(self.steps.value),
            optimizer=self.optimizer.value,
            device=self._device(),
            loss_scale=self.loss_scale(),
            threads=self.threads.value or None,
            progress=False,
        )
        self.running, self.df = True, None
        self.views.clear()
        self.config_errors.value = ""
        self.progress.max, self.progress.value = len(calls), 0
        frames, hists = [], []
        try:
            for i, (levels, b) in enumerate(calls):
                if self._stop.is_set():
                    self.status.value = f"stopped after {i} of {len(calls)} configurations"
                    break
                self.status.value = f"running {levels[-1]} b{b} ({i + 1}/{len(calls)})"
                got = _lab().compare(workload, opt_levels=levels, batch_sizes=(b,), **kw)
                row = got[got["opt_level"] == levels[-1]].copy()
                row.attrs = {}  # concat compares attrs, and ours hold DataFrames
                hist = got.attrs["history"]
                frames.append(row)
                hists.append(hist[hist["configuration"].isin(row["configuration"])])
                df = pd.concat(frames, ignore_index=True)
                df.attrs = dict(
                    got.attrs,
                    history=pd.concat(hists, ignore_index=True),
                    method="one compare() per configuration, each paired with a "
                    "fresh O0 run (round-robin)",
                )
                self.df = df
                self.progress.value = i + 1
            else:
                self.status.value = f"done: {len(calls)} configurations"
        finally:
            self.running = False
        return self.df

    def _on_run(self):
        if self.running:
            return
        if not self.threaded:
            self.run()
            return
        self.plan()  # bad controls: the error shows now, nothing starts
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
        """Stop after the configuration in progress (its row is kept)."""
        self._stop.set()
        self.status.value = "stopping after the configuration in progress..."

    def join(self, timeout: float | None = None) -> bool:
        """Wait for a threaded run; True when it has finished."""
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True

    def _toggle_buttons(self, change):
        self.run_button.disabled = change["new"]
        self.stop_button.disabled = not change["new"]

    # ---- drawing and export -----------------------------------------------------------------

    def _draw(self, change=None):
        df = self.df
        self.table.value = table_html(df)
        self.config_errors.value = errors_html(df)
        if df is None:
            return
        self.views.update(df)
        hw = df.attrs.get("hardware", {})
        self.hardware.value = hardware_html(self._device()) + (
            f"<p><b>Measured on:</b> {hw.get('summary', '')}; method: "
            f"{df.attrs.get('method', '')}</p>"
        )

    def _require_df(self) -> pd.DataFrame:
        if self.df is None or self.df.empty:
            raise RuntimeError("nothing to export yet: press Run first.")
        return self.df

    def export_csv(self, path: str | None = None) -> str:
        """Write the results as CSV (default ``<file stem>.csv``); returns the path."""
        path = path or f"{self.export_path.value}.csv"
        self._require_df().to_csv(path, index=False)
        self.status.value = f"wrote {path}"
        return path

    def export_html(self, path: str | None = None) -> str:
        """Write the HTML report of :func:`mpnb.lab.report` (default ``<file stem>.html``)."""
        path = path or f"{self.export_path.value}.html"
        _lab().report(self._require_df(), path)
        self.status.value = f"wrote {path}"
        return path


def compare(workload="mlp", run: bool = False, **kwargs) -> CompareWidget:
    """Make a :class:`CompareWidget` (shown when it is a cell's last expression).

    Args:
        workload: as for :class:`CompareWidget`.
        run: start the run at once (in a thread unless ``threaded=False``).
        **kwargs: the other arguments of :class:`CompareWidget` (``opt_levels``,
            ``half_dtype``, ``batch_sizes``, ``steps``, ``optimizer``, ``device``,
            ``loss_scale``, ``threaded``, ``threads``).

    Example::

        >>> cw = mpnb.widgets.compare("mlp", opt_levels=("O0", "O1", "O2"), steps=20)
        >>> cw
    """
    cw = CompareWidget(workload, **kwargs)
    if run:
        cw.run_button.click()
    return cw
