"""One configuration, trained for real: the measurements behind one row of ``compare``.

Per step, one host sync reads the loss, the overflow flag and the loss scale together (the
step was skipped when the flag is set under dynamic scaling). Step times come from
``torch.utils.benchmark.timer`` (it synchronizes CUDA); the first ``warmup`` steps and the
memory-tracked step (:attr:`~mpnb.lab.config.RunConfig.memory_step`, which also counts the
step's FLOPs and dispatched ops) are recorded in the history but not timed.

The model's output is never assumed to be a tensor: ``loss_fn`` and ``metric_fn`` receive
exactly what the model returned (a tensor, tuple, dict, dataclass or ``ModelOutput``).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field

import torch
from torch.utils import benchmark
from torch.utils.flop_counter import FlopCounterMode

from mpnb.core.amp import EmulatedHalfWarning
from mpnb.lab._data import batch_len
from mpnb.lab._errors import DivergenceError, describe_error
from mpnb.lab.config import RunConfig
from mpnb.lab.memory import MemoryTracker
from mpnb.lab.stats import iqr, median
from mpnb.lab.workloads import Workload, logits_of

__all__ = [
    "RunResult",
    "Trainer",
    "run_config",
    "to_device",
    "forward",
    "DivergenceError",
    "describe_error",
]

_MIB = 2.0**20


@dataclass
class RunResult:
    """What one configuration produced; the runner turns it into a row."""

    config: RunConfig
    row: dict = field(default_factory=dict)
    history: list[dict] = field(default_factory=list)
    output: torch.Tensor | None = None  # the fixed batch's logits at initialization (fp32, CPU)
    error: str | None = None
    warnings: list[str] = field(default_factory=list)
    interrupted: str = ""  # "interrupted at step k of N" when Stop ended the run early


def to_device(x, device):
    """``x`` (a tensor, or a tuple/list/dict of them) moved to ``device``."""
    if isinstance(x, torch.Tensor):
        return x.to(device, non_blocking=True)
    if isinstance(x, (tuple, list)):
        return type(x)(to_device(v, device) for v in x)
    if isinstance(x, dict):
        return type(x)({k: to_device(v, device) for k, v in x.items()})
    return x


def forward(model, x):
    """Call ``model`` on a batch's inputs: ``model(*x)`` for a tuple, ``model(**x)`` for a dict."""
    if isinstance(x, tuple):
        return model(*x)
    if isinstance(x, dict):
        return model(**x)
    return model(x)


def _setup(cfg: RunConfig, w: Workload):
    """Model, optimizer and amp handle of ``cfg``, set up by its precision configuration:
    the optimizer it needs (:meth:`PrecisionConfig.make_optimizer`) and
    :meth:`PrecisionConfig.setup` with the run's half dtype and loss scale, which leaves every
    configuration under amp so that the training step is the same for every row."""
    from mpnb import amp

    pc = cfg.config
    torch.manual_seed(cfg.seed)
    model = w.model_fn().to(cfg.device)
    opt = pc.make_optimizer(cfg.optimizer, model.parameters(), cfg.lr or w.lr)
    model, opt = pc.setup(model, opt, half_dtype=cfg.dtype, loss_scale=cfg.loss_scale)
    return model, opt, amp.current_handle()


def _logits_cpu(out) -> torch.Tensor | None:
    try:
        return logits_of(out).detach().float().cpu()
    except (TypeError, StopIteration):
        return None


def _fixed_output(model, w: Workload, device) -> torch.Tensor | None:
    x, _ = w.fixed_batch(64)
    model.eval()
    with torch.no_grad():
        out = _logits_cpu(forward(model, to_device(x, device)))
    model.train()
    return out


def _train_step(model, opt, x, y, loss_fn) -> torch.Tensor:
    from mpnb import amp

    opt.zero_grad(set_to_none=True)
    loss = loss_fn(forward(model, x), y)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise TypeError(
            f"loss_fn returned {type(loss).__name__}"
            f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}; it must return "
            "a scalar tensor (reduce it with .mean() or .sum())."
        )
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    opt.step()
    return loss.detach()


def divergence_message(cfg: RunConfig, loss: float, step: int, dynamic: bool, scale: float) -> str:
    """The error of a run whose loss became inf/NaN without the step being skipped, with advice
    that fits its precision: loss scaling only for fp16, bf16 only where it would help."""
    head = f"NaN divergence: the loss became {loss} at step {step} and the step was not skipped"
    if cfg.half_dtype == "fp16":
        kind = "dynamic" if dynamic else "static"
        advice = (
            f" (fp16, {kind} loss scale {scale:g}); lower the learning rate"
            + ("" if dynamic else ", use dynamic loss scaling")
            + ", or bf16 (fp32's range)."
        )
    elif cfg.half_dtype == "bf16":
        advice = (
            " (bf16, which has fp32's range: loss scaling would not help); lower the learning "
            "rate or clip the gradients."
        )
    elif cfg.half_dtype == "fp8":
        advice = (
            " (FP8 matmuls, scaled per tensor or block); lower the learning rate or clip the "
            "gradients, and compare with O0 to see whether FP8 is the cause."
        )
    else:
        advice = " (fp32: not a precision problem); lower the learning rate or clip the gradients."
    return head + advice + cfg.config.divergence_note()


class Trainer:
    """One configuration's model, optimizer, data and history, advanced one step at a time.

    The runner steps several trainers round-robin (step ``k`` of every configuration before
    step ``k + 1`` of any) so that a shared machine's drift slows every configuration alike;
    :func:`run_config` steps one alone. Step :attr:`RunConfig.memory_step` runs under the
    :class:`MemoryTracker` (and a FLOP counter) and is not timed.
    """

    def __init__(self, cfg: RunConfig, w: Workload):
        self.cfg, self.w, self.res = cfg, w, RunResult(cfg)
        self.cuda = torch.device(cfg.device).type == "cuda"
        self.model = self.opt = self.scaler = self.tracker = self.batches = self.handle = None
        self.peak = 0
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
        self.res.warnings += [str(c.message).split(". ")[0] for c in caught]

    def _setup(self) -> None:
        self.model, self.opt, self.handle = _setup(self.cfg, self.w)
        self.scaler = self.handle.scalers[0]
        note = self.cfg.config.optimizer_note(self.cfg.optimizer)
        if note:
            self.res.warnings.append(note)
        self.res.output = _fixed_output(self.model, self.w, self.cfg.device)
        self.tracker = MemoryTracker(self.model, self.opt)
        self.batches = self.w.batches(self.cfg.batch_size, self.cfg.seed)

    def step(self, i: int) -> None:
        """Run training step ``i`` (a failure is recorded, never raised)."""
        if self.alive:
            self._guard(self._step, i)

    def _step(self, i: int) -> None:
        cfg, w = self.cfg, self.w
        x, y = next(self.batches)
        x, y = to_device(x, cfg.device), to_device(y, cfg.device)
        phase = "warmup" if i < cfg.warmup else "memory" if i == cfg.memory_step else "timed"
        if phase == "memory":
            base = self._cuda_base()
            flops = FlopCounterMode(display=False)
            with self.tracker, flops:
                t0 = benchmark.timer()
                loss = _train_step(self.model, self.opt, x, y, w.loss_fn)
                dt = benchmark.timer() - t0
            self.peak = self._cuda_peak(base) if self.cuda else self.tracker.peak_bytes
            self.res.row.update(
                flops_per_step=float(flops.get_total_flops()),
                ops_per_step=float(self.tracker.ops),
                samples_per_step=float(batch_len(x)),
            )
        else:
            t0 = benchmark.timer()
            loss = _train_step(self.model, self.opt, x, y, w.loss_fn)
            dt = benchmark.timer() - t0
        self._record(i, phase, loss, dt, batch_len(x))

    def _cuda_base(self) -> int:
        if not self.cuda:
            return 0
        torch.cuda.reset_peak_memory_stats(self.cfg.device)
        return torch.cuda.memory_allocated(self.cfg.device)

    def _cuda_peak(self, base: int) -> int:
        # Other configurations may be resident: count this step's rise above the memory at
        # its start, plus this configuration's own resident tensors (known to the tracker).
        return torch.cuda.max_memory_allocated(self.cfg.device) - base + self.tracker.entry_bytes

    def _record(self, i: int, phase: str, loss: torch.Tensor, dt: float, n: int) -> None:
        scaler = self.scaler
        # The one host sync of the step: loss, overflow flag and scale, read together.
        lv, found, scale = torch.cat(
            [loss.float().view(1), scaler.found_inf.float().view(1), scaler.scale.view(1)]
        ).tolist()
        skipped = found > 0 and scaler.dynamic
        why = (
            ""
            if not skipped
            else ("loss is inf/NaN" if not math.isfinite(lv) else "inf/NaN in the gradients")
        )
        self.res.history.append(
            dict(
                step=i,
                loss=lv,
                loss_scale=scale,
                step_time_ms=dt * 1e3,
                skipped=skipped,
                skip_reason=why,
                phase=phase,
                samples=n,
            )
        )
        if not skipped and not math.isfinite(lv):
            raise DivergenceError(divergence_message(self.cfg, lv, i, scaler.dynamic, scale))

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
        """Evaluate (unless ``interrupted``: what ended the run, "Stop" or "Ctrl-C"), fill the
        row and free the model."""
        done = len(self.res.history)  # a step cut short by Ctrl-C recorded nothing
        if interrupted and done < self.cfg.steps:
            self.res.interrupted = (
                f"interrupted at step {done} of {self.cfg.steps} ({interrupted}): speed from "
                "the rounds finished before it, no held-out metric"
            )
        if self.alive:
            self._guard(self._finish, bool(self.res.interrupted))
        self.res.row.update(_timing_row(self.res.history))
        note = self._all_skipped_note()
        if note:
            self.res.warnings.append(note)
        self.res.warnings = list(dict.fromkeys(self.res.warnings))
        self.release()
        return self.res

    def _finish(self, interrupted: bool) -> None:
        if self.tracker is not None and len(self.res.history) > self.cfg.memory_step:
            self.res.row.update(_memory_row(self.tracker, self.peak, self.cuda))
        if not interrupted:
            eval_loss, metric = _evaluate(self.model, self.w, self.cfg.device)
            self.res.row.update(eval_loss=eval_loss, metric=metric)
            if self.w.eval is None and self.w.metric_fn is not None:
                self.res.warnings.append(
                    "the metric is measured on the first training batches (no eval_data given)"
                )

    def release(self) -> None:
        """Drop the model, optimizer and data (and the CUDA cache). Removing amp's hooks also
        closes an autocast region that a Ctrl-C in the middle of forward left open."""
        if self.handle is not None:
            self.handle.remove_hooks()
        self.model = self.opt = self.scaler = self.batches = self.handle = None
        if self.cuda:
            torch.cuda.empty_cache()


def _evaluate(model, w: Workload, device) -> tuple[float, float]:
    model.eval()
    n = loss_sum = metric_sum = 0.0
    with torch.no_grad():
        for x, y in w.eval_batches():
            x, y = to_device(x, device), to_device(y, device)
            out = forward(model, x)
            k = batch_len(x)
            loss_sum += float(w.loss_fn(out, y)) * k
            if w.metric_fn is not None:
                metric_sum += float(w.metric_fn(out, y)) * k
            n += k
    model.train()
    if n == 0:
        return math.nan, math.nan
    return loss_sum / n, (metric_sum / n if w.metric_fn is not None else math.nan)


def _timing_row(history: list[dict]) -> dict:
    timed = [h for h in history if h["phase"] == "timed"]
    ms = [h["step_time_ms"] for h in timed]
    med = median(ms)
    losses = [h["loss"] for h in history[-10:] if math.isfinite(h["loss"])]
    samples = median([h["samples"] for h in timed]) if timed else math.nan
    return dict(
        step_time_ms=med,
        step_time_iqr_ms=iqr(ms),
        timed_steps=len(ms),
        samples_per_s=samples / (med / 1e3) if timed else math.nan,
        final_loss=sum(losses) / len(losses) if losses else math.nan,
        skipped_steps=sum(h["skipped"] for h in history),
        final_loss_scale=history[-1]["loss_scale"] if history else math.nan,
    )


def _memory_row(tracker: MemoryTracker, peak: int, cuda: bool) -> dict:
    row = {
        "peak_mem_mib": peak / _MIB,
        "mem_method": "torch.cuda.max_memory_allocated" if cuda else "dispatch tracker",
    }
    for role, nbytes in tracker.breakdown().items():
        row[f"mem_{role}_mib"] = nbytes / _MIB
    return row


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
