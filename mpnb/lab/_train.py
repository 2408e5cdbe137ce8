"""One configuration, trained for real: the measurements behind one row of ``compare``.

Every configuration trains through one loop: its configuration builds the step
(:meth:`~mpnb.core.precision_configs.PrecisionConfig.train_step`, a
:class:`~mpnb.core.precision_configs.TrainStep`: mpnb's through ``amp.scale_loss``, torch.amp's
through ``torch.autocast`` and ``GradScaler``), and the trainer only calls its hooks. The lab
reads nothing on the host inside a step: the loss, the overflow flag and the loss scale stay on
the device (:class:`~mpnb.lab._step_log.StepLog`) and are read together every
:data:`~mpnb.lab._step_log.READ_EVERY` steps and at the end (a step was skipped when its flag is
set under dynamic scaling; a NaN divergence is found at those reads and named by its first
step). Step times come from ``torch.utils.benchmark.timer`` (it synchronizes CUDA); the first
``warmup`` steps and the memory-tracked step (:attr:`~mpnb.lab.config.RunConfig.memory_step`,
which also counts the step's FLOPs, dispatched ops and host reads,
:class:`~mpnb.lab.host_reads.HostReads`) are recorded in the history but not timed. A
compiling configuration is compiled before its first step (:mod:`mpnb.lab._warm_compile`);
its compile time is the row's ``compile_s``, and a later step that compiled again is recorded
with phase ``"compile"``, never timed.

The model's output is never assumed to be a tensor: ``loss_fn`` and ``metric_fn`` receive
exactly what the model returned (a tensor, tuple, dict, dataclass or ``ModelOutput``).
"""

from __future__ import annotations

import math
import warnings

import torch
from torch.utils import benchmark
from torch.utils.flop_counter import FlopCounterMode

from mpnb.core.amp import EmulatedHalfWarning
from mpnb.core.fp8 import Float8FallbackWarning
from mpnb.lab._data import batch_len
from mpnb.lab._errors import DivergenceError, describe_error, divergence_message
from mpnb.lab._run_result import (
    RunResult,
    evaluate,
    fixed_output,
    forward,
    memory_row,
    timing_row,
    to_device,
)
from mpnb.lab._step_log import StepLog
from mpnb.lab._warm_compile import CompileWatch, warm_up_step
from mpnb.lab.config import RunConfig
from mpnb.lab.gpu_busy import measure_busy
from mpnb.lab.host_reads import HostReads
from mpnb.lab.memory import MemoryTracker
from mpnb.lab.workloads import Workload

__all__ = [
    "RunResult",
    "Trainer",
    "run_config",
    "to_device",
    "forward",
    "DivergenceError",
    "describe_error",
    "divergence_message",
]


def row_warnings(caught) -> list[str]:
    """A row's notes from the warnings caught while it ran: the first sentence of each, and
    the layers' fallback warnings of one recipe and cause said once, naming the layers
    (``"mpnb.fp8: 9 layers (blocks.0.qkv, ..., head) (nvfp4 ...): its forward GEMM: ..."``)."""
    order: list[str | tuple[str]] = []  # a note, or (cause,): the layers of that cause
    layers: dict[str, list[str]] = {}
    for c in caught:
        m = c.message
        if isinstance(m, Float8FallbackWarning) and m.layer and m.cause:
            if m.cause not in layers:
                layers[m.cause] = []
                order.append((m.cause,))
            layers[m.cause].append(m.layer)
        else:
            order.append(str(m).split(". ")[0])
    notes = []
    for item in order:
        if isinstance(item, tuple):
            names = layers[item[0]]
            shown = ", ".join(names if len(names) <= 4 else [*names[:2], "...", names[-1]])
            what = f"layer {names[0]!r}" if len(names) == 1 else f"{len(names)} layers ({shown})"
            item = f"mpnb.fp8: {what} {item[0]}".split(". ")[0]
        notes.append(item)
    return notes


def _train_step(cfg: RunConfig, w: Workload):
    """The training step of ``cfg``, set up by its precision configuration: the optimizer it
    needs (:meth:`PrecisionConfig.make_optimizer`) and
    :meth:`PrecisionConfig.train_step` with the run's half dtype and loss scale."""
    pc = cfg.config
    torch.manual_seed(cfg.seed)
    model = w.model_fn().to(cfg.device)
    opt = pc.make_optimizer(cfg.optimizer, model.parameters(), cfg.lr or w.lr)
    return pc.train_step(model, opt, half_dtype=cfg.dtype, loss_scale=cfg.loss_scale)


def _checked(loss):
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise TypeError(
            f"loss_fn returned {type(loss).__name__}"
            f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}; it must return "
            "a scalar tensor (reduce it with .mean() or .sum())."
        )
    return loss


def _output(out):
    """The model's output, refused when it is None (a loss can read nothing from it)."""
    if out is None:
        raise TypeError(
            "the model returned None: its forward() has no `return` (or returns nothing). "
            "Return the model's output (the logits, or a tuple, dict or ModelOutput holding "
            "them); a loss_fn=(output, target) -> loss receives exactly what forward returns."
        )
    return out


def train_once(step, x, y, loss_fn) -> torch.Tensor:
    """One training step through ``step`` (its :meth:`~mpnb.core.precision_configs.TrainStep.
    run`: the hooks, or a captured graph's replay); returns the loss (on the device, unread)."""
    return step.run(x, y, lambda model, x, y: _checked(loss_fn(_output(forward(model, x)), y)))


class Trainer:
    """One configuration's training step, data and history, advanced one step at a time.

    The runner steps several trainers round-robin (step ``k`` of every configuration before
    step ``k + 1`` of any) so that a shared machine's drift slows every configuration alike;
    :func:`run_config` steps one alone. Step :attr:`RunConfig.memory_step` runs under the
    :class:`MemoryTracker` (and a FLOP counter and :class:`HostReads`) and is not timed. A
    configuration the device cannot run (:meth:`PrecisionConfig.unavailable`) is an
    ``unsupported`` row that never trains.
    """

    def __init__(self, cfg: RunConfig, w: Workload):
        self.cfg, self.w, self.res = cfg, w, RunResult(cfg)
        self.cuda = torch.device(cfg.device).type == "cuda"
        self.st = self.tracker = self.batches = None
        self.log = StepLog()
        self.watch = CompileWatch()
        self.peak = 0
        why = cfg.config.unavailable(cfg.device)
        if why:
            self.res.error, self.res.unsupported = f"{cfg.label}: {why}", True
            return
        self._guard(self._setup)

    @property
    def alive(self) -> bool:
        """False once the configuration has failed."""
        return self.res.error is None

    def _guard(self, fn, *args) -> None:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            warnings.simplefilter("ignore", EmulatedHalfWarning)  # the lab says it per row
            try:
                fn(*args)
            except Exception as e:  # noqa: BLE001 - any failure becomes this row's error
                self.res.error = describe_error(e, self.cfg.label)
                self.release()
        self.res.warnings += row_warnings(caught)

    def _setup(self) -> None:
        cfg, w = self.cfg, self.w
        self.st = _train_step(cfg, w)
        note = cfg.config.optimizer_note(cfg.optimizer)
        if note:
            self.res.warnings.append(note)
        self.res.output = fixed_output(self.st, w, cfg.device)
        self.tracker = MemoryTracker(self.st.module, self.st.optimizer)
        self.batches = w.batches(cfg.batch_size, cfg.seed)
        if self.st.compile_budget_s is not None:
            # a batch of the run's shape from a second iterator: training's data is untouched
            x, y = next(w.batches(cfg.batch_size, cfg.seed))
            x, y = to_device(x, cfg.device), to_device(y, cfg.device)
            secs, note = warm_up_step(self.st, x, y, w.loss_fn, forward, cfg.device)
            self.res.row["compile_s"] = secs
            if note:
                self.res.warnings.append(note)

    def step(self, i: int) -> None:
        """Run training step ``i`` (a failure is recorded, never raised)."""
        if self.alive:
            self._guard(self._step, i)

    def _step(self, i: int) -> None:
        cfg, w = self.cfg, self.w
        x, y = next(self.batches)
        x, y = to_device(x, cfg.device), to_device(y, cfg.device)
        phase = "warmup" if i < cfg.warmup else "memory" if i == cfg.memory_step else "timed"
        compiles = self.st.compile_budget_s is not None
        if compiles:
            self.watch.start()
        if phase == "memory":
            loss, dt = self._memory_step(x, y)
        elif phase == "timed" and self.cuda and i == cfg.memory_step + 1:
            phase = "busy"  # under the profiler: its time is not a step time
            loss, dt = self._busy_step(x, y)
        else:
            t0 = benchmark.timer()
            loss = train_once(self.st, x, y, w.loss_fn)
            dt = benchmark.timer() - t0
        if compiles and self.watch.compiled():  # a new shape compiled again: not a step time
            phase = "compile"
            self.res.row["compile_s"] = self.res.row.get("compile_s", 0.0) + dt
        self.log.add(i, phase, loss, self.st.found_inf, self.st.scale, dt, batch_len(x))
        if self.log.due:
            self._read_log()

    def _memory_step(self, x, y):
        """The step under the memory tracker, the FLOP counter and the host-read counter
        (which sees the training step alone, not the lab's bookkeeping around it)."""
        base = self._cuda_base()
        flops = FlopCounterMode(display=False)
        with self.tracker, flops, warnings.catch_warnings():
            # the tracker's global module hooks also fire for a compiled model's wrapper, which
            # torch.compile warns about; they count nothing twice (the wrapper holds no tensor)
            warnings.filterwarnings("ignore", message=r".*global hooks on modules")
            t0 = benchmark.timer()
            with HostReads() as reads:
                loss = train_once(self.st, x, y, self.w.loss_fn)
            dt = benchmark.timer() - t0
        self.peak = self._cuda_peak(base) if self.cuda else self.tracker.peak_bytes
        self.res.row.update(
            flops_per_step=float(flops.get_total_flops()),
            ops_per_step=float(self.tracker.ops),
            host_syncs_per_step=float(reads.count),
            samples_per_step=float(batch_len(x)),
        )
        return loss, dt

    def _busy_step(self, x, y):
        """The step after the memory-tracked one, on CUDA, under the profiler: the share of its
        wall time the GPU spent in kernels (``gpu_busy``, :func:`mpnb.lab.gpu_busy.measure_busy`),
        which says whether the row measured the GPU or the host's launches."""
        out = []
        t0 = benchmark.timer()
        res = measure_busy(lambda: out.append(train_once(self.st, x, y, self.w.loss_fn)))
        dt = benchmark.timer() - t0
        self.res.row.update(gpu_busy=res.busy, gpu_kernel_ms=res.kernel_ms)
        return out[0], dt

    def _cuda_base(self) -> int:
        if not self.cuda:
            return 0
        torch.cuda.reset_peak_memory_stats(self.cfg.device)
        return torch.cuda.memory_allocated(self.cfg.device)

    def _cuda_peak(self, base: int) -> int:
        # Other configurations may be resident: count this step's rise above the memory at
        # its start, plus this configuration's own resident tensors (known to the tracker).
        return torch.cuda.max_memory_allocated(self.cfg.device) - base + self.tracker.entry_bytes

    def _read_log(self) -> None:
        """Read the pending steps into the history; a NaN divergence ends the run there (the
        steps after its first one are dropped: they trained on NaN)."""
        skips = self.st.skips
        for h in self.log.read(skips):
            self.res.history.append(h)
            if not h["skipped"] and not math.isfinite(h["loss"]):
                self.log.clear()
                raise DivergenceError(
                    divergence_message(self.cfg, h["loss"], h["step"], skips, h["loss_scale"])
                )

    def _all_skipped_note(self) -> str:
        """The warning for a row whose every step was skipped (the weights never moved)."""
        h = self.res.history
        if not h or not all(r["skipped"] for r in h):
            return ""
        low = min(r["loss_scale"] for r in h)
        return (
            f"every one of the {len(h)} steps was skipped (inf/NaN gradients down to a loss "
            f"scale of {low:g}): the weights never changed, so its loss and metric are the "
            "initial model's; find the overflowing layer with mpnb.lab.trace_overflow"
        )

    def finish(self, interrupted: str = "") -> RunResult:
        """Read the steps still on the device, evaluate (unless ``interrupted``: what ended the
        run, "Stop" or "Ctrl-C"), fill the row and free the model."""
        if self.alive and len(self.log):
            self._guard(self._read_log)
        done = len(self.res.history)  # a step cut short by Ctrl-C recorded nothing
        if interrupted and done < self.cfg.steps and not self.res.unsupported:
            self.res.interrupted = (
                f"interrupted at step {done} of {self.cfg.steps} ({interrupted}): speed from "
                "the rounds finished before it, no held-out metric"
            )
        if self.alive:
            self._guard(self._finish, bool(self.res.interrupted))
        self.res.row.update(timing_row(self.res.history))
        note = self._all_skipped_note()
        if note:
            self.res.warnings.append(note)
        self.res.warnings = list(dict.fromkeys(self.res.warnings))
        self.release()
        return self.res

    def _finish(self, interrupted: bool) -> None:
        if self.tracker is not None and len(self.res.history) > self.cfg.memory_step:
            self.res.row.update(memory_row(self.tracker, self.peak, self.cuda))
        if not interrupted:
            eval_loss, metric = evaluate(self.st, self.w, self.cfg.device)
            self.res.row.update(eval_loss=eval_loss, metric=metric)
            if self.w.eval is None and self.w.metric_fn is not None:
                self.res.warnings.append(
                    "the metric is measured on the first training batches (no eval_data given)"
                )

    def release(self) -> None:
        """Drop the step, its model and optimizer, the data and the pending log (and the CUDA
        cache). Closing mpnb's step removes amp's hooks, which also closes an autocast region
        that a Ctrl-C in the middle of forward left open."""
        if self.st is not None:
            self.st.close()
        self.st = self.batches = None
        self.log.clear()
        if self.cuda:
            torch.cuda.empty_cache()


def run_config(cfg: RunConfig, w: Workload, on_step=None, should_stop=None) -> RunResult:
    """Train ``w`` under ``cfg`` alone; never raises for a failing configuration (see ``error``).

    Args:
        cfg, w: the configuration and its workload.
        on_step: called as ``on_step(i)`` after step ``i``.
        should_stop: polled before every step; a non-empty return (what stopped the run:
            ``"Stop"``, ``"Ctrl-C"``, ``"SIGTERM"``) ends the run there, and the result keeps
            the steps finished before it, as an interrupted round-robin run does.

    Example::

        >>> res = run_config(expand("mlp", ("O2",), steps=20)[0], workloads.get("mlp"))
        >>> res.row["step_time_ms"], res.error
    """
    t = Trainer(cfg, w)
    for i in range(cfg.steps):
        stopped = should_stop() if should_stop is not None else ""
        if stopped:
            return t.finish(interrupted=stopped)
        if not t.alive:
            break
        t.step(i)
        if on_step is not None:
            on_step(i)
    return t.finish()
