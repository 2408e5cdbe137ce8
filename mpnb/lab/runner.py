"""``compare``: the same workload under O0/O1/O2/O3, one DataFrame row per configuration.

Method: every configuration starts from the same seed (same initial weights, same data
order). The configurations of one batch size train **round-robin in one process**: step
``k`` of every configuration runs before step ``k + 1`` of any (in an order rotated every
round), so a shared machine's drift slows them alike. The speed figure is the median of the
per-round ratios ``t_O0[k] / t_config[k]`` with a 95% bootstrap interval
(:mod:`mpnb.lab._rows`); it is the one figure the bar, its label, the table and the report
show. ``isolate=True`` instead runs each configuration alone in a fresh subprocess.

A configuration that fails (unsupported dtype, out of memory, NaN divergence, an exception in
your code) becomes a row with ``error`` set, naming the configuration and your frame; the
others still run. ``should_stop`` ends a run after the step in progress; the rows keep what
was measured and say where they were interrupted.

:func:`compare` takes the request as keywords; :class:`Plan` holds the same request as one
frozen value, its knobs in groups (:class:`WorkloadPlan`, :class:`ConfigsPlan`,
:class:`TimingPlan`, :class:`OutputPlan`, :class:`DistributedPlan`), and ``plan.run()`` runs it.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import pandas as pd
import torch

from mpnb.core.doctor import kernel_fallbacks
from mpnb.core.dtype_names import HALF_NAMES
from mpnb.core.hardware import dtype_support
from mpnb.core.precision_configs import DEFAULT_OPTIMIZER, default_configs, get_config
from mpnb.lab import workloads as _workloads
from mpnb.lab._data import is_data
from mpnb.lab._isolate import StopSignals, run_isolated, sigterm_interrupts, stop_label
from mpnb.lab._rows import COLUMNS, frames, join_warnings
from mpnb.lab._train import RunResult, Trainer
from mpnb.lab.config import (
    RunConfig,
    check_lr,
    check_steps,
    configs_argument,
    expand,
    half_name,
    resolve_device,
)
from mpnb.lab.machine import fp8_support, hardware_summary
from mpnb.lab.stats import loadavg, torch_threads
from mpnb.lab.story import run_note
from mpnb.lab.verdict import TOLERANCE, verdict

__all__ = [
    "compare",
    "Plan",
    "WorkloadPlan",
    "ConfigsPlan",
    "TimingPlan",
    "OutputPlan",
    "DistributedPlan",
    "hardware_summary",
    "fp8_support",
    "emulation_note",
    "load_record",
    "not_started",
    "COLUMNS",
]


#: the distributed comparison's optimizer when none is named: ``torch.optim.Adam``, which steps
#: FSDP2's sharded (DTensor) params; mpnb's fused ops have no DTensor sharding rule
DISTRIBUTED_OPTIMIZER = "adam"


def emulation_note(w, half_dtype="auto", device="auto", configs=None) -> str:
    """One line when a dtype the ``configs`` run in (``half_dtype`` for the O levels, the
    configurations' own otherwise) is emulated on ``device``: what that costs, and the size.

    Example::

        >>> emulation_note(workloads.get("transformer"), "bf16", "cpu")
        'bf16 is emulated on this CPU: ...'
    """

    dev = resolve_device(device)
    halves = half_dtype if isinstance(half_dtype, (list, tuple)) else (half_dtype,)
    names = list(dict.fromkeys(half_name(h, dev) for h in halves))
    facts = dtype_support(dev)
    picked = configs or default_configs(dev)
    runs = [(pc, d) for pc in map(get_config, picked) for d in pc.halves(names)]
    found = dict.fromkeys(d for pc, d in runs if pc.status(d, facts, dev) == "emulated")
    emulated = [d for d in found if d in HALF_NAMES] + [d for d in found if d not in HALF_NAMES]

    return run_note(emulated, dev, getattr(w, "size", "") or "")


def load_record(start: list | None, end: list | None, threads: int, cpus: int) -> dict:
    """Load averages at the start and end of a run, and whether other processes competed.

    The 1-minute load at the start is other processes' (ours had not started); at the end it
    includes our ``threads``. Others competed when their load plus ours exceeded the CPUs by
    half a core or more: ``max(start, end - threads) + threads > cpus + 0.5``.
    """
    s = start[0] if start else math.nan
    e = end[0] if end else math.nan
    others = max(x for x in (s, e - threads, 0.0) if math.isfinite(x))
    competed = others + threads > cpus + 0.5
    note = ""
    if competed:
        note = (
            f"Warning: other processes competed for the CPU (load average {s:.1f} at the "
            f"start, {e:.1f} at the end, on {cpus} CPUs with {threads} thread(s) of ours): "
            "every configuration was slowed, the ratios less so; rerun on a quiet machine "
            "for steadier figures."
        )
    return dict(start=start, end=end, threads=threads, cpus=cpus, competed=competed, note=note)


class _Progress:
    """Steps done, the configuration and step in progress, and an ETA; a tqdm bar if asked."""

    def __init__(self, total: int, bar: bool, callback: Callable | None):
        self.total, self.done, self.t0 = total, 0, time.perf_counter()
        self.callback = callback
        self.bar = None
        if bar:
            try:
                # optional: tqdm comes with the notebook extra
                from tqdm.auto import tqdm

                self.bar = tqdm(
                    total=total, desc="mpnb compare", unit="step", leave=False, file=sys.stderr
                )
            except ImportError:  # tqdm is a dependency; without it, no bar
                self.bar = None

    def update(self, cfg: RunConfig, step: int) -> None:
        self.done += 1
        elapsed = time.perf_counter() - self.t0
        eta = elapsed / self.done * (self.total - self.done)
        if self.bar is not None:
            self.bar.set_postfix_str(f"{cfg.label} step {step + 1}/{cfg.steps}", refresh=False)
            self.bar.update(1)
        if self.callback is not None:
            self.callback(
                dict(
                    configuration=cfg.label,
                    step=step + 1,
                    steps=cfg.steps,
                    done=self.done,
                    total=self.total,
                    elapsed_s=elapsed,
                    eta_s=eta,
                )
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _round_robin(trainers: list[Trainer], prog: _Progress, should_stop) -> tuple[list, str]:
    """Step every trainer round by round; returns the rows and what stopped the run early
    ("Stop", "Ctrl-C", "SIGTERM", or "" when every step ran). A Ctrl-C (KeyboardInterrupt) or
    SIGTERM (:class:`Terminated`) in the middle of a step ends the run as Stop does: the rows
    keep the steps finished before it."""
    steps = trainers[0].cfg.steps
    try:
        for i in range(steps):
            k = i % len(trainers)
            for t in trainers[k:] + trainers[:k]:  # rotate who goes first each round
                if should_stop is not None and should_stop():
                    return [t.finish(interrupted="Stop") for t in trainers], "Stop"
                if t.alive:
                    t.step(i)
                prog.update(t.cfg, i)
    except KeyboardInterrupt as e:
        label = stop_label(e)
        return [t.finish(interrupted=label) for t in trainers], label
    return [t.finish() for t in trainers], ""


def _in_process(configs, w, prog, should_stop) -> tuple[list[RunResult], str]:
    """Each batch size's configurations round-robin; a stop keeps the rows measured so far."""
    results, stopped = [], ""
    for b in dict.fromkeys(c.batch_size for c in configs):
        if stopped:
            break
        group: list[Trainer] = []
        try:
            group += [Trainer(c, w) for c in configs if c.batch_size == b]
        except KeyboardInterrupt as e:  # while the models were built: nothing of them ran
            for t in group:
                t.release()
            return results, stop_label(e)
        got, stopped = _round_robin(group, prog, should_stop)
        results += got
    return results, stopped


def not_started(configs: Sequence[RunConfig], ran: list[RunResult], by: str) -> list[RunResult]:
    """A row for every configuration of ``configs`` that a Stop or Ctrl-C (``by``) came before:
    it is listed, says so and holds nothing measured, instead of vanishing from the frame."""
    done = {id(r.config) for r in ran}
    return [
        RunResult(c, interrupted=f"not started ({by} came first): nothing measured")
        for c in configs
        if id(c) not in done
    ]


def _isolated(configs, spec, prog, threads, should_stop) -> tuple[list[RunResult], str]:
    """Each configuration alone in a spawned subprocess; a stop (Stop, Ctrl-C, SIGTERM) keeps
    the steps the running one finished (see :mod:`mpnb.lab._isolate`)."""
    out = []
    with StopSignals() as signals:
        for cfg in configs:
            if signals.asked or (should_stop is not None and should_stop()):
                return out, signals.asked or "Stop"
            done = []

            def on_step(i: int, cfg=cfg, done=done) -> None:
                done.append(i)
                prog.update(cfg, i)

            res = run_isolated(cfg, spec, threads, on_step, signals, should_stop)
            out.append(res)
            for i in range(len(done), cfg.steps):  # a failed run's steps count as done
                prog.update(cfg, i)
            if res.interrupted:
                return out, signals.asked or "Stop"
    return out, ""


def _workload(workload, data, loss_fn, metric_fn, eval_data, size, device):
    if isinstance(workload, (str, _workloads.Workload)):
        if data is not None or loss_fn is not None or metric_fn is not None:
            raise TypeError(
                "compare: data, loss_fn and metric_fn go with a model factory "
                "(compare(model_fn, data, loss_fn=...)), not with a workload name or Workload."
            )
        return _workloads.get(workload, size, device)
    if callable(workload) and not isinstance(workload, torch.nn.Module):
        if data is None or not (is_data(data) or callable(data)):
            raise TypeError(
                "compare(model_fn, data, ...): give the training data as (inputs, targets) "
                "tensors, a Dataset, a DataLoader, a generator function or an iterator."
            )
        name = getattr(workload, "__name__", "custom")
        name = "custom" if name == "<lambda>" else name
        return _workloads.custom(workload, data, loss_fn, metric_fn, eval_data, name=name)
    raise TypeError(
        f"compare: workload must be a name ({', '.join(_workloads.names())}), a Workload or a "
        f"function returning a fresh model, got {type(workload).__name__}; pass "
        "lambda: model_object if you have a model (it is rebuilt for every configuration)."
    )


@dataclass(frozen=True)
class WorkloadPlan:
    """What trains: :func:`compare`'s ``workload``, ``data``, ``loss_fn``, ``metric_fn``,
    ``eval_data``, ``size``, ``batch_sizes`` and ``steps`` (same meanings, same defaults)."""

    workload: Any = "transformer"
    data: Any = None
    loss_fn: Callable | None = None
    metric_fn: Callable | None = None
    eval_data: Any = None
    size: str = "auto"
    batch_sizes: Sequence[int] | None = None
    steps: int | None = None


@dataclass(frozen=True)
class ConfigsPlan:
    """What it trains under: :func:`compare`'s ``configs`` (its former name ``opt_levels`` is
    the keyword form's only), ``half_dtype``, ``optimizer``, ``lr``, ``loss_scale``,
    ``compile_budget`` and the verdict's ``tolerance``."""

    configs: Sequence | None = None
    half_dtype: Any = "auto"
    optimizer: str | None = None
    lr: float | None = None
    loss_scale: Any = None
    compile_budget: float | None = None
    tolerance: float = TOLERANCE


@dataclass(frozen=True)
class TimingPlan:
    """Where and how it is measured: :func:`compare`'s ``device``, ``seed``, ``threads`` and
    ``isolate``."""

    device: Any = "auto"
    seed: int = 0
    threads: int | None = None
    isolate: bool = False


@dataclass(frozen=True)
class OutputPlan:
    """What the run tells while it lasts, and who may stop it: :func:`compare`'s
    ``progress``, ``on_progress`` and ``should_stop``."""

    progress: bool = True
    on_progress: Callable[[dict], None] | None = None
    should_stop: Callable[[], bool] | None = None


@dataclass(frozen=True)
class DistributedPlan:
    """On how many local ranks: :func:`compare`'s ``ranks`` (None or 1: one process),
    ``strategy`` and ``timeout``."""

    ranks: int | None = None
    strategy: str | None = None
    timeout: float = 600.0

    @property
    def on(self) -> bool:
        """True for the distributed comparison (2 ranks or more)."""
        return self.ranks is not None and self.ranks > 1


@dataclass(frozen=True)
class Plan:
    """One :func:`compare` request, its knobs grouped; ``plan.run()`` runs it.

    Every group has :func:`compare`'s defaults, so a plan names only what differs. A plan is
    a frozen value: make a variant with :func:`dataclasses.replace` and run both. Its values
    are checked when it runs, with the errors the keyword form raises.

    Example::

        >>> from dataclasses import replace
        >>> from mpnb.lab import Plan, WorkloadPlan, ConfigsPlan, TimingPlan
        >>> plan = Plan(WorkloadPlan("mlp", steps=20), ConfigsPlan(("O0", "O2")))
        >>> df = plan.run()  # the same frame as mpnb.lab.compare("mlp", steps=20, configs=...)
        >>> df2 = replace(plan, timing=TimingPlan(seed=1)).run()  # the same, another seed
    """

    workload: WorkloadPlan = field(default_factory=WorkloadPlan)
    configs: ConfigsPlan = field(default_factory=ConfigsPlan)
    timing: TimingPlan = field(default_factory=TimingPlan)
    output: OutputPlan = field(default_factory=OutputPlan)
    distributed: DistributedPlan = field(default_factory=DistributedPlan)

    def __post_init__(self):
        for f in fields(self):
            group, value = _GROUPS[f.name], getattr(self, f.name)
            if not isinstance(value, group):
                raise TypeError(
                    f"Plan({f.name}={value!r}): the {f.name} group is a {group.__name__}; "
                    f"pass {f.name}={group.__name__}(...) (its fields: "
                    f"{', '.join(g.name for g in fields(group))})."
                )

    def run(self) -> pd.DataFrame:
        """Run the plan: the frame :func:`compare` returns (see there)."""
        return _run(self)


#: each group of a :class:`Plan` and its class
_GROUPS = dict(
    workload=WorkloadPlan,
    configs=ConfigsPlan,
    timing=TimingPlan,
    output=OutputPlan,
    distributed=DistributedPlan,
)


def compare(
    workload="transformer",
    data=None,
    *,
    loss_fn: Callable | None = None,
    metric_fn: Callable | None = None,
    eval_data=None,
    configs: Sequence[str] | None = None,
    half_dtype="auto",
    batch_sizes: Sequence[int] | None = None,
    steps: int | None = None,
    size: str = "auto",
    optimizer: str | None = None,
    lr: float | None = None,
    loss_scale=None,
    device="auto",
    seed: int = 0,
    progress: bool = True,
    isolate: bool = False,
    threads: int | None = None,
    on_progress: Callable[[dict], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    tolerance: float = TOLERANCE,
    opt_levels: Sequence[str] | None = None,
    ranks: int | None = None,
    strategy: str | None = None,
    timeout: float = 600.0,
    compile_budget: float | None = None,
) -> pd.DataFrame:
    """Train a workload under each configuration (and half dtype, batch size); one row each.

    Args:
        workload: a built-in name (``"transformer"``, ``"cnn"``, ``"mlp"``), a
            :class:`~mpnb.lab.workloads.Workload`, or **your model factory** (a function
            returning a fresh model), given with ``data``.
        data: with a model factory: ``(inputs, targets)`` tensors, a ``Dataset``, a
            ``DataLoader``, a generator function or an iterator of batches (dict batches
            are passed as ``model(**batch)``, targets ``batch["labels"]``).
        loss_fn: ``(output, target) -> scalar``; receives exactly what the model returned
            (tensor, tuple, dict, dataclass, ``ModelOutput``). Default: cross-entropy on the
            output's logits. metric_fn: ``(output, target) -> float``, e.g.
            :func:`~mpnb.lab.workloads.accuracy` (it finds the logits in any output).
        eval_data: held-out data for the metric (default: the first training batches).
        configs: names (or objects) of
            :data:`mpnb.core.precision_configs.PRECISION_CONFIGS`, whose module lists them
            (default: :func:`~mpnb.core.precision_configs.default_configs`: ``"O0"`` ..
            ``"O3"`` and ``"torch-amp"``, with ``"tf32"`` on CUDA; also the FP8 recipes, pure
            bf16 with its update roundings and ``"torch-amp+compile"``). The peers
            (``torch-amp``, ``tf32``, ``torch-amp+compile``) train the same model, data and
            seed in the same round-robin; ``torch-amp`` trains with
            ``torch.optim.AdamW(fused=True)`` whatever ``optimizer`` says, and ``tf32`` is an
            ``unsupported`` row off CUDA. A configuration that needs an optimizer option
            trains with mpnb's fused optimizer of the ``optimizer``'s rule, the option set (the
            row's warnings say which); a row says when its precision is emulated here.
        half_dtype: ``"bf16"``, ``"fp16"``, ``"auto"`` (bf16 on CPU, fp16 on CUDA) or a list.
        batch_sizes: default: the workload's (a DataLoader's own batch size).
        steps: optimizer steps per configuration (default: the workload's).
        size: a built-in workload's size: ``"small"``, ``"medium"``, ``"large"``, ``"gpu"``
            (sized for the CUDA card: :mod:`mpnb.lab.gpu_sizing`) or ``"auto"`` (small on CPU,
            gpu on CUDA).
        optimizer, lr, loss_scale: ``"fused_adam"`` (None: mpnb's FusedAdam, a fused step as
            torch-amp's; with ``ranks``, ``"adam"``: FSDP2's sharded DTensor params need
            ``torch.optim``'s), ``"adam"``, ``"adamw"``, ``"sgd"``, ``"fused_sgd"``; the
            learning rate; for O1-O3 None (the level's default), a
            static number or ``dict(init_scale=, growth_factor=, backoff_factor=,
            growth_interval=)``.
        device: ``"auto"``, ``"cpu"`` or ``"cuda"``. seed: weights and data order.
        progress: show a progress bar (stderr) with the configuration, step and ETA.
        isolate: run each configuration in a fresh subprocess.
        threads: ``torch.set_num_threads`` for the runs (restored afterwards; None: leave it).
        on_progress: called after every step with ``configuration``, ``step``, ``steps``,
            ``done``, ``total``, ``elapsed_s``, ``eta_s``.
        should_stop: polled before every step; when it returns True the run ends there and
            the rows keep what was measured (``status == "interrupted"``). Ctrl-C
            (``KeyboardInterrupt``) and SIGTERM (a job scheduler's time limit; caught while
            the run lasts, in the main thread, unless a handler of yours is installed) during
            the steps do the same, with ``isolate=True`` too (the subprocess stops after its
            step): ``compare`` returns the rows measured so far instead of raising. A second
            Ctrl-C under ``isolate`` ends the subprocess at once.
        tolerance: the accuracy tolerance of the verdict.
        opt_levels: the former name of ``configs`` (give one of the two).
        ranks: None or 1: one process (the above). N >= 2: the distributed comparison on N
            local ranks (:func:`mpnb.core.parallel.launch`, gloo on CPU, nccl on CUDA), each
            rank training on its contiguous 1/N shard of every global batch (``batch_sizes``
            gives the global batch, which N must divide); ``configs`` then names policies of
            :data:`mpnb.core.precision_configs.DISTRIBUTED_CONFIGS` (default: every policy of
            ``strategy`` this device offers) and the frame has
            :data:`mpnb.lab.distributed.DIST_COLUMNS` besides today's columns (see
            :mod:`mpnb.lab.distributed`). ``half_dtype``, ``loss_scale``, ``isolate``,
            ``should_stop`` and ``on_progress`` do not apply there; Ctrl-C and SIGTERM stop
            every rank and return the rows measured so far (``attrs["stopped_by"]``). Refused:
            ranks below 1, and more ranks than CPUs on a CPU run (they would measure the
            contention).
        strategy: with ``ranks``: ``"ddp"``, ``"fsdp2"`` or None/``"both"``.
        timeout: with ``ranks``: seconds for the whole distributed run (positive, finite;
            the report of where a hung rank is fits in them); a rank that fails or
            hangs ends it (within this bound for a hang) with the rank and policy named in
            that policy's row, and the steps measured before are kept.
        compile_budget: seconds ``torch-amp+compile`` may take to compile before its row
            becomes an error (None: :data:`~mpnb.core.precision_configs.COMPILE_BUDGET_S`);
            its compile time is the row's ``compile_s``, never part of a step time.

    Returns:
        A DataFrame with :data:`COLUMNS`. ``attrs``: ``history`` (per-step loss, loss scale,
        step time, skipped steps), ``hardware``, ``load`` (load averages at start and end,
        ``competed``), ``method``, ``workload`` (name, size, description), ``verdict``
        (:func:`mpnb.lab.verdict.verdict`), ``stopped`` (True when the run ended early) and
        ``stopped_by`` (``"Stop"``, ``"Ctrl-C"``, ``"SIGTERM"`` or ``""``).

    Example::

        >>> df = mpnb.lab.compare("transformer", configs=("O0", "O2", "bf16-pure"), size="small")
        >>> df[["configuration", "speed_label", "peak_mem_mib", "metric"]]
        >>> print(df.attrs["verdict"]["text"])
        >>> df = mpnb.lab.compare(lambda: MyNet(), (x, y), metric_fn=mpnb.lab.accuracy)

    The same request as one value: these keywords build a :class:`Plan` (``workload``,
    ``configs``, ``timing``, ``output`` and ``distributed`` groups) and ``compare`` returns
    ``plan.run()``; build the plan yourself to keep it, vary it with
    :func:`dataclasses.replace` and run it again::

        >>> plan = mpnb.lab.Plan(mpnb.lab.WorkloadPlan("mlp", steps=20))
        >>> df = plan.run()  # == mpnb.lab.compare("mlp", steps=20)
    """
    if isinstance(workload, Plan):
        raise TypeError(
            "compare(plan): a Plan runs itself; call plan.run() (compare's keywords build one)."
        )
    if opt_levels is not None:
        configs_argument(configs, opt_levels)  # refuses both names at once
        configs = opt_levels
    plan = Plan(
        workload=WorkloadPlan(
            workload=workload,
            data=data,
            loss_fn=loss_fn,
            metric_fn=metric_fn,
            eval_data=eval_data,
            size=size,
            batch_sizes=batch_sizes,
            steps=steps,
        ),
        configs=ConfigsPlan(
            configs=configs,
            half_dtype=half_dtype,
            optimizer=optimizer,
            lr=lr,
            loss_scale=loss_scale,
            compile_budget=compile_budget,
            tolerance=tolerance,
        ),
        timing=TimingPlan(device=device, seed=seed, threads=threads, isolate=isolate),
        output=OutputPlan(progress=progress, on_progress=on_progress, should_stop=should_stop),
        distributed=DistributedPlan(ranks=ranks, strategy=strategy, timeout=timeout),
    )
    return plan.run()


def _run(plan: Plan) -> pd.DataFrame:
    """compare's steps over a plan: validate, build the workload, then either the distributed
    comparison or expand, run and frame."""
    dev = _validate(plan)
    wp = plan.workload
    w = _workload(wp.workload, wp.data, wp.loss_fn, wp.metric_fn, wp.eval_data, wp.size, dev)
    if plan.distributed.on:
        return _distributed(plan, w, dev)
    configs, notes = _expand(plan, w, dev)
    ran = _measure(plan, configs, w, dev)
    return _frame(plan, ran, w, notes, dev)


def _validate(plan: Plan) -> str:
    """Refuse what can be refused before the workload is built; the device the run is on."""
    ranks, strategy = plan.distributed.ranks, plan.distributed.strategy
    if ranks is not None and (isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1):
        raise ValueError(
            f"compare: ranks={ranks!r} is not a number of processes; pass ranks=N (N >= 2) for "
            "the distributed comparison, or leave ranks out (None or 1: one process)."
        )
    if strategy is not None and not plan.distributed.on:
        raise ValueError(
            f"compare: strategy={strategy!r} needs ranks >= 2 (the distributed comparison); "
            "pass ranks=2 or leave strategy out."
        )
    dev = resolve_device(plan.timing.device)
    if plan.workload.steps is not None:  # None: the workload's
        check_steps(plan.workload.steps)
    check_lr(plan.configs.lr)
    return dev


def _distributed(plan: Plan, w, dev: str) -> pd.DataFrame:
    """The comparison on ``plan.distributed.ranks`` local ranks (:mod:`mpnb.lab.distributed`)."""
    # the distributed comparison only with ranks=N: +150 ms to importing the runner
    from mpnb.lab.distributed._compare import compare_distributed

    wp, c, d = plan.workload, plan.configs, plan.distributed
    if wp.batch_sizes is not None and len(tuple(wp.batch_sizes)) != 1:
        raise ValueError(
            f"compare(ranks={d.ranks}): one global batch size at a time, got "
            f"batch_sizes={tuple(wp.batch_sizes)!r}; run one compare per batch size."
        )
    return compare_distributed(
        wp.workload,
        w,
        ranks=d.ranks,
        strategy=d.strategy,
        configs=c.configs,  # None: the default policies
        steps=w.steps if wp.steps is None else wp.steps,
        global_batch=tuple(wp.batch_sizes)[0] if wp.batch_sizes is not None else w.batch_size,
        optimizer=DISTRIBUTED_OPTIMIZER if c.optimizer is None else c.optimizer,
        lr=c.lr,
        device=dev,
        seed=plan.timing.seed,
        timeout=d.timeout,
        threads=plan.timing.threads,
    )


def _batch_sizes(asked, w) -> tuple[tuple[int, ...], list[str]]:
    """The batch sizes to run and a note for each one the data is too small for: a data set
    smaller than the batch asked for is one batch of all its samples, and the row states the
    batch size that ran."""
    if asked is None:
        asked = (w.batch_size,)
    elif w.data_batch_size is not None and tuple(asked) != (w.data_batch_size,):
        raise ValueError(
            f"batch_sizes={tuple(asked)!r}: the data fixes the batch size "
            f"({w.data_batch_size}); leave batch_sizes out, or give tensors or a Dataset."
        )
    ran = {b: w.batch_size_for(b) for b in asked}
    notes = [
        f"batch size {b} asked: the data holds {r} samples, so it ran b{r}"
        for b, r in ran.items()
        if r != b
    ]
    if len(set(asked)) != len(tuple(asked)):  # a size given twice: expand refuses it
        return asked, notes
    return tuple(dict.fromkeys(ran.values())), notes  # two sizes past the data: one run


def _expand(plan: Plan, w, dev: str) -> tuple[list[RunConfig], list[str]]:
    """One :class:`RunConfig` per configuration, half dtype and batch size (validated by
    :func:`expand`), and the notes for the first row."""
    c = plan.configs
    batch_sizes, notes = _batch_sizes(plan.workload.batch_sizes, w)
    configs = expand(
        w.name,
        configs_argument(c.configs, None, dev),
        c.half_dtype,
        batch_sizes,
        w.steps if plan.workload.steps is None else plan.workload.steps,
        DEFAULT_OPTIMIZER if c.optimizer is None else c.optimizer,
        c.lr,
        c.loss_scale,
        dev,
        plan.timing.seed,
        compile_budget=c.compile_budget,
    )
    return configs, notes


@dataclass
class _Ran:
    """What :func:`_measure` gives :func:`_frame`."""

    results: list[RunResult]
    stopped: str  # "Stop", "Ctrl-C", "SIGTERM" or ""
    hw: dict
    load: dict


def _measure(plan: Plan, configs: list[RunConfig], w, dev: str) -> _Ran:
    """Train every configuration (round-robin in one process, or each alone in a subprocess)
    under the plan's threads; a stop keeps the rows measured and lists those not started."""
    t, out = plan.timing, plan.output
    with torch_threads(t.threads):
        load_start = loadavg()
        hw = hardware_summary(dev)
        prog = _Progress(sum(c.steps for c in configs), out.progress, out.on_progress)
        try:
            if t.isolate:  # Ctrl-C and SIGTERM are recorded, and passed on to the subprocess
                spec = (w.name, w.size) if isinstance(plan.workload.workload, str) else w
                results, stopped = _isolated(configs, spec, prog, t.threads, out.should_stop)
            else:
                with sigterm_interrupts():  # SIGTERM raises in the step, as Ctrl-C does
                    results, stopped = _in_process(configs, w, prog, out.should_stop)
            if stopped:
                results += not_started(configs, results, stopped)
        finally:
            prog.close()
        n_threads = torch.get_num_threads()
    load = load_record(load_start, loadavg(), n_threads, hw["cpus"] or 1)
    return _Ran(results, stopped, hw, load)


def _frame(plan: Plan, ran: _Ran, w, notes: list[str], dev: str) -> pd.DataFrame:
    """The rows as a DataFrame with its ``attrs`` (see :func:`compare`, Returns)."""
    df = frames(ran.results, w, ran.hw)
    notes = notes + [f"C++ kernels: {line}" for line in kernel_fallbacks(dev)]
    if len(df) and notes:  # loud, once: on the first row
        df.loc[df.index[:1], "warnings"] = join_warnings([*notes, df["warnings"].iat[0]])
    df.attrs["load"] = ran.load
    df.attrs["method"] = (
        "isolated subprocesses"
        if plan.timing.isolate
        else "round-robin in one process (per batch size)"
    )
    df.attrs["workload"] = dict(
        name=w.name, size=w.size, description=w.description, chance=w.chance
    )
    df.attrs["stopped"] = bool(ran.stopped)
    df.attrs["stopped_by"] = ran.stopped
    df.attrs["verdict"] = verdict(df, plan.configs.tolerance)
    return df
