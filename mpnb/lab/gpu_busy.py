"""GPU busy: the share of a training step's wall time during which a CUDA kernel was running.

A low figure means the step measured the host (Python, the dispatcher and the kernel launches)
rather than the GPU's arithmetic: at the ``medium`` size an H100 runs the GPT's O0 step in
16.2 ms for 719 ops, almost all of it launch overhead (``docs/gpu``).

:func:`measure_busy` runs one step under ``torch.profiler`` (CPU and CUDA activities) inside a
``record_function`` window that ends after ``torch.cuda.synchronize()``, so the window is the
step's wall time including the GPU's tail. Busy is the **union** of the kernels' intervals,
clipped to that window, over the window's length: a number in 0..1. The union, not the sum
of kernel times: kernels on several streams overlap, and their sum would count the same
microsecond twice and could pass 1. The sum is kept as well (``kernel_sum_ms``), so a
difference between the two shows the overlap. Copies and memsets are not kernels (they run on
the copy engines) and are not counted; neither is the profiler's own annotation of the window.

The profiler's own cost per op lengthens the host's part of the profiled step a little, so
busy errs low, never high. A step on CPU tensors has no busy: ``busy`` is NaN ("not
applicable"), never a made-up number.

Example::

    >>> r = measure_busy(lambda: train_step(model, opt, x, y))
    >>> f"{r.busy:.0%} of {r.wall_ms:.1f} ms in {r.kernels} kernels"
    >>> busy_from_events([(0.0, 4.0), (2.0, 6.0), (8.0, 9.0)], 0.0, 10.0).busy
    0.7
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

__all__ = [
    "BUSY_COLUMN",
    "BUSY_THRESHOLD",
    "BusyResult",
    "busy_from_events",
    "busy_note",
    "measure_busy",
]

#: the DataFrame column that holds a row's busy fraction (NaN off CUDA)
BUSY_COLUMN = "gpu_busy"
#: below this share of the step the GPU mostly waited: the row measured launch overhead
BUSY_THRESHOLD = 0.8
_WINDOW = "mpnb.gpu_busy.step"


@dataclass(frozen=True)
class BusyResult:
    """One step's GPU busy figure.

    Args:
        busy: union of the kernel intervals over the wall time, 0..1; NaN when not applicable.
        kernel_ms: that union, milliseconds.
        wall_ms: the step's wall time in the same profile, milliseconds.
        kernels: how many kernels ran in the window.
        kernel_sum_ms: the kernels' summed durations (above ``kernel_ms`` when they overlap).
        reason: why ``busy`` is NaN (empty when it is a measurement).
    """

    busy: float
    kernel_ms: float
    wall_ms: float
    kernels: int
    kernel_sum_ms: float = math.nan
    reason: str = ""

    @property
    def applicable(self) -> bool:
        """True when ``busy`` is a measurement (a CUDA step), False for NaN."""
        return not math.isnan(self.busy)


def _not_applicable(reason: str, wall_ms: float = math.nan) -> BusyResult:
    return BusyResult(math.nan, math.nan, wall_ms, 0, math.nan, reason)


def busy_from_events(
    kernel_intervals: Iterable[tuple[float, float]], wall_start: float, wall_end: float
) -> BusyResult:
    """Busy from kernel intervals and a wall window, all in microseconds (the profiler's unit).

    Each ``(start, end)`` is clipped to ``[wall_start, wall_end]`` (a kernel straddling an
    edge counts only inside); the clipped intervals are merged, so overlapping kernels count
    once; ``kernels`` and ``kernel_sum_ms`` count what lies inside the window. No kernels:
    busy 0 (the GPU was idle the whole step).

    Args:
        kernel_intervals: ``(start_us, end_us)`` of each kernel, in any order.
        wall_start, wall_end: the step's window, microseconds on the same clock.

    Example::

        >>> r = busy_from_events([(0, 4), (2, 6), (8, 12)], 0, 10)
        >>> r.busy, r.kernel_ms, r.kernel_sum_ms
        (0.8, 0.008, 0.01)
    """
    if not wall_end > wall_start:
        raise ValueError(
            f"busy_from_events: the wall window [{wall_start}, {wall_end}] is empty or "
            "reversed; pass the step's start and end times (end after start)."
        )
    spans = sorted((float(a), float(b)) for a, b in kernel_intervals)
    bad = next(((a, b) for a, b in spans if b < a), None)
    if bad is not None:
        raise ValueError(
            f"busy_from_events: a kernel interval ends before it starts {bad}; pass "
            "(start, end) pairs."
        )
    inside = [(max(a, wall_start), min(b, wall_end)) for a, b in spans]
    inside = [(a, b) for a, b in inside if b > a]  # what lay outside clips to nothing
    union, reach = 0.0, wall_start
    for a, b in inside:  # sorted by start: merge as we go
        a = max(a, reach)
        if b > a:
            union += b - a
            reach = b
    wall, total = wall_end - wall_start, sum(b - a for a, b in inside)
    return BusyResult(union / wall, union / 1e3, wall / 1e3, len(inside), total / 1e3)


def _is_kernel(event) -> bool:
    kind = getattr(event, "activity_type", None)  # kineto's kind, where torch exposes it
    if kind is not None:
        return kind == "kernel"
    name = str(event.name)
    return (
        event.device_type == torch.autograd.DeviceType.CUDA
        and not getattr(event, "is_user_annotation", False)
        and not name.startswith(("Memcpy", "Memset"))
    )


def measure_busy(step_fn: Callable[[], object], device=None) -> BusyResult:
    """Run ``step_fn()`` once under the profiler and return its GPU busy figure.

    The GPU is synchronized before the window opens (earlier work does not count) and inside
    it, after the step (the step's last kernels do).

    .. warning:: Two host syncs and a profile to parse (about a second for a few thousand
       ops): measure a sampled step, not every step.

    Args:
        step_fn: runs one training step (called exactly once).
        device: the step's device; ``None``: CUDA when torch has it. Off CUDA the step still
            runs, and the result is NaN with a ``reason``.

    Example::

        >>> measure_busy(lambda: train_step(model, opt, x, y), "cuda").busy
    """
    cuda = torch.cuda.is_available() if device is None else torch.device(device).type == "cuda"
    if not cuda:
        step_fn()
        return _not_applicable("not a CUDA step: GPU busy does not apply")
    from torch.profiler import ProfilerActivity, profile, record_function  # kineto: on use

    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with record_function(_WINDOW):
            step_fn()
            torch.cuda.synchronize(device)
    events = prof.events()
    cpu = torch.autograd.DeviceType.CPU  # the host's range, not its copy on the GPU's timeline
    window = next((e for e in events if e.name == _WINDOW and e.device_type == cpu), None)
    if window is None:
        raise RuntimeError(
            "measure_busy: the profile holds no step window; the profiler recorded no CPU "
            "events (is another profiler running?). Run it outside other profilers."
        )
    kernels = [(e.time_range.start, e.time_range.end) for e in events if _is_kernel(e)]
    start, end = window.time_range.start, window.time_range.end
    if not kernels:
        return _not_applicable("no CUDA kernel ran in the step", (end - start) / 1e3)
    return busy_from_events(kernels, start, end)


def _rows(rows) -> list[dict]:
    if hasattr(rows, "to_dict"):  # a DataFrame
        return rows.to_dict("records")
    return [dict(r) for r in rows]


def _number(v) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan


def _low_rows(rows, threshold: float) -> list[dict]:
    return [
        r
        for r in _rows(rows)
        if str(r.get("device", "")).startswith("cuda")
        and _number(r.get(BUSY_COLUMN)) < threshold  # NaN compares False: not applicable
    ]


def _batch_hint(low: list[dict], threshold: float) -> str:
    """The batch that would bring the least busy row to the threshold, if time scaled with it."""
    r = min(low, key=lambda r: _number(r.get(BUSY_COLUMN)))
    batch, busy = _number(r.get("batch_size")), _number(r.get(BUSY_COLUMN))
    if not (batch > 0 and busy > 0):
        return "`--batch-sizes`"
    want = 2 ** math.ceil(math.log2(batch * threshold / busy))
    return f"`--batch-sizes {int(want)}`, memory allowing"


def busy_note(rows, threshold: float = BUSY_THRESHOLD) -> str:
    """The verdict's sentence when CUDA rows kept the GPU busy less than ``threshold`` of their
    step, with the fixes; ``""`` when every CUDA row is busy enough or there is none.

    Args:
        rows: a :func:`mpnb.lab.compare` DataFrame or dicts with ``configuration``, ``device``,
            :data:`BUSY_COLUMN`, ``batch_size`` and ``speed_label`` (``"baseline"`` marks the
            fp32 reference row).
        threshold: the busy share below which a row is named (default 0.8).

    Example::

        >>> busy_note([dict(configuration="O1 fp16 b4", device="cuda", gpu_busy=0.3,
        ...                 batch_size=4)])
        'GPU busy below 80% of the step (O1 fp16 b4 30%): ...'

    """
    low = _low_rows(rows, threshold)
    if not low:
        return ""
    named = ", ".join(
        f"{r.get('configuration', r.get('opt_level', '?'))} {_number(r.get(BUSY_COLUMN)):.0%}"
        for r in low
    )
    baseline = any(r.get("speed_label") == "baseline" for r in low)
    meaning = (
        "the fp32 baseline itself waited on the host, so every speed figure compares launch "
        "overheads more than precisions"
        if baseline
        else "their speed vs O0 is bounded by the host dispatching kernels, not by their "
        "precision's arithmetic"
    )
    return (
        f"GPU busy below {threshold:.0%} of the step ({named}): those rows measured launch "
        f"overhead (Python, the dispatcher, kernel launches), not the GPU; {meaning}. To "
        f"measure the GPU: a larger batch ({_batch_hint(low, threshold)}) or model "
        "(on CUDA `--size auto` sizes the built-in ones for the card), CUDA graphs "
        "(`mpnb compare --cuda-graphs`), or torch.compile (the `torch-amp+compile` "
        "configuration)."
    )
