"""The controls of :class:`~mpnb.widgets.CompareWidget` (a mixin: the widget's own attributes).

They hold the request (workload and size, configurations, half dtype with its hardware status,
batch sizes, steps, optimizer, device, threads, loss scaler) and turn it into
:func:`mpnb.lab.compare` arguments; nothing runs here. Every control is validated when it
changes: a bad value shows its message right beside the control and disables Run until
it is fixed.
"""

from __future__ import annotations

import html
import os

import ipywidgets as w
import torch

from mpnb.core.amp import LossScaleRule
from mpnb.core.dtype_names import HALF_NAMES, default_half_dtype, short_name
from mpnb.core.precision_configs import (
    DEFAULT_CONFIGS,
    OPTIMIZERS,
    STRATEGIES,
    config_names,
    distributed_names,
)
from mpnb.lab import workloads
from mpnb.widgets._common import half_status_label, hardware_html

__all__ = ["ControlsMixin", "LEVELS", "DEFAULT_LEVELS", "OPTIMIZERS", "parse_sizes"]

# Every configuration mpnb compares (O0-O3, the peers torch-amp, tf32 and torch-amp+compile,
# the FP8 recipes, pure bf16 and its optimizer options), from the one list in
# mpnb.core.precision_configs; the widget starts with compare's default (the O levels and
# torch-amp on a CPU; tf32 too on CUDA).
LEVELS = config_names()
DEFAULT_LEVELS = DEFAULT_CONFIGS
SIZES = ("auto", "small", "medium", "large", "gpu")  # gpu: sized for the CUDA card
#: the strategy control's choices ("both": every DDP and FSDP2 policy)
STRATEGY_CHOICES = ("both", *STRATEGIES)


def parse_sizes(text: str) -> tuple[int, ...]:
    """``"32, 64"`` -> ``(32, 64)``; ``""`` -> ``()`` (the workload's); a clear ValueError."""
    parts = [s.strip() for s in text.replace(";", ",").split(",") if s.strip()]
    try:
        sizes = tuple(int(s) for s in parts)
    except ValueError:
        sizes = (0,)
    if sizes and min(sizes) < 1:
        raise ValueError(
            f"batch sizes {text!r}: give positive integers separated by commas "
            "(or leave empty for the workload's own)."
        )
    return sizes


#: one column of controls, as wide as its controls (never squeezed: a squeezed column clipped
#: them); the columns wrap onto the next line when the notebook is narrow
_COLUMN = dict(flex="0 0 auto", margin="0 6px 0 0")


def _err() -> w.HTML:
    # Below its control and as wide as it: a message beside a control was squeezed to one
    # word a line (or out of sight) when the notebook was narrow or several were shown.
    return w.HTML("", layout=w.Layout(width="300px", margin="0 0 4px 0"))


def _row(control, err) -> w.VBox:
    return w.VBox([control, err])


def _message(text: str, color: str) -> str:
    return (
        f"<div style='color:{color};font-size:12px;line-height:1.3;white-space:normal'>{text}</div>"
    )


class ControlsMixin:
    """Builds the control widgets as attributes of the widget, validates and reads them."""

    def _build_controls(
        self,
        configs,
        half_dtype,
        batch_sizes,
        steps,
        optimizer,
        device,
        loss_scale,
        threads,
        size,
        ranks=1,
        strategy=None,
        policies=None,
    ):
        names = list(workloads.names())
        wl = self._workload if isinstance(self._workload, str) else self._workload.name
        self.workload = w.Dropdown(
            options=list(dict.fromkeys([wl, *names])), value=wl, description="workload"
        )
        self.size = w.Dropdown(options=SIZES, value=size, description="size")
        # every configuration in view (a scrolled list hid the FP8 and pure-bf16 rows)
        self.opt_levels = w.SelectMultiple(
            options=LEVELS, value=tuple(configs), rows=len(LEVELS), description="opt levels"
        )
        devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
        dev = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
        self.device = w.Dropdown(options=devices, value=dev, description="device")
        self.half_dtype = w.ToggleButtons(description="half dtype")
        self._half_options(half_dtype)
        self.device.observe(self.errors.guard(lambda _: self._device_changed()), names="value")
        self.batch_sizes = w.Text(
            ", ".join(map(str, batch_sizes or ())),
            placeholder="the workload's",
            description="batch sizes",
        )
        self.steps = w.IntText(steps or 0, description="steps")
        self.optimizer = w.Dropdown(options=OPTIMIZERS, value=optimizer, description="optimizer")
        self.threads = w.IntText(threads or 0, description="threads")
        self.threads.tooltip = "torch threads for the runs (0: torch's default)"
        self._scaler_controls(loss_scale)
        self._distributed_controls(ranks, strategy, policies)
        self.control_errors = {
            k: _err()
            for k in (
                "opt_levels",
                "batch_sizes",
                "steps",
                "threads",
                "growth_factor",
                "backoff_factor",
                "growth_interval",
                "ranks",
                "policies",
            )
        }
        e = self.control_errors
        columns = [
            [
                self.workload,
                self.size,
                self.device,
                self.half_dtype,
                _row(self.opt_levels, e["opt_levels"]),
            ],
            [
                _row(self.batch_sizes, e["batch_sizes"]),
                _row(self.steps, e["steps"]),
                self.optimizer,
                _row(self.threads, e["threads"]),
                _row(self.ranks, e["ranks"]),
                self.strategy,
                _row(self.policies, e["policies"]),
            ],
            [
                self.scale_mode,
                self.init_scale,
                _row(self.growth_factor, e["growth_factor"]),
                _row(self.backoff_factor, e["backoff_factor"]),
                _row(self.growth_interval, e["growth_interval"]),
                self.static_scale,
            ],
        ]
        self.controls = w.Accordion(
            children=[
                w.HBox(
                    [w.VBox(c, layout=w.Layout(**_COLUMN)) for c in columns],
                    layout=w.Layout(flex_flow="row wrap"),
                )
            ],
            selected_index=0,
        )
        self.controls.set_title(0, "Configurations")
        self._build_actions()
        for c in (
            self.opt_levels,
            self.batch_sizes,
            self.steps,
            self.threads,
            self.workload,
            self.scale_mode,
            self.growth_factor,
            self.backoff_factor,
            self.growth_interval,
            self.ranks,
            self.policies,
        ):
            c.observe(lambda _: self.validate(), names="value")

    def _build_actions(self):
        """Run/Stop with the progress, the status line, what failed in the run and the run's
        errors; then the export row with its own errors: each error right under its cause."""
        self.run_button = w.Button(description="Run", button_style="primary", icon="play")
        self.stop_button = w.Button(description="Stop", icon="stop", disabled=True)
        wide = w.Layout(width="auto")
        self.csv_button = w.Button(description="Export CSV", icon="download", layout=wide)
        self.html_button = w.Button(description="Export HTML report", icon="file", layout=wide)
        self.export_path = w.Text("mpnb-compare", description="file stem")
        self.progress = w.IntProgress(value=0, min=0, max=1, description="progress")
        # an HTML line (not a Label, which cuts its text at the right edge): it wraps
        self.status = w.HTML("ready", layout=w.Layout(width="auto", margin="0 0 0 8px"))
        self.status.add_class("mpnb-status")
        self.run_button.on_click(self.errors.guard(lambda _: self._on_run()))
        self.stop_button.on_click(self.errors.guard(lambda _: self.stop()))
        self.csv_button.on_click(self.export_errors.guard(lambda _: self.export_csv()))
        self.html_button.on_click(self.export_errors.guard(lambda _: self.export_html()))
        flow = w.Layout(flex_flow="row wrap", align_items="center")
        self.actions = w.VBox(
            [
                w.HBox([self.run_button, self.stop_button, self.progress], layout=flow),
                self.status,
                self.config_errors,
                self.errors,
                w.HBox([self.export_path, self.csv_button, self.html_button], layout=flow),
                self.export_errors,
            ]
        )

    def _distributed_controls(self, ranks, strategy, policies) -> None:
        """``ranks`` (1: one process, as before), ``strategy`` (DDP, FSDP2 or both) and the
        strategy's ``policies`` (None: all): with 2 or more ranks the run compares distributed
        policies, not opt levels."""
        if strategy not in (None, *STRATEGY_CHOICES):
            raise ValueError(
                f"strategy {strategy!r}: use one of {STRATEGY_CHOICES} (or None for both)."
            )
        self.ranks = w.IntText(int(ranks or 1), description="ranks")
        self.ranks.tooltip = "local processes (2 or more: DDP and FSDP2 policies per rank)"
        self.strategy = w.Dropdown(
            options=STRATEGY_CHOICES, value=strategy or "both", description="strategy"
        )
        offered = distributed_names(strategy)
        chosen = offered if policies is None else tuple(policies)
        wrong = [p for p in chosen if p not in offered]
        if wrong:
            raise ValueError(
                f"policies {wrong} are not {self.strategy.value!r} policies: choose from "
                f"{list(offered)} (or change the strategy)."
            )
        self.policies = w.SelectMultiple(
            options=offered, value=chosen, rows=len(distributed_names()), description="policies"
        )
        self.ranks.observe(lambda _: self._ranks_enabled(), names="value")
        self.strategy.observe(lambda _: self._strategy_changed(), names="value")
        self._ranks_enabled()

    def _strategy_changed(self) -> None:
        """The policies offered are the strategy's, all chosen."""
        offered = distributed_names(self.strategy.value)
        self.policies.options = offered
        self.policies.value = offered

    def _ranks_enabled(self) -> None:
        """Strategy and policies count only on several ranks; the opt levels only on one."""
        many = self.ranks.value > 1
        self.strategy.disabled = self.policies.disabled = not many
        self.opt_levels.disabled = many

    def policy_names(self) -> tuple[str, ...] | None:
        """The policies to compare on several ranks: None when every policy of the strategy is
        chosen (compare's default: those this device offers), else the chosen names."""
        chosen = tuple(self.policies.value)
        return None if set(chosen) == set(self.policies.options) else chosen

    def _scaler_controls(self, loss_scale):
        # the widget's argument is parsed once, as amp.initialize parses it
        rule = LossScaleRule.parse(loss_scale, owner="CompareWidget")
        mode = "default" if rule is None else "dynamic" if rule.dynamic else "static"
        dyn = rule if mode == "dynamic" else LossScaleRule()
        self.scale_mode = w.Dropdown(
            options=["default", "dynamic", "static"], value=mode, description="loss scale"
        )
        self.init_scale = w.FloatLogSlider(
            dyn.init_scale, base=2, min=0, max=24, step=1, description="initial scale"
        )
        # plain text boxes: a bad value is refused beside the control, never clamped
        self.growth_factor = w.FloatText(dyn.growth_factor, step=0.5, description="growth")
        self.backoff_factor = w.FloatText(dyn.backoff_factor, step=0.05, description="backoff")
        self.growth_interval = w.IntText(dyn.growth_interval, description="interval")
        static = rule.init_scale if mode == "static" else 2.0**10
        self.static_scale = w.FloatLogSlider(
            static, base=2, min=0, max=24, step=1, description="static scale"
        )
        self.scale_mode.observe(lambda _: self._scaler_enabled(), names="value")
        self._scaler_enabled()

    def _scaler_enabled(self) -> None:
        """Only the controls of the chosen loss-scale mode are enabled ("default": none)."""
        mode = self.scale_mode.value
        for c in (self.init_scale, self.growth_factor, self.backoff_factor, self.growth_interval):
            c.disabled = mode != "dynamic"
        self.static_scale.disabled = mode != "static"

    # ---- validation ---------------------------------------------------------------------------

    def input_errors(self) -> dict[str, str]:
        """``{control: message}`` for every control whose value is invalid now."""
        errs = {}
        if not self.opt_levels.value and self.ranks.value <= 1:
            errs["opt_levels"] = "choose at least one opt level"
        if self.ranks.value > 1 and not self.policies.value:
            errs["policies"] = "choose at least one policy"
        if self.ranks.value < 1:
            errs["ranks"] = (
                f"ranks {self.ranks.value}: use 1 (one process) or more; refused, not clamped"
            )
        try:
            parse_sizes(self.batch_sizes.value)
        except ValueError as e:
            errs["batch_sizes"] = str(e)
        if self.steps.value < 2:
            errs["steps"] = (
                f"steps {self.steps.value}: need at least 2 (one step is memory-tracked); "
                "0 or less is refused, not clamped"
            )
        if self.threads.value < 0:
            errs["threads"] = f"threads {self.threads.value}: use 0 (torch's default) or more"
        if self.scale_mode.value == "dynamic":
            # the rule amp applies checks them, so the controls accept exactly what amp does
            # each message starts with the control as the user sees it, like the others
            fields = self._scale_fields()
            for k, msg in LossScaleRule.field_errors(**fields).items():
                label = getattr(self, k).description
                errs[k] = f"{label} {fields[k]:g}: {msg.rstrip('.')}; refused, not clamped"
        return errs

    def validate(self) -> bool:
        """Show each control's error beside it; disable Run while any is invalid."""
        errs = self.input_errors()
        for k, box in self.control_errors.items():
            msg = errs.get(k, "")
            text = _message(f"<span>&#9888; {html.escape(msg)}</span>", "#b00020")
            box.value = text if msg else ""
        cpus = os.cpu_count() or 1
        if "threads" not in errs and self.threads.value > cpus:
            self.control_errors["threads"].value = _message(
                f"more than this machine's {cpus} CPUs: threads will wait for each other",
                "#a05a00",
            )
        self.run_button.disabled = bool(errs) or self.running
        return not errs

    # ---- reading ------------------------------------------------------------------------------

    def _device(self) -> str:
        return self.device.value

    def _half_options(self, value="auto"):
        if value == "auto" or value is None:
            value = short_name(default_half_dtype(self._device()))
        self.half_dtype.options = [(half_status_label(n, self._device()), n) for n in HALF_NAMES]
        self.half_dtype.value = value

    def _device_changed(self):
        self._half_options(self.half_dtype.value)
        self.hardware.value = hardware_html(self._device())

    def _scale_fields(self) -> dict:
        """The :class:`~mpnb.amp.LossScaleRule` fields the dynamic scaler's controls set."""
        return dict(
            init_scale=float(self.init_scale.value),
            growth_factor=float(self.growth_factor.value),
            backoff_factor=float(self.backoff_factor.value),
            growth_interval=int(self.growth_interval.value),
        )

    def loss_scale(self) -> LossScaleRule | None:
        """The loss-scale argument for :func:`mpnb.lab.compare` from the scaler controls: None
        (each level's default) or a :class:`~mpnb.amp.LossScaleRule` (ValueError if a control
        is bad), which the lab and amp use as it is."""
        if self.scale_mode.value == "default":
            return None
        if self.scale_mode.value == "static":
            return LossScaleRule.static(float(self.static_scale.value))
        return LossScaleRule(**self._scale_fields())
