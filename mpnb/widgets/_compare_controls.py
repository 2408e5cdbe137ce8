"""The controls of :class:`~mpnb.widgets.CompareWidget` (a mixin: the widget's own attributes).

They hold the request (workload, opt levels, half dtype with its hardware status, batch
sizes, steps, optimizer, device, loss scaler) and turn it into :func:`mpnb.lab.compare`
arguments; nothing runs here.
"""

from __future__ import annotations

import ipywidgets as w
import torch

from mpnb.widgets._common import half_status_label, hardware_html

__all__ = ["ControlsMixin", "LEVELS", "OPTIMIZERS", "parse_sizes"]

LEVELS = ("O0", "O1", "O2", "O3")
OPTIMIZERS = ("adam", "adamw", "sgd", "fused_adam", "fused_sgd")


def parse_sizes(text: str) -> tuple[int, ...]:
    """``"32, 64"`` -> ``(32, 64)``; a clear ValueError otherwise."""
    try:
        sizes = tuple(int(s) for s in text.replace(";", ",").split(",") if s.strip())
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1:
        raise ValueError(f"batch sizes {text!r}: give positive integers separated by commas.")
    return sizes


class ControlsMixin:
    """Builds the control widgets as attributes of the widget and reads them back."""

    # ---- controls ---------------------------------------------------------------------------

    def _build_controls(
        self, opt_levels, half_dtype, batch_sizes, steps, optimizer, device, loss_scale, threads
    ):
        from mpnb.lab import workloads

        names = list(workloads.names())
        wl = self._workload if isinstance(self._workload, str) else self._workload.name
        self.workload = w.Dropdown(
            options=list(dict.fromkeys([wl, *names])), value=wl, description="workload"
        )
        self.opt_levels = w.SelectMultiple(
            options=LEVELS, value=tuple(opt_levels), rows=4, description="opt levels"
        )
        devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
        dev = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
        self.device = w.Dropdown(options=devices, value=dev, description="device")
        self.half_dtype = w.ToggleButtons(description="half dtype")
        self._half_options(half_dtype)
        self.device.observe(self.errors.guard(lambda _: self._device_changed()), names="value")
        self.batch_sizes = w.Text(", ".join(map(str, batch_sizes)), description="batch sizes")
        self.steps = w.BoundedIntText(steps, min=4, max=100000, description="steps")
        self.optimizer = w.Dropdown(options=OPTIMIZERS, value=optimizer, description="optimizer")
        self.threads = w.BoundedIntText(
            threads or 0,
            min=0,
            max=1024,
            description="threads",
            tooltip="torch threads for the runs (0: torch's default)",
        )
        self._scaler_controls(loss_scale)
        self.controls = w.Accordion(
            children=[
                w.HBox(
                    [
                        w.VBox([self.workload, self.device, self.half_dtype, self.opt_levels]),
                        w.VBox([self.batch_sizes, self.steps, self.optimizer, self.threads]),
                        w.VBox(
                            [
                                self.scale_mode,
                                self.init_scale,
                                self.growth_factor,
                                self.backoff_factor,
                                self.growth_interval,
                                self.static_scale,
                            ]
                        ),
                    ]
                )
            ],
            selected_index=0,
        )
        self.controls.set_title(0, "Configurations")
        self.run_button = w.Button(description="Run", button_style="primary", icon="play")
        self.stop_button = w.Button(description="Stop", icon="stop", disabled=True)
        wide = w.Layout(width="auto")
        self.csv_button = w.Button(description="Export CSV", icon="download", layout=wide)
        self.html_button = w.Button(description="Export HTML report", icon="file", layout=wide)
        self.export_path = w.Text("mpnb-compare", description="file stem")
        self.progress = w.IntProgress(value=0, min=0, max=1, description="progress")
        self.status = w.Label("ready")
        self.run_button.on_click(self.errors.guard(lambda _: self._on_run()))
        self.stop_button.on_click(self.errors.guard(lambda _: self.stop()))
        self.csv_button.on_click(self.errors.guard(lambda _: self.export_csv()))
        self.html_button.on_click(self.errors.guard(lambda _: self.export_html()))
        self.actions = w.VBox(
            [
                w.HBox([self.run_button, self.stop_button, self.progress, self.status]),
                w.HBox([self.export_path, self.csv_button, self.html_button]),
            ]
        )

    def _scaler_controls(self, loss_scale):
        spec = loss_scale if isinstance(loss_scale, dict) else {}
        mode = (
            "default"
            if loss_scale is None
            else "dynamic"
            if spec or loss_scale == "dynamic"
            else "static"
        )
        self.scale_mode = w.Dropdown(
            options=["default", "dynamic", "static"], value=mode, description="loss scale"
        )
        self.init_scale = w.FloatLogSlider(
            spec.get("init_scale", 2.0**16),
            base=2,
            min=0,
            max=24,
            step=1,
            description="initial scale",
        )
        self.growth_factor = w.BoundedFloatText(
            spec.get("growth_factor", 2.0), min=1.0, max=16.0, step=0.5, description="growth"
        )
        self.backoff_factor = w.BoundedFloatText(
            spec.get("backoff_factor", 0.5), min=0.01, max=1.0, step=0.05, description="backoff"
        )
        self.growth_interval = w.BoundedIntText(
            spec.get("growth_interval", 2000), min=1, max=10**6, description="interval"
        )
        static = float(loss_scale) if mode == "static" else 2.0**10
        self.static_scale = w.FloatLogSlider(
            static, base=2, min=0, max=24, step=1, description="static scale"
        )

    def _device(self) -> str:
        return self.device.value

    def _half_options(self, value="auto"):
        if value == "auto" or value is None:
            value = "fp16" if self._device().startswith("cuda") else "bf16"
        self.half_dtype.options = [
            (half_status_label(n, self._device()), n) for n in ("bf16", "fp16")
        ]
        self.half_dtype.value = value

    def _device_changed(self):
        self._half_options(self.half_dtype.value)
        self.hardware.value = hardware_html(self._device())

    def loss_scale(self):
        """The loss-scale argument for :func:`mpnb.lab.compare` from the scaler controls."""
        if self.scale_mode.value == "default":
            return None
        if self.scale_mode.value == "static":
            return float(self.static_scale.value)
        return dict(
            init_scale=float(self.init_scale.value),
            growth_factor=float(self.growth_factor.value),
            backoff_factor=float(self.backoff_factor.value),
            growth_interval=int(self.growth_interval.value),
        )
