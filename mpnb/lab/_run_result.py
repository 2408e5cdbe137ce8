"""What one run produced, and the parts of its row measured after the steps.

:class:`RunResult` is what the runner turns into a row; :func:`evaluate` (the held-out loss
and metric), :func:`timing_row` (the step-time summary of the timed steps) and
:func:`memory_row` (the memory-tracked step's breakdown) fill it at the end; :func:`to_device`
and :func:`forward` pass any batch shape to any model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from mpnb.lab._data import batch_len
from mpnb.lab.config import RunConfig
from mpnb.lab.memory import MemoryTracker
from mpnb.lab.stats import iqr, median
from mpnb.lab.workloads import Workload, logits_of

__all__ = [
    "RunResult",
    "to_device",
    "forward",
    "fixed_output",
    "evaluate",
    "timing_row",
    "memory_row",
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
    unsupported: bool = False  # the device cannot run the configuration (``error`` says why)


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


def _logits_cpu(out) -> torch.Tensor | None:
    try:
        return logits_of(out).detach().float().cpu()
    except (TypeError, StopIteration):
        return None


def fixed_output(step, w: Workload, device) -> torch.Tensor | None:
    """The logits of the fixed batch at initialization (fp32, CPU), through ``step``'s model
    in its forward context (O1's hooks, torch.amp's autocast): for ``output_diff_vs_O0``."""
    x, _ = w.fixed_batch(64)
    model = step.module
    model.eval()
    with torch.no_grad(), step.forward_context():
        out = _logits_cpu(forward(model, to_device(x, device)))
    model.train()
    return out


def evaluate(step, w: Workload, device) -> tuple[float, float]:
    """``(held-out loss, metric)`` of ``step``'s model, in its forward context."""
    model = step.module  # eager (a compiled step's other modes would compile again)
    model.eval()
    n = loss_sum = metric_sum = 0.0
    with torch.no_grad(), step.forward_context():
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


def timing_row(history: list[dict]) -> dict:
    """The row's step-time, loss and loss-scale columns from the history (timed steps only)."""
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


def memory_row(tracker: MemoryTracker, peak: int, cuda: bool) -> dict:
    """The row's peak memory and its breakdown by role (``mem_<role>_mib``)."""
    row = {
        "peak_mem_mib": peak / _MIB,
        "mem_method": "torch.cuda.max_memory_allocated" if cuda else "dispatch tracker",
    }
    for role, nbytes in tracker.breakdown().items():
        row[f"mem_{role}_mib"] = nbytes / _MIB
    return row
