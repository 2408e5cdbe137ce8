"""What :func:`mpnb.lab.profile` measures beside the phase times, when asked.

* ``memory``: the memory breakdown by role of one tracked step per level, from a 3-step
  :func:`mpnb.lab.compare` run of a workload made of the model and its inputs;
* ``trace``: :func:`mpnb.lab.trace_overflow` in the half dtype (the first layer that leaves
  its range);
* ``precision``: :func:`mpnb.lab.trace_precision` of one configuration (which precision each
  op ran in, and why).

Each extra that fails is named in the result's ``errors`` with its message; the others and
the phase times are kept.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import pandas as pd
import torch

from mpnb.core.amp import half_dtype_name
from mpnb.core.precision_configs import BASELINE
from mpnb.lab import workloads
from mpnb.lab._data import batch_len

__all__ = ["Extras"]


def _memory_frame(model, x, loss_fn, opt_levels, half, optimizer, lr, device) -> pd.DataFrame:
    # the runner on first use: +370 ms to importing mpnb.lab.profiling
    from mpnb.lab.runner import compare

    n = batch_len(x)
    # one batch, replayed: a dict is its own input (model(**x)), a tuple is model(*x)
    batch = x if isinstance(x, dict) else (x, torch.zeros(n))
    wl = workloads.custom(
        lambda: copy.deepcopy(model),
        iter([batch]),
        lambda out, _target: loss_fn(out),
        lr=lr,
        batch_size=n,
        steps=3,
        name="profiled model",
    )
    levels = tuple(dict.fromkeys((BASELINE, *opt_levels)))  # compare needs its baseline
    df = compare(
        wl,
        configs=levels,
        half_dtype=half,
        steps=3,
        optimizer=optimizer,
        device=device,
        progress=False,
    )
    return df[df["opt_level"].isin(opt_levels)].reset_index(drop=True)


@dataclass
class Extras:
    """The extras asked for, and (after :meth:`run`) what they found.

    Args:
        memory, trace: run the memory breakdown, the overflow tracer.
        precision: the configuration to trace, ``"auto"`` (the first level other than O0),
            or None (not traced).
        levels: the profiled levels (for ``"auto"`` and the memory run).
    """

    memory: bool
    trace: bool
    precision: str | None
    levels: tuple
    frame: pd.DataFrame | None = None
    overflow: object = None
    precision_trace: object = None
    errors: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.precision == "auto":
            self.precision = next((lv for lv in self.levels if lv != BASELINE), None)

    @property
    def count(self) -> int:
        """How many extras will run (for the progress total)."""
        return int(self.memory) + int(self.trace) + int(self.precision is not None)

    def run(self, model, x, loss_fn, half: torch.dtype, optimizer, lr, device, step) -> None:
        """Run each extra asked for; ``step(what, done)`` before each one."""
        # the tracers on first use: +400 ms to importing mpnb.lab.profiling
        from mpnb.lab.diagnosis import trace_overflow
        from mpnb.lab.precision_trace import trace_precision

        done = 0
        if self.memory:
            step("memory (3 tracked steps per level)", done)
            try:
                name = half_dtype_name(half)
                self.frame = _memory_frame(
                    model, x, loss_fn, self.levels, name, optimizer, lr, device
                )
                for r in self.frame.itertuples():
                    if r.error:
                        self.errors[f"memory ({r.configuration})"] = r.error
            except Exception as e:  # noqa: BLE001 - named in the result, the rest is kept
                self.errors["memory"] = f"{type(e).__name__}: {e}"
            done += 1
        if self.trace:
            step("overflow tracer", done)
            try:
                self.overflow = trace_overflow(model, x, loss_fn, dtype=half)
            except Exception as e:  # noqa: BLE001 - named in the result, the rest is kept
                self.errors["overflow tracer"] = f"{type(e).__name__}: {e}"
            done += 1
        if self.precision is not None:
            step(f"precision trace ({self.precision})", done)
            try:
                self.precision_trace = trace_precision(
                    model, x, self.precision, loss_fn=loss_fn, half_dtype=half
                )
            except Exception as e:  # noqa: BLE001 - named in the result, the rest is kept
                self.errors["precision trace"] = f"{type(e).__name__}: {e}"
