"""The controls of :class:`~mpnb.widgets.CompareWidget` (a mixin: the widget's own attributes).

They hold the request (workload and size, configurations, half dtype with its hardware status,
batch sizes, steps, optimizer, device, threads, loss scaler) and turn it into
:func:`mpnb.lab.compare` arguments; nothing runs here. Every control is validated when it
changes: a bad value shows its message right beside the control and disables Run until
it is fixed.

The controls are data: one :class:`Control` row of :data:`CONTROLS` each (its attribute,
widget class, description, column, where its options and value come from, whether it refuses
values in a box under it), built from a :class:`Request` (:func:`request_of`: the widget's
arguments as the controls start from them) by one short loop.
"""

from __future__ import annotations

import html
import os
from dataclasses import dataclass, field

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

__all__ = [
    "ControlsMixin",
    "Control",
    "CONTROLS",
    "Request",
    "request_of",
    "LEVELS",
    "DEFAULT_LEVELS",
    "OPTIMIZERS",
    "parse_sizes",
]

# Every configuration mpnb compares (O0-O3, the peers torch-amp, tf32 and torch-amp+compile,
# the FP8 recipes, pure bf16 and its optimizer options), from the one list in
# mpnb.core.precision_configs; the widget starts with compare's default (the O levels and
# torch-amp on a CPU; tf32 too on CUDA).
LEVELS = config_names()
DEFAULT_LEVELS = DEFAULT_CONFIGS
SIZES = ("auto", "small", "medium", "large", "gpu")  # gpu: sized for the CUDA card
#: the strategy control's choices ("both": every DDP and FSDP2 policy)
STRATEGY_CHOICES = ("both", *STRATEGIES)
_SCALE_MODES = ("default", "dynamic", "static")  # "default": each level's own scaler
_THREADS_TIP = "torch threads for the runs (0: torch's default)"
_RANKS_TIP = "local processes (2 or more: DDP and FSDP2 policies per rank)"
_ALL_LEVELS = dict(rows=len(LEVELS))  # every configuration in view
_ALL_POLICIES = dict(rows=len(distributed_names()))  # every policy in view
_WORKLOADS_OWN = dict(placeholder="the workload's")  # empty: the workload's batch size


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


@dataclass(frozen=True)
class Control:
    """One control of the widget: one row of :data:`CONTROLS`.

    Args:
        name: the widget's attribute; its value starts as the :class:`Request`'s field of that
            name, and it is its key in ``control_errors`` when it ``refuses``.
        kind: the ipywidgets class.
        description: the label shown beside it.
        column: which column of the "Configurations" panel holds it (0, 1 or 2).
        options: the choices: a tuple, or the name of the :class:`Request` field holding them
            (None: not a choice).
        keywords: the widget's other keywords (``rows``, ``step``, ``placeholder`` ...).
        refuses: a bad value is refused in a message box under it (Run stays disabled until
            it is fixed); the controls are validated again when its value changes.
        revalidate: the controls are validated again when its value changes (no box of its
            own).
        tooltip: shown on hover ("": none).
        value: False when the mixin sets its value itself (``half_dtype``: its options say
            each dtype's support on the device, see ``_half_options``).
    """

    name: str
    kind: type
    description: str
    column: int
    options: tuple | str | None = None
    keywords: dict = field(default_factory=dict)
    refuses: bool = False
    revalidate: bool = False
    tooltip: str = ""
    value: bool = True

    @property
    def validates(self) -> bool:
        """Whether a change of its value validates the controls again."""
        return self.refuses or self.revalidate

    def build(self, request: Request) -> w.Widget:
        """The widget, from the request."""
        kw = dict(self.keywords, description=self.description)
        if self.options is not None:
            opts = self.options
            kw["options"] = getattr(request, opts) if isinstance(opts, str) else opts
        if self.value:
            kw["value"] = getattr(request, self.name)
        if self.tooltip:
            kw["tooltip"] = self.tooltip
        return self.kind(**kw)


@dataclass(frozen=True)
class Request:
    """What the widget was asked for, as the controls start from it: one field per control
    of that name, and the choices that depend on the request (see :func:`request_of`)."""

    workloads: list  # the choices of workload
    workload: str
    size: str
    devices: list  # the choices of device
    device: str
    opt_levels: tuple
    half_dtype: str  # "auto" or a name: its control's value, set by _half_options
    batch_sizes: str
    steps: int
    optimizer: str
    threads: int
    ranks: int
    strategy: str
    offered: tuple  # the policies the strategy offers: the choices of policies
    policies: tuple
    scale_mode: str
    init_scale: float  # the dynamic scaler's fields (LossScaleRule's defaults unless asked)
    growth_factor: float
    backoff_factor: float
    growth_interval: int
    static_scale: float


#: the loss-scale sliders: powers of two, 2**0 to 2**24
_LOG2 = dict(base=2, min=0, max=24, step=1)

#: Every control, in the panel's order (column by column), with how it starts.
CONTROLS: tuple[Control, ...] = (
    Control("workload", w.Dropdown, "workload", 0, "workloads", revalidate=True),
    Control("size", w.Dropdown, "size", 0, SIZES),
    Control("device", w.Dropdown, "device", 0, "devices"),
    # its options say each dtype's support on the device: set by _half_options, as its value
    Control("half_dtype", w.ToggleButtons, "half dtype", 0, value=False),
    # every configuration in view (a scrolled list hid the FP8 and pure-bf16 rows)
    Control("opt_levels", w.SelectMultiple, "opt levels", 0, LEVELS, _ALL_LEVELS, refuses=True),
    Control("batch_sizes", w.Text, "batch sizes", 1, None, _WORKLOADS_OWN, refuses=True),
    Control("steps", w.IntText, "steps", 1, refuses=True),
    Control("optimizer", w.Dropdown, "optimizer", 1, OPTIMIZERS),
    Control("threads", w.IntText, "threads", 1, refuses=True, tooltip=_THREADS_TIP),
    Control("ranks", w.IntText, "ranks", 1, refuses=True, tooltip=_RANKS_TIP),
    Control("strategy", w.Dropdown, "strategy", 1, STRATEGY_CHOICES),
    Control("policies", w.SelectMultiple, "policies", 1, "offered", _ALL_POLICIES, refuses=True),
    Control("scale_mode", w.Dropdown, "loss scale", 2, _SCALE_MODES, revalidate=True),
    Control("init_scale", w.FloatLogSlider, "initial scale", 2, None, _LOG2),
    # plain text boxes: a bad value is refused beside the control, never clamped
    Control("growth_factor", w.FloatText, "growth", 2, None, dict(step=0.5), refuses=True),
    Control("backoff_factor", w.FloatText, "backoff", 2, None, dict(step=0.05), refuses=True),
    Control("growth_interval", w.IntText, "interval", 2, refuses=True),
    Control("static_scale", w.FloatLogSlider, "static scale", 2, None, _LOG2),
)


def _policies(strategy, policies) -> tuple[tuple, tuple]:
    """The policies the strategy offers and those chosen (None: all); refuses a strategy or a
    policy the strategy does not offer."""
    if strategy not in (None, *STRATEGY_CHOICES):
        raise ValueError(
            f"strategy {strategy!r}: use one of {STRATEGY_CHOICES} (or None for both)."
        )
    offered = distributed_names(strategy)
    chosen = offered if policies is None else tuple(policies)
    wrong = [p for p in chosen if p not in offered]
    if wrong:
        raise ValueError(
            f"policies {wrong} are not {strategy or 'both'!r} policies: choose from "
            f"{list(offered)} (or change the strategy)."
        )
    return offered, chosen


def request_of(
    workload,
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
) -> Request:
    """The :class:`Request` the controls start from: :class:`~mpnb.widgets.CompareWidget`'s
    arguments (``workload``: a name or a Workload; ``half_dtype``: a name or "auto", the
    device's default; ``ranks``: 1, one process, as before; ``strategy``: DDP, FSDP2 or None,
    both; its ``policies``: None, all). Refuses a loss scale amp would refuse, and a strategy
    or policies the strategy does not offer."""
    wl = workload if isinstance(workload, str) else workload.name
    cuda = torch.cuda.is_available()
    # the widget's argument is parsed once, as amp.initialize parses it
    rule = LossScaleRule.parse(loss_scale, owner="CompareWidget")
    mode = "default" if rule is None else "dynamic" if rule.dynamic else "static"
    dyn = rule if mode == "dynamic" else LossScaleRule()
    offered, chosen = _policies(strategy, policies)
    return Request(
        workloads=list(dict.fromkeys([wl, *workloads.names()])),
        workload=wl,
        size=size,
        devices=["cpu"] + (["cuda"] if cuda else []),
        device=("cuda" if cuda else "cpu") if device == "auto" else device,
        opt_levels=tuple(configs),
        half_dtype=half_dtype,
        batch_sizes=", ".join(map(str, batch_sizes or ())),
        steps=steps or 0,
        optimizer=optimizer,
        threads=threads or 0,
        ranks=int(ranks or 1),
        strategy=strategy or "both",
        offered=offered,
        policies=chosen,
        scale_mode=mode,
        init_scale=dyn.init_scale,
        growth_factor=dyn.growth_factor,
        backoff_factor=dyn.backoff_factor,
        growth_interval=dyn.growth_interval,
        static_scale=rule.init_scale if mode == "static" else 2.0**10,
    )


class ControlsMixin:
    """Builds the control widgets as attributes of the widget, validates and reads them."""

    def _build_controls(self, *args, **kwargs):
        """Every row of :data:`CONTROLS` as an attribute, in its column of the panel, a
        message box under those that refuse values; then what each control changes. The
        arguments are :func:`request_of`'s after ``workload``."""
        r = request_of(self._workload, *args, **kwargs)
        for c in CONTROLS:
            setattr(self, c.name, c.build(r))
        self.control_errors = {c.name: _err() for c in CONTROLS if c.refuses}
        columns = [[] for _ in range(3)]
        for c in CONTROLS:
            control = getattr(self, c.name)
            columns[c.column].append(
                _row(control, self.control_errors[c.name]) if c.refuses else control
            )
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
        self._wire_controls(r)

    def _wire_controls(self, r: Request) -> None:
        """What each control changes: the half dtypes follow the device, the distributed
        controls the ranks and strategy, the scaler's the mode; then every control of
        :data:`CONTROLS` that ``validates`` validates them all when its value changes."""
        self._half_options(r.half_dtype)
        self.device.observe(self.errors.guard(lambda _: self._device_changed()), names="value")
        self.ranks.observe(lambda _: self._ranks_enabled(), names="value")
        self.strategy.observe(lambda _: self._strategy_changed(), names="value")
        self._ranks_enabled()
        self.scale_mode.observe(lambda _: self._scaler_enabled(), names="value")
        self._scaler_enabled()
        for c in CONTROLS:
            if c.validates:
                getattr(self, c.name).observe(lambda _: self.validate(), names="value")

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
